"""NumPy kernels for convolution, pooling and LRN (the CPU speed lives here).

All image arrays are NCHW.  ``geom`` is the 2-D window geometry
``(kh, kw, sh, sw, ph, pw, dh, dw)``: kernel, stride, pad and dilation.

Convolution is im2col + GEMM.  The column matrix of a batch is built by one
strided copy (``as_strided`` over the padded input, no loop over images or
pixels).  A whole batch's column matrix can be hundreds of MB, which makes the
GEMM and the copies run from main memory, so a batch is cut into a few chunks
of images whose column matrix fits in cache (``_COL_CHUNK_BYTES``); each chunk
is one im2col and one GEMM per group (all groups in one batched matmul).
"""
import numpy as np
from numpy.lib.stride_tricks import as_strided

# Target size of one chunk's column matrix: about what the last-level cache
# holds next to the GEMM's other operands.
_COL_CHUNK_BYTES = 4 << 20


def conv_out_size(size, k, s, p, d):
    """Caffe's convolution output length (floor division)."""
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _pad(x, ph, pw, value=0):
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    out = np.empty((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    if value == 0:
        out[...] = 0
    else:
        out.fill(value)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def _chunk(n, per_image_bytes):
    """Images per chunk so that a chunk's column matrix stays in cache."""
    return int(max(1, min(n, _COL_CHUNK_BYTES // max(per_image_bytes, 1))))


def _is_pointwise(geom):
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    return kh == 1 and kw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0


def im2col(xpad, geom, oh, ow, out=None):
    """Column matrix of a padded batch ``xpad`` (N, C, Hp, Wp): returns
    (C*kh*kw, N*oh*ow), rows ordered (c, i, j) as Caffe's weight layout,
    columns ordered (n, y, x).  One strided copy."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    n, c = xpad.shape[:2]
    s_n, s_c, s_h, s_w = xpad.strides
    view = as_strided(xpad, (c, kh, kw, n, oh, ow),
                      (s_c, dh * s_h, dw * s_w, s_n, sh * s_h, sw * s_w), writeable=False)
    if out is None:
        out = np.empty((c, kh, kw, n, oh, ow), xpad.dtype)
    else:
        out = out.reshape(c, kh, kw, n, oh, ow)
    np.copyto(out, view)
    return out.reshape(c * kh * kw, n * oh * ow)


def col2im(col, geom, n, c, h, w, oh, ow):
    """Adjoint of :func:`im2col`: sums the (C*kh*kw, N*oh*ow) columns back
    into a padded (N, C, H+2ph, W+2pw) array (one strided add per kernel tap)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    xpad = np.zeros((n, c, h + 2 * ph, w + 2 * pw), col.dtype)
    col = col.reshape(c, kh, kw, n, oh, ow)
    hspan = sh * (oh - 1) + 1
    wspan = sw * (ow - 1) + 1
    for i in range(kh):
        for j in range(kw):
            dst = xpad[:, :, i * dh:i * dh + hspan:sh, j * dw:j * dw + wspan:sw]
            dst += col[:, i, j].transpose(1, 0, 2, 3)
    return xpad


def conv2d_forward(x, w, geom, group):
    """y (N, O, oh, ow) = conv(x (N, C, H, W), w (O, C/group, kh, kw))."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    oh = conv_out_size(h, kh, sh, ph, dh)
    ow = conv_out_size(wd, kw, sw, pw, dw)
    g = group
    wg = w.reshape(g, o // g, -1)
    if _is_pointwise(geom):
        # 1x1 convolution: a batched GEMM on the input itself.
        y = np.matmul(wg, x.reshape(n, g, c // g, h * wd))
        return y.reshape(n, o, oh, ow)
    y = np.empty((n, o, oh, ow), x.dtype)
    xpad = _pad(x, ph, pw)
    p = oh * ow
    k = c * kh * kw
    nb = _chunk(n, k * p * x.itemsize)
    buf = np.empty(k * nb * p, x.dtype)
    for a in range(0, n, nb):
        m = min(nb, n - a)
        col = im2col(xpad[a:a + m], geom, oh, ow, buf[:k * m * p])
        r = np.matmul(wg, col.reshape(g, k // g, m * p))          # (g, o/g, m*p)
        y[a:a + m] = r.reshape(o, m, oh, ow).transpose(1, 0, 2, 3)
    return y


def conv2d_backward(x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None):
    """Gradients of :func:`conv2d_forward`: returns (dx, dw), None where not
    asked for.  ``x`` may be None when only dx is needed (then ``x_shape``
    gives the input shape) -- that is also a transposed convolution."""
    kh, kw, sh, sw, ph, pw, dh, dw_ = geom
    if x_shape is None:
        x_shape = x.shape
    n, c, h, wd = x_shape
    o = w.shape[0]
    _, _, oh, ow = dy.shape
    g = group
    og, cg = o // g, c // g
    wg = w.reshape(g, og, -1)
    dtype = dy.dtype
    gx = gw = None
    if _is_pointwise(geom):
        dyr = dy.reshape(n, g, og, oh * ow)
        if need_dw:
            xr = x.reshape(n, g, cg, h * wd)
            gw = np.matmul(dyr, xr.transpose(0, 1, 3, 2)).sum(0).reshape(w.shape)
        if need_dx:
            gx = np.matmul(wg.transpose(0, 2, 1), dyr).reshape(x_shape)
        return gx, gw
    p = oh * ow
    k = c * kh * kw
    nb = _chunk(n, k * p * dtype.itemsize)
    if need_dw:
        xpad = _pad(x, ph, pw)
        buf = np.empty(k * nb * p, dtype)
        gw = np.zeros((g, og, k // g), dtype)
    if need_dx:
        gxpad = np.empty((n, c, h + 2 * ph, wd + 2 * pw), dtype)
        wt = wg.transpose(0, 2, 1)
    for a in range(0, n, nb):
        m = min(nb, n - a)
        # dy of the chunk as (g, o/g, m*p), the GEMM layout of the columns
        dyc = np.ascontiguousarray(dy[a:a + m].reshape(m, o, p).transpose(1, 0, 2)).reshape(g, og, m * p)
        if need_dw:
            col = im2col(xpad[a:a + m], geom, oh, ow, buf[:k * m * p]).reshape(g, k // g, m * p)
            gw += np.matmul(dyc, col.transpose(0, 2, 1))
        if need_dx:
            dcol = np.matmul(wt, dyc)                             # (g, k/g, m*p)
            gxpad[a:a + m] = col2im(dcol, geom, m, c, h, wd, oh, ow)
    if need_dw:
        gw = gw.reshape(w.shape)
    if need_dx:
        gx = gxpad[:, :, ph:ph + h, pw:pw + wd] if (ph or pw) else gxpad
        gx = np.ascontiguousarray(gx)
    return gx, gw


# --------------------------------------------------------------------- pooling
def _window_slices(k, s, n_out, d=1):
    """Slices picking, for each tap t < k, the n_out strided positions."""
    span = s * (n_out - 1) + 1
    return [slice(t * d, t * d + span, s) for t in range(k)]


def _pool_pad(x, geom, oh, ow, value):
    """Pad so every (possibly overhanging) window lies inside the array."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    hp = max(h + 2 * ph, (oh - 1) * sh + kh)
    wp = max(w + 2 * pw, (ow - 1) * sw + kw)
    if hp == h and wp == w:
        return x
    out = np.full((n, c, hp, wp), value, x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def _ave_divisor(size, k, s, p, n_out):
    """Caffe's AVE window sizes along one axis: each window clipped to
    [-p, size+p) (padding counts, overhang beyond it does not)."""
    start = np.arange(n_out) * s - p
    end = np.minimum(start + k, size + p)
    return end - start


def max_pool_forward(x, geom, oh, ow):
    """Returns (y, idx): y the window maxima, idx the flat h*W+w index in the
    unpadded image of each window's first maximum in raster order (Caffe's)."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    if oh == 1 and ow == 1 and kh >= h + ph and kw >= w + pw and ph == 0 and pw == 0:
        flat = x.reshape(n, c, h * w)
        idx = flat.argmax(axis=2)
        y = np.take_along_axis(flat, idx[:, :, None], 2)
        return y.reshape(n, c, 1, 1), idx.reshape(n, c, 1, 1).astype(np.int32)
    xpad = _pool_pad(x, geom, oh, ow, -np.inf)
    hp, wp = xpad.shape[2:]
    # Separable: first the row maxima over the kw taps, then over the kh rows.
    # Taking the first strict maximum at each stage gives the raster-order
    # first maximum of the window.
    col_idx = np.arange(wp, dtype=np.int32) - pw                  # x coordinate
    row = None
    row_arg = None
    for j, sl in enumerate(_window_slices(kw, sw, ow)):
        v = xpad[:, :, :, sl]
        if row is None:
            row = v.copy()
            row_arg = np.broadcast_to(col_idx[sl], row.shape).copy()
        else:
            better = v > row
            np.copyto(row, v, where=better)
            np.copyto(row_arg, col_idx[sl], where=better)
    # flat index of each row maximum
    row_arg += ((np.arange(hp, dtype=np.int32) - ph) * w)[:, None]
    y = None
    idx = None
    for i, sl in enumerate(_window_slices(kh, sh, oh)):
        v = row[:, :, sl]
        if y is None:
            y = v.copy()
            idx = row_arg[:, :, sl].copy()
        else:
            better = v > y
            np.copyto(y, v, where=better)
            np.copyto(idx, row_arg[:, :, sl], where=better)
    return y, idx


def max_pool_backward(dy, idx, x_shape):
    """Routes each output gradient to its argmax (sums where windows share it)."""
    n, c, h, w = x_shape
    hw = h * w
    offs = (np.arange(n * c, dtype=np.int64) * hw).reshape(n, c, 1, 1)
    flat = (idx + offs).ravel()
    dx = np.bincount(flat, weights=dy.ravel(), minlength=n * c * hw)
    return dx.astype(dy.dtype, copy=False).reshape(x_shape)


def ave_pool_forward(x, geom, oh, ow):
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    if oh == 1 and ow == 1 and kh >= h + ph and kw >= w + pw and ph == 0 and pw == 0:
        div = _ave_divisor(h, kh, sh, ph, 1)[0] * _ave_divisor(w, kw, sw, pw, 1)[0]
        return (x.sum(axis=(2, 3), keepdims=True) / div).astype(x.dtype, copy=False)
    xpad = _pool_pad(x, geom, oh, ow, 0)
    slw = _window_slices(kw, sw, ow)
    row = xpad[:, :, :, slw[0]].copy()
    for sl in slw[1:]:
        row += xpad[:, :, :, sl]
    slh = _window_slices(kh, sh, oh)
    y = row[:, :, slh[0]].copy()
    for sl in slh[1:]:
        y += row[:, :, sl]
    inv = 1.0 / np.outer(_ave_divisor(h, kh, sh, ph, oh), _ave_divisor(w, kw, sw, pw, ow))
    y *= inv.astype(x.dtype)
    return y


def ave_pool_backward(dy, geom, x_shape):
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x_shape
    oh, ow = dy.shape[2:]
    inv = 1.0 / np.outer(_ave_divisor(h, kh, sh, ph, oh), _ave_divisor(w, kw, sw, pw, ow))
    g = dy * inv.astype(dy.dtype)
    if oh == 1 and ow == 1 and kh >= h + ph and kw >= w + pw and ph == 0 and pw == 0:
        return np.ascontiguousarray(np.broadcast_to(g, x_shape))
    hp = max(h + 2 * ph, (oh - 1) * sh + kh)
    wp = max(w + 2 * pw, (ow - 1) * sw + kw)
    # transpose of the separable sums: spread over rows, then over columns
    row = np.zeros((n, c, hp, ow), dy.dtype)
    for sl in _window_slices(kh, sh, oh):
        row[:, :, sl] += g
    dxpad = np.zeros((n, c, hp, wp), dy.dtype)
    for sl in _window_slices(kw, sw, ow):
        dxpad[:, :, :, sl] += row
    return np.ascontiguousarray(dxpad[:, :, ph:ph + h, pw:pw + w])


# ------------------------------------------------------------------------- LRN
def _channel_window_sum(a, size, pre):
    """s[:, c] = sum of a[:, c-pre .. c-pre+size-1] (zeros outside)."""
    n, c = a.shape[:2]
    padded = np.zeros((n, c + size - 1) + a.shape[2:], a.dtype)
    padded[:, pre:pre + c] = a
    s = padded[:, 0:c].copy()
    for t in range(1, size):
        s += padded[:, t:t + c]
    return s


def _spatial_window_sum(a, size, pre):
    """Sum over a size x size window centred (offset pre) on each pixel, zeros
    outside: separable, one pass per axis."""
    n, c, h, w = a.shape
    padded = np.zeros((n, c, h, w + size - 1), a.dtype)
    padded[:, :, :, pre:pre + w] = a
    rows = padded[:, :, :, 0:w].copy()
    for t in range(1, size):
        rows += padded[:, :, :, t:t + w]
    padded = np.zeros((n, c, h + size - 1, w), a.dtype)
    padded[:, :, pre:pre + h] = rows
    s = padded[:, :, 0:h].copy()
    for t in range(1, size):
        s += padded[:, :, t:t + h]
    return s


def lrn_forward(x, size, alpha, beta, k, across_channels):
    """Returns (y, scale): y = x * scale**-beta with Caffe's scale."""
    pre = (size - 1) // 2
    sq = x * x
    if across_channels:
        scale = _channel_window_sum(sq, size, pre)
        scale *= x.dtype.type(alpha / size)
        scale += x.dtype.type(k)
    else:
        scale = _spatial_window_sum(sq, size, pre)
        scale *= x.dtype.type(alpha / (size * size))
        scale += x.dtype.type(1)
    y = np.power(scale, x.dtype.type(-beta))
    y *= x
    return y, scale


def lrn_backward(x, y, scale, dy, size, alpha, beta, across_channels):
    pre = (size - 1) // 2
    t = dy * y
    t /= scale
    if across_channels:
        # the window is symmetric for odd sizes; the transposed window starts
        # size-1-pre below
        acc = _channel_window_sum(t, size, size - 1 - pre)
        coef = 2.0 * alpha * beta / size
    else:
        acc = _spatial_window_sum(t, size, size - 1 - pre)
        coef = 2.0 * alpha * beta / (size * size)
    acc *= x
    acc *= x.dtype.type(-coef)
    acc += dy * np.power(scale, x.dtype.type(-beta))
    return acc
