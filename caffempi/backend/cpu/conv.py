"""Convolution on the CPU: the forward, the data gradient and the weight
gradient of Caffe's convolution (NCHW arrays, weights (O, C/group, kh, kw),
``geom`` = ``(kh, kw, sh, sw, ph, pw, dh, dw)``: kernel, stride, pad,
dilation).

Each of the three has a table of algorithms, ``(algorithm, suits, run)``
entries: :data:`FORWARD`, :data:`DATA_GRADIENT` and :data:`WEIGHT_GRADIENT`.
:func:`choose` takes the first entry whose ``suits`` holds for the
convolution's :class:`Shape`, so the order of a table is its decision; the
bounds the predicates use are where the measurements in docs/design/cpu.md
put them.  An algorithm in both gradient tables computes both gradients in
one pass over dy when both pick it.

The algorithms:

* ``pointwise``: a 1x1, stride 1, unpadded convolution is a batched GEMM on
  the input itself.
* ``direct``: the compiled kernels of :mod:`caffempi.backend.direct`
  (float32; the forward for few outputs a group or strided, the weight
  gradient for few outputs or small planes, the data gradient at stride 1
  over small planes): they keep their sums in registers where these skinny
  GEMMs pack their operands for few outputs.  ``pixel_direct``: the weight
  gradient of a first layer (few input channels), vectors along the
  output pixels.
* ``row_taps``: with vertical stride 1, the input is unfolded along the
  kernel width only (kw times its size) and the product split by kernel
  row: row i's part reads a contiguous column range of that unfolding, which
  copies kh times less than the full column matrix.
* ``columns``: the full column matrix (:func:`im2col`, by strided copies),
  for vertical strides > 1, few rows per product and long reductions over
  small outputs; the data gradient as GEMM + col2im.
* ``flipped_convolution``: with stride 1, the data gradient is itself a
  convolution of dy with the flipped weights, taken where it runs over not
  many more pixels than the output has.

Every algorithm works in chunks of images whose working set stays in cache
(:mod:`.chunking`), on the intra-op threads, with BLAS at one thread; its
scratch buffers persist between calls (:mod:`.scratch`).
"""
import functools
import typing

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import direct, threads
from . import scratch
from .chunking import chunks, each_chunk

# Row taps need at least this many rows (C/group*kw) in each product: with
# fewer their GEMMs starve and the column matrix wins.
ROW_TAP_MIN_K = 32

# The column path multiplies one column matrix per image, written straight
# to NCHW, where a product has at most this many rows (C/group*kh*kw): so
# short a reduction runs a chunk-wide product at memory speed, plus a
# reordering copy.
PER_IMAGE_MAX_K = 128

# Long reductions (C/group*kh*kw at least LONG_K) over small outputs (at most
# SMALL_P pixels: the 13x13 and 7x7 3x3 convolutions of CaffeNet and ResNet)
# take the column matrix, one product per image, for the forward and both
# gradients: one product with the whole reduction beats kh row-tap products
# of a kh-th of it.
LONG_K = 1024
SMALL_P = 256

# Their weight gradients take chunks of up to this size: each chunk's
# (O, C/group*kh*kw) partial sum is folded into the total, and with
# COL_CHUNK_BYTES chunks those folds were a large part of the time.
DW_CHUNK_BYTES = 4 << 20


class Shape(typing.NamedTuple):
    """What the algorithms' ``suits`` look at: input (n, c, h, w), outputs
    o of (oh, ow), the geometry, the group count and the dtype."""
    n: int
    c: int
    h: int
    w: int
    o: int
    oh: int
    ow: int
    geom: tuple
    group: int
    dtype: np.dtype

    @property
    def cg(self):
        """Input channels a group."""
        return self.c // self.group

    @property
    def og(self):
        """Output channels a group."""
        return self.o // self.group

    @property
    def p(self):
        """Output pixels of an image."""
        return self.oh * self.ow

    @property
    def kg(self):
        """Rows of a group's product: C/group*kh*kw."""
        return self.cg * self.geom[0] * self.geom[1]


class Algorithm(typing.NamedTuple):
    """An entry of a table: ``suits(shape)`` says whether it takes a
    convolution of that :class:`Shape`; ``run`` computes it, in the
    forward table as run(shape, x, w, bias, y) writing y, in the gradient
    tables as run(shape, x, w, dy, need_dx, need_dw) returning (dx, dw),
    the gradients asked for (an entry of one gradient table is asked for
    that gradient only)."""
    algorithm: str
    suits: typing.Callable
    run: typing.Callable


def choose(table, shape):
    """The first :class:`Algorithm` of ``table`` that suits ``shape`` (the
    last entry of each table suits every convolution)."""
    return next(entry for entry in table if entry.suits(shape))


def conv_out_size(size, k, s, p, d):
    """Caffe's convolution output length (floor division)."""
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def is_pointwise(geom):
    """Whether the convolution is 1x1, stride 1, unpadded: a plain product."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    return kh == 1 and kw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0


def long_and_small(k, p):
    """A product of ``k`` rows (C/group*kh*kw) for ``p`` output pixels that
    runs best as one column-matrix product per image (see LONG_K)."""
    return k >= LONG_K and p <= SMALL_P


def by_row_taps(geom, cg, p):
    """Whether the forward and the weight gradient run by kernel rows rather
    than through the full column matrix: vertical stride 1, at least
    ROW_TAP_MIN_K rows (C/group*kw) a product, and not
    :func:`long_and_small` (``p``: output pixels)."""
    return geom[2] == 1 and cg * geom[1] >= ROW_TAP_MIN_K and not long_and_small(cg * geom[0] * geom[1], p)


def dw_per_image(geom, cg, og, p):
    """Whether the row-tap weight gradient sums per-image partials: they
    (O/g, C/g*kw) are no larger than an output plane (p)."""
    return og * cg * geom[1] <= p


def conv2d_forward(x, w, geom, group, bias=None):
    """y (N, O, oh, ow) = conv(x (N, C, H, W), w (O, C/group, kh, kw)) + bias
    (O,) if given: added while each chunk's result is in cache, rather than
    in another pass over y."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    shape = Shape(n, c, h, wd, w.shape[0], conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw),
                  geom, group, x.dtype)
    y = np.empty((n, shape.o, shape.oh, shape.ow), x.dtype)
    choose(FORWARD, shape).run(shape, x, w, bias, y)
    return y


def conv2d_backward(x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None):
    """Gradients of :func:`conv2d_forward`: returns (dx, dw), None where not
    asked for.  ``x`` may be None when only dx is needed (then ``x_shape``
    gives the input shape) -- that is also a transposed convolution."""
    n, c, h, wd = x.shape if x_shape is None else x_shape
    shape = Shape(n, c, h, wd, w.shape[0], dy.shape[2], dy.shape[3], geom, group, dy.dtype)
    asked = {}     # run -> [dx, dw] it is to compute
    if need_dx:
        asked.setdefault(choose(DATA_GRADIENT, shape).run, [False, False])[0] = True
    if need_dw:
        asked.setdefault(choose(WEIGHT_GRADIENT, shape).run, [False, False])[1] = True
    gx = gw = None
    for run, (dx_here, dw_here) in asked.items():
        rx, rw = run(shape, x, w, dy, dx_here, dw_here)
        gx, gw = (rx if dx_here else gx), (rw if dw_here else gw)
    return gx, gw


def bias_grad(dy):
    """Sum of dy (N, C, ...) over every axis but the channels."""
    n, c = dy.shape[:2]
    r = dy.reshape(n, c, -1)
    return np.matmul(r, np.ones(r.shape[2], dy.dtype)).sum(0)


def _weight_product(dy, u, u_rows):
    """The sums over the last axis of dy (..., O, K) times u (..., R, K):
    dy @ u^T (..., O, R), or with ``u_rows`` u @ dy^T (..., R, O), for
    callers to take where R > O: OpenBLAS runs these skinny products
    faster with their longer side as rows (docs/design/cpu.md)."""
    if u_rows:
        return np.matmul(u, dy.swapaxes(-1, -2))
    return np.matmul(dy, u.swapaxes(-1, -2))


# ------------------------------------------------------------------ pointwise
def _pointwise_forward(s, x, w, bias, y):
    """1x1: a batched GEMM on the input itself."""
    g = s.group
    wg = w.reshape(g, s.og, -1)
    xr = x.reshape(s.n, g, s.cg, s.h * s.w)
    yr = y.reshape(s.n, g, s.og, s.h * s.w)

    def chunk(a, m):
        np.matmul(wg, xr[a:a + m], out=yr[a:a + m])
        if bias is not None:
            y[a:a + m] += bias.reshape(s.o, 1, 1)
    # each image's product is the same whatever the chunks: as many per thread
    each_chunk(chunks(s.n, (s.c + s.o) * s.h * s.w * x.itemsize, multiple=threads.thread_count()), chunk)


def _pointwise_backward(s, x, w, dy, need_dx, need_dw):
    """Both gradients of a 1x1 convolution in one pass over dy; dw per
    image by :func:`_weight_product`."""
    g, og, cg, hw = s.group, s.og, s.cg, s.h * s.w
    wg = w.reshape(g, og, cg)
    dyr = dy.reshape(s.n, g, og, hw)
    gx = gw = None
    if need_dw:
        xr = x.reshape(s.n, g, cg, hw)
        x_rows = cg > og
        gw = np.zeros((g, cg, og) if x_rows else (g, og, cg), s.dtype)
    if need_dx:
        gx = np.empty((s.n, s.c, s.h, s.w), s.dtype)
        gxr = gx.reshape(s.n, g, cg, hw)

    def chunk(a, m):
        if need_dx:
            np.matmul(wg.transpose(0, 2, 1), dyr[a:a + m], out=gxr[a:a + m])
        if need_dw:
            return _weight_product(dyr[a:a + m], xr[a:a + m], x_rows).sum(0)
    each_chunk(chunks(s.n, (s.c + s.o) * hw * s.dtype.itemsize), chunk, gw.__iadd__ if need_dw else None)
    if need_dw:
        gw = np.ascontiguousarray(gw.transpose(0, 2, 1) if x_rows else gw).reshape(w.shape)
    return gx, gw


# --------------------------------------------------------------------- direct
def _direct_forward(s, x, w, bias, y):
    """The compiled direct kernel (see :mod:`caffempi.backend.direct`)."""
    xpad = np.ascontiguousarray(_pad(x, s.geom[4], s.geom[5]))
    # each image's result is the same whatever the chunks: as many per thread
    parts = chunks(s.n, xpad[0].nbytes + y[0].nbytes, multiple=threads.thread_count())
    each_chunk(parts, direct.forward(xpad, w, s.geom, s.group, y, bias))


def _on_the_threads(gradient):
    """A compiled weight gradient (:mod:`caffempi.backend.direct`) on the
    intra-op threads: its items split over the threads, each running over
    the gradient's units (bands or images) in chunks that stay in cache
    and polling the pending communication between them
    (:func:`threads.poll`): one region, not one a chunk (those cost 4-19%
    at 2 threads)."""
    parts = chunks(gradient.units, gradient.unit_bytes)
    items = gradient.items(threads.thread_count())

    def item(i):
        for a, m in parts:
            gradient.run(items[i], a, m)
            threads.poll()
        gradient.finish(items[i])
    threads.for_chunks(len(items), item)
    return None, gradient.result()


def _direct_weight_gradient(s, x, w, dy, need_dx, need_dw):
    """The compiled weight-gradient kernel with vectors along the outputs
    (:class:`caffempi.backend.direct.WeightGradient`): dy copied by chunks
    of images, then its threads split the taps."""
    gradient = direct.WeightGradient(np.ascontiguousarray(_pad(x, s.geom[4], s.geom[5])), dy, s.geom, s.group,
                                     w.shape)
    each_chunk(chunks(s.n, dy[0].nbytes), gradient.copy_dy)
    return _on_the_threads(gradient)


def _direct_data_gradient(s, x, w, dy, need_dx, need_dw):
    """The compiled data-gradient kernel (see
    :class:`caffempi.backend.direct.DataGradient`), on chunks of images."""
    gradient = direct.DataGradient(dy, w, s.geom, s.group, (s.n, s.c, s.h, s.w))
    per_image = dy[0].nbytes + s.c * s.h * s.w * s.dtype.itemsize
    each_chunk(chunks(s.n, per_image, multiple=threads.thread_count()), gradient.run)
    return gradient.result(), None


def _pixel_weight_gradient(s, x, w, dy, need_dx, need_dw):
    """The compiled weight gradient with vectors along the output pixels
    (:class:`caffempi.backend.direct.PixelWeightGradient`): the input
    unfolded along the kernel width by chunks of images
    (:func:`_unfold_width`), then its threads split the outputs (or the
    taps)."""
    xpad = _pad(x, s.geom[4], s.geom[5])
    u = np.empty((s.n, s.c, s.geom[1], xpad.shape[2], s.ow), s.dtype)
    each_chunk(chunks(s.n, u[0].nbytes), lambda a, m: _unfold_width(xpad[a:a + m], s.geom, s.ow, u[a:a + m]))
    return _on_the_threads(direct.PixelWeightGradient(u, dy, s.geom, w.shape))


# ------------------------------------------------------------------- row taps
def _unfold_width(xpad, geom, ow, out):
    """The padded batch (N, C, Hp, Wp) unfolded along the kernel width into
    ``out`` (kw times its size): u[n, c, j, h, x] = xpad[n, c, h, x*sw + j*dw]."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    n, c, hp, _ = xpad.shape
    s_n, s_c, s_h, s_w = xpad.strides
    u = out.reshape(n, c, kw, hp, ow)
    np.copyto(u, as_strided(xpad, (n, c, kw, hp, ow), (s_n, s_c, dw * s_w, s_h, sw * s_w), writeable=False))
    return u


def _unfolded_chunks(xpad, geom, ow):
    """Chunks of images whose unfolding (:func:`_unfold_width`) fits in
    cache."""
    n, c, hp, _ = xpad.shape
    return chunks(n, c * geom[1] * hp * ow * xpad.itemsize)


def _unfold_chunk(xpad, geom, ow, group, a, m):
    """u (m, g, C/g*kw, Hp*ow): images a..a+m of xpad unfolded along the
    kernel width, in the calling thread's scratch buffer."""
    kw = geom[1]
    _, c, hp, _ = xpad.shape
    u = _unfold_width(xpad[a:a + m], geom, ow, scratch.buffer("unfold", m * c * kw * hp * ow, xpad.dtype))
    return u.reshape(m, group, (c // group) * kw, hp * ow)


def _row_tap_weights(w, group):
    """(kh, g, O/g, C/g*kw): the weights of kernel row i as one matrix per
    group, columns ordered (c, j) as the rows of :func:`_unfold_width`."""
    o, cg, kh, kw = w.shape
    wr = w.reshape(group, o // group, cg, kh, kw).transpose(3, 0, 1, 2, 4)
    return np.ascontiguousarray(wr).reshape(kh, group, o // group, cg * kw)


def _row_taps_forward(s, x, w, bias, y):
    """The convolution as kh products per image, one per kernel row (vertical
    stride 1): with the input unfolded along the kernel width only, u (C*kw,
    Hp*ow) per image, output row y of kernel row i reads unfolded row y +
    i*dh, so kernel row i's part of all outputs is W_i (O, C*kw) @ the
    contiguous column range of u from i*dh*ow, oh*ow long.  The products
    land in NCHW order (no reorder) and u is kw, not kh*kw, times the input;
    in chunks of images whose u stays in cache."""
    kh, ph, pw, dh = s.geom[0], s.geom[4], s.geom[5], s.geom[6]
    xpad = _pad(x, ph, pw)
    g, og, ow, p = s.group, s.og, s.ow, s.p
    wt = _row_tap_weights(w, g)
    yr = y.reshape(s.n, g, og, p)

    def chunk(a, m):
        u = _unfold_chunk(xpad, s.geom, ow, g, a, m)
        ya = yr[a:a + m]
        t = scratch.buffer("gemm", m * s.o * p, s.dtype).reshape(m, g, og, p)
        for i in range(kh):
            np.matmul(wt[i], u[..., i * dh * ow:i * dh * ow + p], out=t if i else ya)
            if i:
                ya += t
        if bias is not None:
            ya += bias.reshape(g, og, 1)
    each_chunk(_unfolded_chunks(xpad, s.geom, ow), chunk)


def _row_taps_per_image_weight_gradient(s, x, w, dy, need_dx, need_dw):
    """Weight gradient by kernel rows (see :func:`_row_taps_forward`), per
    image: dy (O/g, oh*ow) @ u_i.T summed over the images, where u_i is the
    column range of the width-unfolded input that kernel row i reads.  No
    reordering copies; for small partials (:func:`dw_per_image`)."""
    kh, kw, ph, pw, dh = s.geom[0], s.geom[1], s.geom[4], s.geom[5], s.geom[6]
    g, og, cg, ow, p = s.group, s.og, s.cg, s.ow, s.p
    gt = np.zeros((kh, g, og, cg * kw), s.dtype)
    dyr = dy.reshape(s.n, g, og, p)
    xpad = _pad(x, ph, pw)

    def chunk(a, m):
        u = _unfold_chunk(xpad, s.geom, ow, g, a, m)
        part = np.empty_like(gt)
        for i in range(kh):
            np.matmul(dyr[a:a + m], u[..., i * dh * ow:i * dh * ow + p].transpose(0, 1, 3, 2)).sum(0, out=part[i])
        return part
    each_chunk(_unfolded_chunks(xpad, s.geom, ow), chunk, gt.__iadd__)
    gw = gt.reshape(kh, g, og, cg, kw).transpose(1, 2, 3, 0, 4)
    return None, np.ascontiguousarray(gw).reshape(s.o, cg, kh, kw)


def _row_taps_weight_gradient(s, x, w, dy, need_dx, need_dw):
    """Weight gradient by kernel rows, one product per chunk of images with
    the images innermost: x reordered to (C, H, W, m) and unfolded to
    (C*kw, Hp*ow*m), where kernel row i's columns are one contiguous range
    over all images, times dy reordered to (oh*ow*m, O): one long
    reduction."""
    kh, kw, _, sw, ph, pw, dh, dw = s.geom
    c, h, wd, o = s.c, s.h, s.w, s.o
    g, og, cg, oh, ow, p = s.group, s.og, s.cg, s.oh, s.ow, s.p
    hp, wp = h + 2 * ph, wd + 2 * pw
    gt = np.zeros((kh, g, cg * kw, og), s.dtype)
    span = sw * (ow - 1) + 1

    def chunk(a, m):
        xt = scratch.buffer("dw_xt", c * hp * wp * m, s.dtype).reshape(c, hp, wp, m)
        if ph or pw:
            xt.fill(0)
        np.copyto(xt[:, ph:ph + h, pw:pw + wd], x[a:a + m].transpose(1, 2, 3, 0))
        u = scratch.buffer("unfold", c * kw * hp * ow * m, s.dtype).reshape(c, kw, hp, ow, m)
        for j in range(kw):
            np.copyto(u[:, j], xt[:, :, j * dw:j * dw + span:sw])
        u = u.reshape(g, cg * kw, hp * ow * m)
        d = scratch.buffer("dw_dy", p * m * o, s.dtype).reshape(oh, ow, m, o)
        np.copyto(d, dy[a:a + m].transpose(2, 3, 0, 1))
        d = d.reshape(p * m, g, og).transpose(1, 0, 2)
        part = np.empty_like(gt)
        for i in range(kh):
            np.matmul(u[..., i * dh * ow * m:(i * dh * ow + p) * m], d, out=part[i])
        return part
    each_chunk(chunks(s.n, c * kw * hp * ow * x.itemsize), chunk, gt.__iadd__)
    gw = gt.reshape(kh, g, cg, kw, og).transpose(1, 4, 2, 0, 3)
    return None, np.ascontiguousarray(gw).reshape(o, cg, kh, kw)


# -------------------------------------------------------------------- columns
def _pad(x, ph, pw):
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    out = np.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def im2col(xpad, geom, oh, ow, out=None, per_image=False):
    """Column matrix of a padded batch ``xpad`` (N, C, Hp, Wp): returns
    (C*kh*kw, N*oh*ow), rows ordered (c, i, j) as Caffe's weight layout,
    columns ordered (n, y, x); with ``per_image``, one such matrix per
    image, (N, C*kh*kw, oh*ow).

    With vertical stride 1 this is two strided copies: first the input is
    unfolded along the kernel width only, u[n, c, j, h, x] = xpad[n, c, h,
    x*sw + j*dw] (kw times the input), then every column-matrix row of an
    image is one contiguous oh*ow run of u.  Copying straight from xpad
    moves runs of only ow floats, which is slower than both copies
    together."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    n, c, hp, _ = xpad.shape
    lead = (n, c, kh, kw) if per_image else (c, kh, kw, n)
    if out is None:
        out = np.empty(lead + (oh * ow,), xpad.dtype)
    else:
        out = out.reshape(lead + (oh * ow,))
    if sh == 1:
        u = _unfold_width(xpad, geom, ow, scratch.buffer("unfold", n * c * kw * hp * ow, xpad.dtype))
        u_n, u_c, u_j, u_h, u_x = u.strides
        steps = (u_n, u_c, dh * u_h, u_j) if per_image else (u_c, dh * u_h, u_j, u_n)
        np.copyto(out, as_strided(u, lead + (oh * ow,), steps + (u_x,), writeable=False))
    else:
        s_n, s_c, s_h, s_w = xpad.strides
        steps = (s_n, s_c, dh * s_h, dw * s_w) if per_image else (s_c, dh * s_h, dw * s_w, s_n)
        np.copyto(out.reshape(lead + (oh, ow)),
                  as_strided(xpad, lead + (oh, ow), steps + (sh * s_h, sw * s_w), writeable=False))
    return out.reshape((n, c * kh * kw, oh * ow) if per_image else (c * kh * kw, n * oh * ow))


def col2im(col, geom, oh, ow, out):
    """Adjoint of :func:`im2col`: adds the (C*kh*kw, N*oh*ow) columns into the
    padded (N, C, Hp, Wp) array ``out`` (one strided add per kernel tap)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c = out.shape[:2]
    col = col.reshape(c, kh, kw, n, oh, ow)
    hspan = sh * (oh - 1) + 1
    wspan = sw * (ow - 1) + 1
    for i in range(kh):
        for j in range(kw):
            dst = out[:, :, i * dh:i * dh + hspan:sh, j * dw:j * dw + wspan:sw]
            dst += col[:, i, j].transpose(1, 0, 2, 3)
    return out


def _columns_forward(s, x, w, bias, y, per_image):
    """The convolution through the column matrix of each chunk of images:
    ``per_image``, one product per image written straight to NCHW; else
    one product for the chunk, reordered to NCHW as it is copied out."""
    g, og, kg, o, oh, ow, p = s.group, s.og, s.kg, s.o, s.oh, s.ow, s.p
    k = kg * g
    xpad = _pad(x, s.geom[4], s.geom[5])
    wg = w.reshape(g, og, kg)

    def chunk(a, m):
        col = im2col(xpad[a:a + m], s.geom, oh, ow, scratch.buffer("col", k * m * p, s.dtype), per_image)
        if per_image:
            ya = y[a:a + m].reshape(m, g, og, p)
            np.matmul(wg, col.reshape(m, g, kg, p), out=ya)
            if bias is not None:
                ya += bias.reshape(g, og, 1)
            return
        r = np.matmul(wg, col.reshape(g, kg, m * p),
                      out=scratch.buffer("gemm", o * m * p, s.dtype).reshape(g, og, m * p))
        r = r.reshape(o, m, oh, ow).transpose(1, 0, 2, 3)
        if bias is None:
            np.copyto(y[a:a + m], r)
        else:
            np.add(r, bias.reshape(o, 1, 1), out=y[a:a + m])
    each_chunk(chunks(s.n, k * p * x.itemsize), chunk)


def _columns_backward(s, x, w, dy, need_dx, need_dw):
    """The gradients asked for through column matrices, in one pass over the
    chunks of dy: dw = dy @ im2col(x)^T (:func:`_weight_product`); dx by the
    GEMM W^T @ dy and col2im (with unit strides a two-stage col2im over
    contiguous runs)."""
    kh, kw, sh, sw, ph, pw, dh, dw_ = s.geom
    n, c, h, wd = s.n, s.c, s.h, s.w
    g, og, kg, o, oh, ow, p = s.group, s.og, s.kg, s.o, s.oh, s.ow, s.p
    k = kg * g
    dtype = s.dtype
    wg = w.reshape(g, og, kg)
    unit = sh == 1 and sw == 1
    gx = gw = None
    if need_dw:
        xpad = _pad(x, ph, pw)
        col_rows = kg > og
        gwg = np.zeros((g, kg, og) if col_rows else (g, og, kg), dtype)
    if need_dx:
        wt = wg.transpose(0, 2, 1)
        if unit:
            gx = np.empty((n, c, h, wd), dtype)
            hpd, wpd = dh * (kh - 1) + oh, dw_ * (kw - 1) + ow   # = padded h, w
        else:
            gxpad = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype)

    def chunk(a, m):
        if need_dw or (need_dx and not unit):
            # dy of the chunk as (g, o/g, m*p), matching the columns' order:
            # runs of p floats (a view for one image), not a transposed
            # (g, m*p, o/g) copy
            dyo = dy[a:a + m].reshape(m, g, og, p).transpose(1, 2, 0, 3)
            if m > 1:
                buf = scratch.buffer("dyo", o * m * p, dtype).reshape(g, og, m, p)
                np.copyto(buf, dyo)
                dyo = buf
            dyo = dyo.reshape(g, og, m * p)
        if need_dx and unit:
            # GEMM columns ordered (y, x, n) (dy copied in that order), then a
            # two-stage col2im: the kh row taps summed into v (c, kw, hp, ow,
            # m), runs of oh*ow*m floats, then the kw column taps into
            # (c, hp, wp, m), runs of ow*m; one transpose to NCHW at the end.
            # The GEMM is the minimal 2*k*o*p per image and no add is shorter
            # than ow*m floats.
            dyc = scratch.buffer("dyc", o * m * p, dtype).reshape(g, oh, ow, m, og)
            np.copyto(dyc, dy[a:a + m].reshape(m, g, og, oh, ow).transpose(1, 3, 4, 0, 2))
            dcol = np.matmul(wt, dyc.reshape(g, m * p, og).transpose(0, 2, 1),
                             out=scratch.buffer("dcol", k * m * p, dtype).reshape(g, kg, m * p))
            dcol = dcol.reshape(c, kh, kw, oh, ow, m)
            v = scratch.buffer("dcol_v", c * kw * hpd * ow * m, dtype).reshape(c, kw, hpd, ow, m)
            _tap_sum(v, [dcol[:, i] for i in range(kh)], 2, dh, oh)
            gt = scratch.buffer("dcol_u", c * hpd * wpd * m, dtype).reshape(c, hpd, wpd, m)
            _tap_sum(gt, [v[:, j] for j in range(kw)], 2, dw_, ow)
            np.copyto(gx[a:a + m], gt[:, ph:ph + h, pw:pw + wd].transpose(3, 0, 1, 2))
        elif need_dx:
            dcol = np.matmul(wt, dyo, out=scratch.buffer("dcol", k * m * p, dtype).reshape(g, kg, m * p))
            col2im(dcol, s.geom, oh, ow, gxpad[a:a + m])
        if need_dw:
            col = im2col(xpad[a:a + m], s.geom, oh, ow, scratch.buffer("col", k * m * p, dtype)).reshape(g, kg, m * p)
            return _weight_product(dyo, col, col_rows)
    # a long-and-small weight gradient alone takes chunks of DW_CHUNK_BYTES
    limit = DW_CHUNK_BYTES if need_dw and not need_dx and long_and_small(kg, p) else None
    each_chunk(chunks(n, k * p * dtype.itemsize, limit), chunk, gwg.__iadd__ if need_dw else None)
    if need_dw:
        gw = np.ascontiguousarray(gwg.transpose(0, 2, 1) if col_rows else gwg).reshape(w.shape)
    if need_dx and not unit:
        gx = np.ascontiguousarray(gxpad[:, :, ph:ph + h, pw:pw + wd] if (ph or pw) else gxpad)
    return gx, gw


def _tap_sum(dst, taps, axis, step, run):
    """dst = sum over t of taps[t] placed at [t*step, t*step+run) along
    ``axis`` (zeros elsewhere): copies where nothing is written yet, adds
    only where windows overlap."""
    def at(lo, hi):
        return dst[(slice(None),) * axis + (slice(lo, hi),)]

    def part(src, lo, hi):
        return src[(slice(None),) * axis + (slice(lo, hi),)]
    end = dst.shape[axis]
    if step > run:
        dst[...] = 0
        for t, src in enumerate(taps):
            at(t * step, t * step + run)[...] += src
        return dst
    np.copyto(at(0, run), taps[0])
    written = run
    for t in range(1, len(taps)):
        lo = t * step
        at(lo, written)[...] += part(taps[t], 0, written - lo)
        np.copyto(at(written, lo + run), part(taps[t], written - lo, run))
        written = lo + run
    if written < end:
        at(written, end)[...] = 0
    return dst


# -------------------------------------------------------- flipped convolution
def _flipped_padding(geom):
    """The padding of the convolution that maps dy to dx for stride 1: the
    kernel's extent minus the pad."""
    kh, kw, _, _, ph, pw, dh, dw = geom
    return dh * (kh - 1) - ph, dw * (kw - 1) - pw


def _flipped_convolution_suits(s):
    """Stride 1, and the flipped convolution's h*w outputs not much more
    than the oh*ow inputs (padded "same" convolutions, not LeNet's valid
    ones): then it beats GEMM + col2im's kh*kw strided scatter-adds."""
    kh, kw, sh, sw, _, _, dh, dw = s.geom
    fph, fpw = _flipped_padding(s.geom)
    return (sh == 1 and sw == 1 and fph >= 0 and fpw >= 0 and s.h * s.w <= 1.5 * s.p
            and conv_out_size(s.oh, kh, 1, fph, dh) == s.h and conv_out_size(s.ow, kw, 1, fpw, dw) == s.w)


def _flipped_data_gradient(s, x, w, dy, need_dx, need_dw):
    """dx as the convolution of dy with the weights spatially flipped, input
    and output channels swapped within each group (any forward algorithm)."""
    kh, kw, _, _, _, _, dh, dw = s.geom
    o, cg = w.shape[:2]
    og = o // s.group
    wf = w.reshape(s.group, og, cg, kh, kw)[:, :, :, ::-1, ::-1].transpose(0, 2, 1, 3, 4)
    wf = np.ascontiguousarray(wf).reshape(s.group * cg, og, kh, kw)
    return conv2d_forward(dy, wf, (kh, kw, 1, 1) + _flipped_padding(s.geom) + (dh, dw), s.group), None


# --------------------------------------------------------------------- tables
def _always(s):
    return True


FORWARD = (
    Algorithm("pointwise", lambda s: is_pointwise(s.geom), _pointwise_forward),
    Algorithm("direct", lambda s: s.dtype == np.float32 and direct.suits(s.cg, s.og, s.geom) and direct.available(),
              _direct_forward),
    Algorithm("row_taps", lambda s: by_row_taps(s.geom, s.cg, s.p), _row_taps_forward),
    Algorithm("columns_per_image", lambda s: s.kg <= PER_IMAGE_MAX_K or long_and_small(s.kg, s.p),
              functools.partial(_columns_forward, per_image=True)),
    Algorithm("columns", _always, functools.partial(_columns_forward, per_image=False)),
)

DATA_GRADIENT = (
    Algorithm("pointwise", lambda s: is_pointwise(s.geom), _pointwise_backward),
    Algorithm("direct", lambda s: s.dtype == np.float32 and direct.suits_data_gradient(s.cg, s.geom, s.h * s.w)
              and direct.available(), _direct_data_gradient),
    Algorithm("flipped_convolution", _flipped_convolution_suits, _flipped_data_gradient),
    Algorithm("columns", _always, _columns_backward),
)

WEIGHT_GRADIENT = (
    Algorithm("pointwise", lambda s: is_pointwise(s.geom), _pointwise_backward),
    Algorithm("pixel_direct", lambda s: s.dtype == np.float32 and s.group == 1
              and direct.suits_pixel_weight_gradient(s.c, s.geom, s.p) and direct.available(), _pixel_weight_gradient),
    Algorithm("direct", lambda s: s.dtype == np.float32 and direct.suits_weight_gradient(s.cg, s.og, s.geom, s.p)
              and direct.available(), _direct_weight_gradient),
    Algorithm("row_taps_per_image", lambda s: by_row_taps(s.geom, s.cg, s.p) and dw_per_image(s.geom, s.cg, s.og, s.p),
              _row_taps_per_image_weight_gradient),
    Algorithm("row_taps", lambda s: by_row_taps(s.geom, s.cg, s.p), _row_taps_weight_gradient),
    Algorithm("columns", _always, _columns_backward),
)
