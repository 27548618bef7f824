"""MAX and AVE pooling on the CPU (NCHW; ``geom`` as the convolutions'),
image chunks on the intra-op threads.

MAX pooling runs the compiled kernels of :mod:`caffempi.backend.pooling`
where they run (x86-64 with llvmlite, ``CAFFEMPI_COMPILED_POOLING`` on),
since a compiled loop reads each input once (docs/design/cpu.md); the one
NumPy fallback elsewhere is separable, over stride phases
(:func:`numpy_max_forward`).  Both give each window's first maximum in
raster order (Caffe's); on NaN inputs they differ (the compiled loops pass
NaN over as Caffe does, NumPy's maximum propagates it).

AVE pooling divides by Caffe's window sizes (clipped to the padded image):
one GEMM against an averaging matrix for small outputs, separable window
sums otherwise.
"""
import functools

import numpy as np

from .. import pooling
from . import scratch
from .chunking import over_images


def max_pool_forward(x, geom, oh, ow):
    """Returns (y, idx): y the window maxima, idx the flat h*W+w index in the
    unpadded image of each window's first maximum in raster order (Caffe's)."""
    n, c = x.shape[:2]
    y, idx = np.empty((n, c, oh, ow), x.dtype), np.empty((n, c, oh, ow), np.int32)
    if pooling.available(x.dtype):
        return tuple(over_images(lambda t, yt, it: pooling.max_forward(t, geom, yt, it),
                                  [np.ascontiguousarray(x)], [y, idx]))
    return tuple(over_images(lambda t, yt, it: numpy_max_forward(t, geom, oh, ow, yt, it), [x], [y, idx]))


def max_pool_backward(dy, idx, geom, x_shape):
    """dx (``x_shape``): each output gradient added at its ``idx``."""
    dx = np.empty(x_shape, dy.dtype)
    if pooling.available(dy.dtype):
        inputs = [np.ascontiguousarray(dy), np.ascontiguousarray(idx, np.int32)]
        return over_images(pooling.max_backward, inputs, [dx])[0]
    return over_images(lambda d, i, dxt: numpy_max_backward(d, i, geom, dxt), [dy, idx], [dx])[0]


def ave_pool_forward(x, geom, oh, ow):
    y = np.empty(x.shape[:2] + (oh, ow), x.dtype)
    return over_images(lambda t, yt: _ave_pool_forward(t, geom, oh, ow, yt), [x], [y])[0]


def ave_pool_backward(dy, geom, x_shape):
    dx = np.empty(x_shape, dy.dtype)
    return over_images(lambda d, dxt: _ave_pool_backward(d, geom, dxt), [dy], [dx])[0]


# ------------------------------------------------------------ NumPy MAX pooling
def numpy_max_forward(x, geom, oh, ow, y, idx):
    """MAX pooling of the images x into y and idx, as :func:`max_pool_forward`
    returns them, in NumPy.  Global pooling is one argmax.  Otherwise
    separable: the maxima over the kw taps of each row, then over kh rows;
    taking the first strict maximum at each stage gives the window's
    raster-order first.  Each stage runs on stride phases of its axis, where
    every tap is one long contiguous ufunc (:func:`_window_max`)."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    if _is_global(geom, h, w, oh, ow):
        flat = x.reshape(n, c, h * w)
        i = flat.argmax(axis=2)
        np.copyto(y.reshape(n, c, 1), np.take_along_axis(flat, i[:, :, None], 2))
        np.copyto(idx.reshape(n, c), i)
        return
    phases, hp = _padded_width_phases(x, geom, oh, ow, -np.inf)
    row, jtap, _ = _window_max(phases, kw, sw, ow)
    row = row.reshape(n * c, hp, ow)
    jtap = jtap.reshape(n * c, hp, ow)
    best, itap, jsel = _window_max(_phases(row, sh, 0), kh, sh, oh, _phases(jtap, sh, 0))
    np.copyto(y.reshape(best.shape), best)
    hs = (np.arange(oh, dtype=np.int32) * sh - ph) * w
    ws = np.arange(ow, dtype=np.int32) * sw - pw
    i = idx.reshape(itap.shape)
    np.multiply(itap, np.int32(w), out=i)
    i += jsel
    i += (hs[:, None] + ws[None, :])


def numpy_max_backward(dy, idx, geom, dx):
    """Routes each output gradient to its argmax in dx (summing where windows
    that overlap share one; np.add.at is a fast scatter-add in NumPy 2)."""
    kh, kw, sh, sw = geom[:4]
    n, c, h, w = dx.shape
    offs = (np.arange(n * c, dtype=np.intp) * (h * w)).reshape(n, c, 1, 1)
    flat = (idx + offs).ravel()
    dx.fill(0)
    if kh > sh or kw > sw:
        np.add.at(dx.reshape(-1), flat, dy.ravel())
    else:
        dx.reshape(-1)[flat] = dy.ravel()


def _is_global(geom, h, w, oh, ow):
    kh, kw, sh, sw, ph, pw = geom[:6]
    return oh == 1 and ow == 1 and kh >= h and kw >= w and ph == 0 and pw == 0


# ------------------------------------------------------------------ AVE pooling
# AVE pooling with at most this many outputs per plane is one GEMM against
# the (h*w, oh*ow) averaging matrix (see _ave_matrix).
_AVE_GEMM_MAX_OUT = 64


def _ave_scale(geom, h, w, oh, ow, dtype):
    kh, kw, sh, sw, ph, pw = geom[:6]
    div = np.outer(_ave_divisor(h, kh, sh, ph, oh), _ave_divisor(w, kw, sw, pw, ow))
    return (1.0 / div).astype(dtype)


@functools.lru_cache(maxsize=64)
def _ave_matrix(geom, h, w, oh, ow, dtype):
    """The averaging as a matrix: column (oy, ox) holds 1/divisor at the
    pixels of its (clipped) window.  The GEMM does 2*h*w FLOPs per output,
    which for small outputs beats the separable strided sums by far, and
    loses for large ones (docs/design/cpu.md, "AVE pooling").  Read-only."""
    kh, kw, sh, sw, ph, pw = geom[:6]

    def band(size, k, s, p, n_out):
        start = np.arange(n_out) * s - p
        pos = np.arange(size)[:, None]
        return (pos >= start) & (pos < start + k)
    m = np.kron(band(h, kh, sh, ph, oh), band(w, kw, sw, pw, ow)).astype(np.float64)
    m /= np.outer(_ave_divisor(h, kh, sh, ph, oh), _ave_divisor(w, kw, sw, pw, ow)).reshape(-1)
    m = m.astype(dtype)
    m.flags.writeable = False
    return m


def _ave_pool_forward(x, geom, oh, ow, y):
    """AVE pooling of the images x into y."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    if oh * ow <= _AVE_GEMM_MAX_OUT:      # global pooling included (one output)
        m = _ave_matrix(tuple(geom[:6]), h, w, oh, ow, x.dtype.str)
        np.matmul(x.reshape(n * c, h * w), m, out=y.reshape(n * c, oh * ow))
        return
    scale = _ave_scale(geom, h, w, oh, ow, x.dtype)
    # separable window sums (zero padding), as for MAX
    phases, hp = _padded_width_phases(x, geom, oh, ow, 0)
    row = _window_sum(phases, kw, sw, ow).reshape(n * c, hp, ow)
    np.multiply(_window_sum(_phases(row, sh, 0), kh, sh, oh).reshape(n, c, oh, ow), scale, out=y)


def _ave_pool_backward(dy, geom, dx):
    """The gradient of AVE pooling, into dx (the images' input shape)."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = dx.shape
    oh, ow = dy.shape[2:]
    if oh * ow <= _AVE_GEMM_MAX_OUT:      # global pooling included (one output)
        m = _ave_matrix(tuple(geom[:6]), h, w, oh, ow, dy.dtype.str)
        np.matmul(dy.reshape(n * c, oh * ow), m.T, out=dx.reshape(n * c, h * w))
        return
    g = dy * _ave_scale(geom, h, w, oh, ow, dy.dtype)
    hp = max(h + 2 * ph, (oh - 1) * sh + kh)
    wp = max(w + 2 * pw, (ow - 1) * sw + kw)
    # transpose of the separable sums: spread over rows, then over columns
    # (strided adds, faster here than the phase trick of the forward)
    rows = np.zeros((n, c, hp, ow), dy.dtype)
    for sl in _window_slices(kh, sh, oh):
        rows[:, :, sl] += g
    dxpad = np.zeros((n, c, hp, wp), dy.dtype)
    for sl in _window_slices(kw, sw, ow):
        dxpad[:, :, :, sl] += rows
    np.copyto(dx, dxpad[:, :, ph:ph + h, pw:pw + w])


# --------------------------------------------------- windows over stride phases
def _ave_divisor(size, k, s, p, n_out):
    """Caffe's AVE window sizes along one axis: each window clipped to
    [-p, size+p) (padding counts, overhang beyond it does not)."""
    start = np.arange(n_out) * s - p
    end = np.minimum(start + k, size + p)
    return end - start


def _phases(a, s, fill):
    """Split axis 1 of a (B, L, inner) array into its s stride phases, each a
    contiguous (B, ceil(L/s), inner) array (short phases padded with fill)."""
    if s == 1:
        return [a]
    b, length, inner = a.shape
    lq = -(-length // s)
    out = []
    for r in range(s):
        part = a[:, r::s]
        if part.shape[1] == lq:
            out.append(np.ascontiguousarray(part))
        else:
            ph = np.empty((b, lq, inner), a.dtype)
            ph[:, :part.shape[1]] = part
            ph[:, part.shape[1]:] = fill
            out.append(ph)
    return out


def _window_max(phases, k, s, n_out, payload=None):
    """Max over windows of k taps, stride s, along axis 1 of an array given as
    its s stride phases (see :func:`_phases`), each contiguous (B, lq, inner):
    returns (max, tap, payload at the tap), each (B, n_out, inner); tap is
    the first maximising tap (int8).

    Every tap is a shifted contiguous 1-D view of a phase, so each step is one
    long vectorised ufunc (positions that start no window are computed too and
    thrown away, which is cheaper than strided access).
    """
    b, lq, inner = phases[0].shape
    dtype = phases[0].dtype
    total = b * lq * inner
    span = total - ((k - 1) // s) * inner          # positions whose window fits
    flat = [p.reshape(-1) for p in phases]
    best = scratch.buffer("pool_best", total, dtype)
    best[span:] = 0
    best[:span] = flat[0][:span]
    tap = scratch.buffer("pool_tap", total, np.int8)
    tap[...] = 0
    sel = None
    if payload is not None:
        pflat = [p.reshape(-1) for p in payload]
        sel = scratch.buffer("pool_sel", total, payload[0].dtype)
        sel[span:] = 0
        sel[:span] = pflat[0][:span]
    gt = scratch.buffer("pool_gt", span, bool)
    for j in range(1, k):
        off = (j // s) * inner
        v = flat[j % s][off:off + span]
        np.greater(v, best[:span], out=gt)
        np.maximum(best[:span], v, out=best[:span])
        g8 = gt.view(np.int8)
        # later taps win only when strictly greater: first max in scan order
        np.maximum(tap[:span], g8 * np.int8(j), out=tap[:span])
        if sel is not None:
            ps = pflat[j % s][off:off + span]
            sel[:span] += g8 * (ps - sel[:span])
    shape = (b, lq, inner)
    crop = (slice(None), slice(0, n_out))
    # copies: the scratch buffers are reused by the next call
    out = [best.reshape(shape)[crop].copy(), tap.reshape(shape)[crop].copy()]
    out.append(sel.reshape(shape)[crop].copy() if sel is not None else None)
    return out


def _window_sum(phases, k, s, n_out):
    """Sums over windows of k taps, stride s (as :func:`_window_max`)."""
    b, lq, inner = phases[0].shape
    total = b * lq * inner
    span = total - ((k - 1) // s) * inner
    flat = [p.reshape(-1) for p in phases]
    acc = scratch.buffer("pool_sum", total, phases[0].dtype)
    acc[span:] = 0
    acc[:span] = flat[0][:span]
    for j in range(1, k):
        off = (j // s) * inner
        acc[:span] += flat[j % s][off:off + span]
    return acc.reshape(b, lq, inner)[:, :n_out].copy()


def _window_slices(k, s, n_out):
    """Slices picking, for each tap t < k, the n_out window starts."""
    span = s * (n_out - 1) + 1
    return [slice(t, t + span, s) for t in range(k)]


def _padded_width_phases(x, geom, oh, ow, fill):
    """The pooling input padded (pad, plus the overhang of the last windows)
    and split into its stride phases along W in one pass: sw arrays
    (N*C*Hp, ceil(Wp/sw), 1) holding padded columns r, r+sw, ..."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    hp = max(h + 2 * ph, (oh - 1) * sh + kh)
    wp = max(w + 2 * pw, (ow - 1) * sw + kw)
    wq = -(-wp // sw)
    out = []
    for r in range(sw):
        cols = np.arange(wq) * sw + r - pw          # source column of each slot
        valid = np.nonzero((cols >= 0) & (cols < w))[0]
        arr = np.empty((n, c, hp, wq), x.dtype)
        if len(valid) == wq and hp == h:
            arr[...] = x[:, :, :, cols[0]::sw][..., :wq]
        else:
            arr.fill(fill)
            if len(valid):
                q0, q1 = valid[0], valid[-1] + 1
                arr[:, :, ph:ph + h, q0:q1] = x[:, :, :, cols[q0]::sw][..., :q1 - q0]
        out.append(arr.reshape(n * c * hp, wq, 1))
    return out, hp
