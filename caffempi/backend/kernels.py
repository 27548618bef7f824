"""Backend dispatch for the kernels that need a per-backend implementation
(convolution, pooling, LRN's window sums, passes in blocks).  Each function
takes the array module ``xp`` first and forwards to
:mod:`caffempi.backend.cpu` (NumPy) or :mod:`caffempi.backend.gpu` (CuPy,
imported on first use)."""
import numpy as np

from . import cpu, on_host


def _impl(xp, name):
    if on_host(xp):
        return getattr(cpu, name)
    from . import gpu
    return getattr(gpu, name)


conv_out_size = cpu.conv_out_size


def conv2d_forward(xp, x, w, geom, group, bias=None, *, use_cudnn=False):
    """``use_cudnn`` (the layer's engine, :func:`caffempi.config.use_cudnn`)
    picks cuDNN's kernel on the GPU; the CPU has one kernel and ignores it."""
    if on_host(xp):
        return cpu.conv2d_forward(x, w, geom, group, bias)
    return _impl(xp, "conv2d_forward")(x, w, geom, group, bias, use_cudnn=use_cudnn)


def conv2d_backward(xp, x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None, *, use_cudnn=False):
    """The gradients (dx, dw); ``use_cudnn`` as in :func:`conv2d_forward`."""
    if on_host(xp):
        return cpu.conv2d_backward(x, w, dy, geom, group, need_dx, need_dw, x_shape)
    return _impl(xp, "conv2d_backward")(x, w, dy, geom, group, need_dx, need_dw, x_shape, use_cudnn=use_cudnn)


def im2col(xp, x, geom, oh, ow):
    """Column matrix (C*kh*kw, N*oh*ow) of the unpadded batch ``x`` (N, C, H,
    W): rows ordered (c, i, j) as Caffe's im2col, columns (n, y, x); zero
    outside the image."""
    if on_host(xp):
        ph, pw = geom[4], geom[5]
        return cpu.im2col(np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))), geom, oh, ow)
    return _impl(xp, "im2col")(x, geom, oh, ow)


def col2im(xp, col, x_shape, geom, oh, ow):
    """Adjoint of :func:`im2col`: the (N, C, H, W) array ``x_shape`` whose
    pixels hold the sums of the column entries read from them."""
    if on_host(xp):
        n, c, h, w = x_shape
        ph, pw = geom[4], geom[5]
        out = cpu.col2im(col, geom, oh, ow, np.zeros((n, c, h + 2 * ph, w + 2 * pw), col.dtype))
        return np.ascontiguousarray(out[:, :, ph:ph + h, pw:pw + w])
    return _impl(xp, "col2im")(xp.ascontiguousarray(col), x_shape, geom, oh, ow)


def matmul(xp, a, b):
    """a @ b for 2-D operands: on the CPU in blocks on the intra-op threads
    (:func:`caffempi.backend.cpu.matmul`), as one product on the GPU."""
    return cpu.matmul(a, b) if on_host(xp) else a @ b


def matmul_into(xp, a, b, out, accumulate=False):
    """out = a @ b (out += a @ b with ``accumulate``) for 2-D operands and a
    C-contiguous ``out``: on the CPU one GEMM into ``out``, beta 0 or 1
    (:func:`caffempi.backend.cpu.matmul_into`)."""
    if on_host(xp):
        return cpu.matmul_into(a, b, out, accumulate)
    if accumulate:
        out += a @ b
    else:
        out[...] = a @ b
    return out


def _einsum_sum(operands, axes):
    """einsum's sum over ``axes`` of the product of ``operands`` (of one
    shape; the other axes kept, in order)."""
    letters = "abcdefghijklmnop"[:operands[0].ndim]
    kept = "".join(c for i, c in enumerate(letters) if i not in axes)
    return np.einsum("%s->%s" % (",".join([letters] * len(operands)), kept), *operands)


def sum_over(xp, a, axes):
    """The sum of ``a`` over ``axes`` (the other axes kept, in order): on
    the CPU by einsum, which sums over non-contiguous axes (BatchNorm's and
    Scale's channels) 2-3 times as fast as ndarray.sum."""
    return _einsum_sum([a], axes) if on_host(xp) else a.sum(axis=axes)


def sum_of_products(xp, a, b, axes):
    """The sum of a * b over ``axes`` (arrays of one shape; the other axes
    kept, in order): on the CPU without the product's copy (einsum's sum of
    products, a pass over each operand), on the GPU as one product and sum."""
    return _einsum_sum([a, b], axes) if on_host(xp) else (a * b).sum(axis=axes)


def elementwise(xp, fn, *arrays, outputs=1, fused=None):
    """A new C-contiguous array ``out`` of arrays[0]'s shape and dtype,
    written by ``fn(*arrays, out=out)``, where ``fn`` is elementwise and
    the arrays share one shape: on the CPU one call per flat block of them
    on the intra-op threads (:func:`caffempi.backend.cpu.for_element_blocks`),
    on the GPU one call.  With ``outputs`` > 1, a tuple of that many new
    arrays, ``out`` the tuple of their blocks (several results of one pass
    over the inputs).  ``fused``: the name of a GPU kernel that computes
    what ``fn`` does in one launch (:func:`caffempi.backend.gpu.fused_kernel`:
    each of fn's CuPy calls is a launch and a pass over memory), used
    where it has one for these arrays."""
    outs = tuple(xp.empty(arrays[0].shape, arrays[0].dtype) for _ in range(outputs))
    if not on_host(xp):
        from . import gpu       # GPU only: the CPU's blocks run fn
        kernel = gpu.fused_kernel(fused, len(arrays), outputs) if fused else None
        if kernel is not None:
            kernel(*arrays, *outs)
        else:
            fn(*arrays, out=outs[0] if outputs == 1 else outs)
        return outs[0] if outputs == 1 else outs
    flat = [a.reshape(-1) for a in arrays]
    outs_flat = [o.reshape(-1) for o in outs]

    def block(b):
        out = tuple(o[b] for o in outs_flat)
        fn(*(a[b] for a in flat), out=out[0] if outputs == 1 else out)
    cpu.for_element_blocks(outs[0].size, outs[0].itemsize, block)
    return outs[0] if outputs == 1 else outs


def flat_blocks(xp, size, itemsize, body, starts=()):
    """Calls ``body(block)`` for slices ``block`` covering range(size) of
    flat arrays of ``itemsize`` bytes an element, for a pass of several
    elementwise steps over them: on the CPU blocks that stay in cache
    through the steps, none crossing an offset in ``starts``, on the
    intra-op threads (:func:`caffempi.backend.cpu.for_element_blocks`); on
    the GPU ``body(slice(None))``, a launch a step over the whole arrays."""
    if on_host(xp):
        cpu.for_element_blocks(size, itemsize, body, starts)
    else:
        body(slice(None))


def per_channel(xp, body, shape, dtype):
    """Calls ``body(block)`` for slices ``block`` of axis 1 of (outer, C,
    inner) arrays of ``shape`` and ``dtype``, each channel in one block, so
    that a body that reduces over axes 0 and 2 sees every channel whole: on
    the CPU blocks that stay in cache, on the intra-op threads
    (:func:`caffempi.backend.cpu.for_channel_blocks`; per-channel sums are
    then the same for any thread count), on the GPU ``body(slice(None))``."""
    if on_host(xp):
        cpu.for_channel_blocks(shape, np.dtype(dtype).itemsize, body)
    else:
        body(slice(None))


def bias_grad(xp, dy):
    return _impl(xp, "bias_grad")(dy)


def max_pool_forward(xp, x, geom, oh, ow):
    return _impl(xp, "max_pool_forward")(x, geom, oh, ow)


def max_pool_backward(xp, dy, idx, geom, x_shape):
    return _impl(xp, "max_pool_backward")(dy, idx, geom, x_shape)


def ave_pool_forward(xp, x, geom, oh, ow):
    return _impl(xp, "ave_pool_forward")(x, geom, oh, ow)


def ave_pool_backward(xp, dy, geom, x_shape):
    return _impl(xp, "ave_pool_backward")(dy, geom, x_shape)


def _negative_power(xp, scale, beta):
    """scale ** -beta (scale >= k > 0).  Caffe's nets use beta = 0.75,
    taken as 1 / sqrt(scale * sqrt(scale)), since NumPy's power is a scalar
    loop on AVX2 hosts (docs/design/cpu.md, "LRN"); four roundings against
    power's one: 1.3e-7 relative error at most, against power's 6e-8."""
    if beta != 0.75:
        return xp.power(scale, scale.dtype.type(-beta))
    r = xp.sqrt(scale)
    r *= scale
    xp.sqrt(r, out=r)
    return xp.reciprocal(r, out=r)


def lrn_forward(xp, x, size, alpha, beta, k, across_channels):
    """Returns (y, scale): y = x * scale**-beta with Caffe's scale.  On the
    GPU across channels these steps are one kernel
    (:func:`caffempi.backend.gpu.lrn_across_forward`); on the CPU they run
    on chunks of images on the intra-op threads (each image's numbers are
    its own, so the bits do not depend on the chunks)."""
    if not on_host(xp):
        if across_channels:
            from . import gpu       # GPU only: the CPU runs the steps below
            return gpu.lrn_across_forward(x, size, alpha, beta, k)
        return _lrn_forward(xp, x, size, alpha, beta, k, across_channels)
    return tuple(cpu.over_images(lambda xs, ys, scales: _lrn_forward(xp, xs, size, alpha, beta, k, across_channels,
                                                                      ys, scales),
                                 [x], [xp.empty_like(x), xp.empty_like(x)]))


def _lrn_forward(xp, x, size, alpha, beta, k, across_channels, y=None, scale=None):
    """:func:`lrn_forward`'s steps, into ``y`` and ``scale`` where given."""
    pre = (size - 1) // 2
    sq = x * x
    if across_channels:
        sums = _impl(xp, "channel_window_sum")(sq, size, pre)
        factor, base = alpha / size, k
    else:
        sums = _impl(xp, "spatial_window_sum")(sq, size, pre)
        factor, base = alpha / (size * size), 1
    scale = xp.multiply(sums, x.dtype.type(factor), out=sums if scale is None else scale)
    scale += x.dtype.type(base)
    power = _negative_power(xp, scale, beta)
    return xp.multiply(power, x, out=power if y is None else y), scale


def lrn_backward(xp, x, y, scale, dy, size, alpha, beta, across_channels):
    """dx of :func:`lrn_forward` (one kernel on the GPU across channels,
    chunks of images on the intra-op threads on the CPU)."""
    if not on_host(xp):
        if across_channels:
            from . import gpu       # GPU only: the CPU runs the steps below
            return gpu.lrn_across_backward(x, y, scale, dy, size, alpha, beta)
        return _lrn_backward(xp, x, y, scale, dy, size, alpha, beta, across_channels)
    return cpu.over_images(lambda *chunk: _lrn_backward(xp, *chunk[:4], size, alpha, beta, across_channels,
                                                        chunk[4]),
                           [x, y, scale, dy], [xp.empty_like(x)])[0]


def _lrn_backward(xp, x, y, scale, dy, size, alpha, beta, across_channels, dx=None):
    """:func:`lrn_backward`'s steps, into ``dx`` where given."""
    pre = (size - 1) // 2
    t = dy * y
    t /= scale
    if across_channels:
        # the window is symmetric for odd sizes; the transposed window starts
        # size-1-pre below
        acc = _impl(xp, "channel_window_sum")(t, size, size - 1 - pre)
        coef = 2.0 * alpha * beta / size
    else:
        acc = _impl(xp, "spatial_window_sum")(t, size, size - 1 - pre)
        coef = 2.0 * alpha * beta / (size * size)
    acc *= x
    acc *= x.dtype.type(-coef)
    return xp.add(acc, dy * _negative_power(xp, scale, beta), out=acc if dx is None else dx)


def dropout_mask(xp, shape, ratio, dtype):
    """Inverted dropout's mask: 1/(1-ratio) with probability 1-ratio, else 0,
    drawn from the process RNG (on the GPU, a device hash seeded by one draw
    of it, so runs stay reproducible from random_seed and resumable)."""
    return _impl(xp, "dropout_mask")(shape, ratio, np.dtype(dtype))
