"""NumPy kernels for convolution, pooling and LRN (the CPU speed lives here).

All image arrays are NCHW.  ``geom`` is the 2-D window geometry
``(kh, kw, sh, sw, ph, pw, dh, dw)``: kernel, stride, pad and dilation.

Convolution is GEMM over unfolded input, in chunks of images whose unfolded
input fits in cache (``_COL_CHUNK_BYTES``), all groups of a chunk in one
batched matmul: a whole batch's unfolding can be hundreds of MB, which makes
the GEMMs and copies run from main memory.  With vertical stride 1 (nearly
every conv) the input is unfolded along the kernel width only, kw times its
size, and the product is split by kernel row: row i's part reads a
contiguous column range of that unfolding (:func:`_conv_row_taps`,
:func:`_conv_dw_row_taps`), which copies kh times less than the full im2col.
Single-precision forwards with few outputs a group, or strided, run the
direct kernel of :mod:`.direct` instead, compiled for this CPU (it keeps its
sums in registers, where these skinny GEMMs pack their operands for few
outputs).  The full column matrix (:func:`im2col`, by strided copies with no
loop over images or pixels) remains for vertical strides > 1, few input rows
per product (LeNet's one-channel conv1; one matrix and product per image
when its reduction is short, see _PER_IMAGE_MAX_K), and the data gradient's
GEMM + col2im.  Scratch buffers persist between calls, one set per thread (see
:func:`_work`).  The chunks, and the images of a pooling, run on the
intra-op threads (:mod:`caffempi.backend.threads`), BLAS at one thread.
MAX pooling runs the compiled loops of :mod:`.pooling` where they run, one
NumPy fallback below elsewhere.

History and measurements, with what was tried and not kept:
docs/design/cpu.md
"""
import functools
import threading

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..common import rng
from . import cblas, direct, pooling, threads

# Target size of one chunk's column matrix.  OpenBLAS runs these skinny GEMMs
# (few output channels) at ~85-90 GFLOP/s on 0.5-2 MB column blocks and at
# ~55 on whole-batch ones; 0.5-4 MB measured about the same end to end.
_COL_CHUNK_BYTES = int(1.5 * (1 << 20))

# Convolutions with vertical stride 1 and at least this many rows in a row
# tap's product (C/group*kw) run as row-tap products (see _conv_row_taps).
# Measured forward ms at 1 thread with NumPy 2.4's OpenBLAS 0.3.31 (AMD
# EPYC, 2026-11-25), row taps against the column matrix: C*kw 15 (CIFAR10-
# quick conv1) 23.9 / 14.5, 9 (VGG conv1_1, batch 2) 23.5 / 10.7, 24 14.5 /
# 11.9, 48 22.6 / 24.4, 160 (CIFAR10-quick conv2) 26.5 / 30.8, 480 (CaffeNet
# conv2) 51.6 / 59.5; the bound was 8 with the OpenBLAS of the day it was set.
_ROW_TAP_MIN_K = 32

# The other forwards (few input rows, or vertical stride > 1) multiply one
# column matrix per image, written straight to NCHW, when a product has at
# most this many rows (C/group*kh*kw); otherwise one product per chunk of
# images.  With so short a reduction the chunk-wide product runs at memory
# speed (its operands and result leave the cache) and needs a reordering
# copy after; per image, 1 thread: LeNet conv1 (25 rows) 0.96-1.38 -> 0.67-1.0
# ms, 2-channel 3x3 (18) 0.9-1.15 -> 0.46-0.61, 3-channel 5x5/2 (75) 5.5 ->
# 4.8, 12-channel 3x3/2 (108) 1.45 -> 1.12; the same at 147 rows (ResNet's
# 7x7/2 conv1), 15% slower at 363 (AlexNet's conv1).
_PER_IMAGE_MAX_K = 128

# Small outputs with a long reduction (C/group*kh*kw at least _LONG_K and at
# most _SMALL_P output pixels: the 13x13 and 7x7 3x3 convolutions of
# CaffeNet and ResNet) also take the column matrix, one product per image,
# for the forward, the weight gradient and the data gradient's convolution:
# one product with the whole reduction rather than kh row-tap products of a
# kh-th of it.  Forward + backward at 1 / 2 threads against row taps
# (medians of 7 alternating pairs): CaffeNet conv3 (batch 8) 0.914 / 0.897,
# conv4 0.939 / 0.893, conv5 0.979 / 0.945, ResNet-50's 7x7 stage 0.904 /
# 0.787, its 14x14 stage 0.981 / 0.928; CIFAR10-quick's conv3 (800 rows,
# 8x8) stays on row taps (1.129 / 1.091 by columns).
_LONG_K = 1024
_SMALL_P = 256

# Their weight gradients through the column matrix take chunks of images up
# to this size: each chunk's (O, C/group*kh*kw) product is folded into the
# sum, and with 1.5 MB chunks (one 13x13 image of CaffeNet's conv3) those
# folds were a large part of the time.  4 against 1.5 MB, weight gradient at
# 1 / 2 threads (medians of 7 alternating pairs): ResNet-50's 7x7 3x3 conv
# (batch 8) 0.690 / 0.564, CaffeNet conv3 (8) 0.925 / 0.945, (32) 0.916 /
# 0.948, ResNet-50's 14x14 0.962 / 0.979, strided 28->14 0.950 / 0.970,
# CaffeNet conv4-5 0.985-1.014; short reductions lose (CIFAR10-quick conv1
# 1.13 / 1.15) and keep 1.5 MB.
_DW_CHUNK_BYTES = 4 << 20

_tls = threading.local()


def _work(slot, size, dtype):
    """A persistent scratch buffer of at least ``size`` elements, per thread
    and slot: fresh multi-MB temporaries page-fault on every call (in
    LeNet's conv2 dx that almost doubled the GEMM time)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    key = (slot, np.dtype(dtype).str)
    b = bufs.get(key)
    if b is None or b.size < size:
        b = bufs[key] = np.empty(max(size, 1), dtype)
    return b[:size]


def conv_out_size(size, k, s, p, d):
    """Caffe's convolution output length (floor division)."""
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def _pad(x, ph, pw):
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    out = np.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def images_per_chunk(n, per_image_bytes, limit):
    """Images per chunk (1 to n) so that a chunk's column matrix stays under
    ``limit`` bytes (in cache, on the CPU)."""
    return int(max(1, min(n, limit // max(per_image_bytes, 1))))


def _chunks(n, per_image_bytes, limit=None, multiple=1):
    """(a, m) for chunks of m images from image a, equal in size, each under
    ``limit`` (default _COL_CHUNK_BYTES; per image) as
    :func:`images_per_chunk`, and a ``multiple`` of them where n allows
    (the thread count, for kernels whose results do not depend on the
    chunks: no thread idles at the end); they run on the intra-op threads
    (:func:`_each_chunk`)."""
    count = -(-n // images_per_chunk(n, per_image_bytes, limit or _COL_CHUNK_BYTES))
    count = min(n, -(-count // multiple) * multiple)
    nb = -(-n // count)
    return [(a, min(nb, n - a)) for a in range(0, n, nb)]


def _each_chunk(chunks, body, fold=None):
    """body(a, m) for every chunk, on the intra-op threads; fold gets the
    results in chunk order (see threads.for_chunks)."""
    threads.for_chunks(len(chunks), lambda i: body(*chunks[i]), fold)


# Products of at least this many multiply-adds are split over the intra-op
# threads.
_SPLIT_MIN_MACS = 1 << 20


def _blocks(size, t, unit=32):
    """(start, length) of up to ``t`` blocks of ``size`` rows (or columns),
    cut at multiples of ``unit``."""
    step = -(-(-(-size // t)) // unit) * unit
    return [(i, min(step, size - i)) for i in range(0, size, step)]


def matmul(a, b):
    """a (M, K) @ b (K, N), split into one block of output rows (columns
    where M < 64) per intra-op thread, at multiples of 32 rows (128 columns).
    Unlike the convolutions' chunks these blocks depend on the thread count:
    at one thread the product stays whole, since splitting it cost 5-20% at
    1 thread (1024^3: 22.4 -> 26.6 ms).  OpenBLAS gives bitwise the same
    result for most row splits but not all (it has special kernels for
    small shapes), so products may differ in the last bits between thread
    counts."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.result_type(a, b))
    t = threads.thread_count()
    if t == 1 or m * n * k < _SPLIT_MIN_MACS or (m < 64 and n < 256):
        return np.matmul(a, b, out=out)
    if m >= 64:
        _each_chunk(_blocks(m, t), lambda i, r: np.matmul(a[i:i + r], b, out=out[i:i + r]))
    else:
        _each_chunk(_blocks(n, t, 128), lambda j, r: np.matmul(a, b[:, j:j + r], out=out[:, j:j + r]))
    return out


def matmul_into(a, b, out, accumulate=False):
    """out = a (M, K) @ b (K, N), or out += a @ b with ``accumulate``, with
    one GEMM (beta = 0 or 1) writing straight into the C-contiguous ``out``:
    no temporary product and no second pass over ``out``, which matters
    where a few rows make a large gradient (CaffeNet's fc6 at 8 images:
    4096 x 9216 from 8 rows, bound by memory: 29 ms against 78 for
    ``out += a @ b`` here).  Through :mod:`.cblas`, which releases the GIL;
    NumPy's products where that is missing.  Split into blocks of ``out``'s
    rows on the intra-op threads as :func:`matmul`."""
    if cblas.gemm is None or out.dtype.type not in (np.float32, np.float64) or not out.flags.c_contiguous:
        if accumulate:
            out += matmul(a, b)
        else:
            out[...] = matmul(a, b)
        return out
    m, n = out.shape
    a, b = (cblas.operand(x.astype(out.dtype, copy=False)) for x in (a, b))
    beta = 1.0 if accumulate else 0.0

    def rows(i, r):
        cblas.gemm(a[i:i + r], b, out[i:i + r], beta)
    t = threads.thread_count()
    if t == 1 or m * n * a.shape[1] < _SPLIT_MIN_MACS or m < 64:
        rows(0, m)
    else:
        _each_chunk(_blocks(m, t), rows)
    return out


def is_pointwise(geom):
    """Whether the convolution is 1x1, stride 1, unpadded: a plain product."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    return kh == 1 and kw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0


def _unfold_width(xpad, geom, ow, out):
    """The padded batch (N, C, Hp, Wp) unfolded along the kernel width into
    ``out`` (kw times its size): u[n, c, j, h, x] = xpad[n, c, h, x*sw + j*dw]."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    n, c, hp, _ = xpad.shape
    s_n, s_c, s_h, s_w = xpad.strides
    u = out.reshape(n, c, kw, hp, ow)
    np.copyto(u, as_strided(xpad, (n, c, kw, hp, ow), (s_n, s_c, dw * s_w, s_h, sw * s_w), writeable=False))
    return u


def im2col(xpad, geom, oh, ow, out=None, per_image=False):
    """Column matrix of a padded batch ``xpad`` (N, C, Hp, Wp): returns
    (C*kh*kw, N*oh*ow), rows ordered (c, i, j) as Caffe's weight layout,
    columns ordered (n, y, x); with ``per_image``, one such matrix per
    image, (N, C*kh*kw, oh*ow).

    With vertical stride 1 this is two strided copies: first the input is
    unfolded along the kernel width only, u[n, c, j, h, x] = xpad[n, c, h,
    x*sw + j*dw] (kw times the input), then every column-matrix row of an
    image is one contiguous oh*ow run of u.  Copying straight from xpad moves
    runs of only ow floats, and measured 1.3-1.8x slower than both copies
    together (CIFAR10-quick conv2: 8.6 -> 4.8 ms per batch)."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    n, c, hp, _ = xpad.shape
    lead = (n, c, kh, kw) if per_image else (c, kh, kw, n)
    if out is None:
        out = np.empty(lead + (oh * ow,), xpad.dtype)
    else:
        out = out.reshape(lead + (oh * ow,))
    if sh == 1:
        u = _unfold_width(xpad, geom, ow, _work("unfold", n * c * kw * hp * ow, xpad.dtype))
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


def conv2d_forward(x, w, geom, group, bias=None):
    """y (N, O, oh, ow) = conv(x (N, C, H, W), w (O, C/group, kh, kw)) + bias
    (O,) if given: added while each chunk's GEMM result is copied out, in
    cache, rather than in another pass over y."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    oh = conv_out_size(h, kh, sh, ph, dh)
    ow = conv_out_size(wd, kw, sw, pw, dw)
    g = group
    wg = w.reshape(g, o // g, -1)
    y = np.empty((n, o, oh, ow), x.dtype)
    if is_pointwise(geom):
        # 1x1 convolution: a batched GEMM on the input itself.
        xr = x.reshape(n, g, c // g, h * wd)
        yr = y.reshape(n, g, o // g, h * wd)

        def chunk(a, m):
            np.matmul(wg, xr[a:a + m], out=yr[a:a + m])
            if bias is not None:
                y[a:a + m] += bias.reshape(o, 1, 1)
        _each_chunk(_chunks(n, (c + o) * h * wd * x.itemsize), chunk)
        return y
    xpad = _pad(x, ph, pw)
    p = oh * ow
    k = c * kh * kw
    if x.dtype == np.float32 and direct.suits(c // g, o // g, geom) and direct.available():
        # few outputs a group, or strided: the direct kernel (see there)
        xpad = np.ascontiguousarray(xpad)
        # each image's result is the same whatever the chunks: as many per thread
        chunks = _chunks(n, xpad[0].nbytes + y[0].nbytes, multiple=threads.thread_count())
        _each_chunk(chunks, direct.forward(xpad, w, geom, g, y, bias))
        return y
    if _by_row_taps(geom, c // g, p):
        _conv_row_taps(xpad, w, geom, g, oh, ow, y, bias)
        return y
    per_image = k // g <= _PER_IMAGE_MAX_K or _long_and_small(k // g, p)

    def chunk(a, m):
        col = im2col(xpad[a:a + m], geom, oh, ow, _work("col", k * m * p, x.dtype), per_image)
        if per_image:
            ya = y[a:a + m].reshape(m, g, o // g, p)
            np.matmul(wg, col.reshape(m, g, k // g, p), out=ya)
            if bias is not None:
                ya += bias.reshape(g, o // g, 1)
            return
        r = np.matmul(wg, col.reshape(g, k // g, m * p),
                      out=_work("gemm", o * m * p, x.dtype).reshape(g, o // g, m * p))
        r = r.reshape(o, m, oh, ow).transpose(1, 0, 2, 3)
        if bias is None:
            np.copyto(y[a:a + m], r)
        else:
            np.add(r, bias.reshape(o, 1, 1), out=y[a:a + m])
    _each_chunk(_chunks(n, k * p * x.itemsize), chunk)
    return y


def _long_and_small(k, p):
    """A product of ``k`` rows (C/group*kh*kw) for ``p`` output pixels that
    runs best as one column-matrix product per image (see _LONG_K)."""
    return k >= _LONG_K and p <= _SMALL_P


def _by_row_taps(geom, cg, p):
    """Whether the forward and the weight gradient run by kernel rows
    (:func:`_conv_row_taps`, :func:`_conv_dw_row_taps`) rather than through
    the full column matrix: vertical stride 1, at least _ROW_TAP_MIN_K rows
    (C/group*kw) per product, and not :func:`_long_and_small` (``p``: output
    pixels).  Weight gradients with fewer rows, row taps against the column
    matrix (ms, 1 thread, medians of 5 alternating pairs): CIFAR10-quick
    conv1 29.0 / 19.7, VGG conv1_1 (batch 2) 18.3 / 11.7, 3 channels 3x3 8.5
    / 7.2; with more, CIFAR10-quick conv2 35.8 / 48.3."""
    return geom[2] == 1 and cg * geom[1] >= _ROW_TAP_MIN_K and not _long_and_small(cg * geom[0] * geom[1], p)


def _unfolded_chunks(xpad, geom, ow):
    """Chunks (:func:`_chunks`) of images whose unfolding (:func:`_unfold_width`)
    fits in cache."""
    n, c, hp, _ = xpad.shape
    return _chunks(n, c * geom[1] * hp * ow * xpad.itemsize)


def _unfold_chunk(xpad, geom, ow, group, a, m):
    """u (m, g, C/g*kw, Hp*ow): images a..a+m of xpad unfolded along the
    kernel width, in the calling thread's scratch buffer."""
    kw = geom[1]
    _, c, hp, _ = xpad.shape
    u = _unfold_width(xpad[a:a + m], geom, ow, _work("unfold", m * c * kw * hp * ow, xpad.dtype))
    return u.reshape(m, group, (c // group) * kw, hp * ow)


def _row_tap_weights(w, group):
    """(kh, g, O/g, C/g*kw): the weights of kernel row i as one matrix per
    group, columns ordered (c, j) as the rows of :func:`_unfold_width`."""
    o, cg, kh, kw = w.shape
    wr = w.reshape(group, o // group, cg, kh, kw).transpose(3, 0, 1, 2, 4)
    return np.ascontiguousarray(wr).reshape(kh, group, o // group, cg * kw)


def _conv_row_taps(xpad, w, geom, group, oh, ow, y, bias):
    """The convolution as kh products per image, one per kernel row (vertical
    stride 1): with the input unfolded along the kernel width only, u (C*kw,
    Hp*ow) per image, output row y of kernel row i reads unfolded row y +
    i*dh, so kernel row i's part of all outputs is W_i (O, C*kw) @ the
    contiguous column range of u from i*dh*ow, oh*ow long.  The products
    land in NCHW order (no reorder) and u is kw, not kh*kw, times the input.
    In chunks of images whose u stays in cache, at 1 BLAS thread: LeNet conv2
    3.1 -> 2.4 ms per batch, CIFAR10-quick conv1/conv2/conv3 12.1 -> 9.0,
    22.0 -> 18.2, 9.4 -> 8.0 ms.  With few rows per product (C*kw of LeNet's
    conv1 is 5) the GEMMs starve and the full column matrix wins (0.96 vs
    1.04 ms), hence _ROW_TAP_MIN_K."""
    kh, dh = geom[0], geom[6]
    n = xpad.shape[0]
    o = w.shape[0]
    g, og = group, o // group
    p = oh * ow
    wt = _row_tap_weights(w, g)
    yr = y.reshape(n, g, og, p)

    def chunk(a, m):
        u = _unfold_chunk(xpad, geom, ow, g, a, m)
        ya = yr[a:a + m]
        t = _work("gemm", m * o * p, xpad.dtype).reshape(m, g, og, p)
        for i in range(kh):
            np.matmul(wt[i], u[..., i * dh * ow:i * dh * ow + p], out=t if i else ya)
            if i:
                ya += t
        if bias is not None:
            ya += bias.reshape(g, og, 1)
    _each_chunk(_unfolded_chunks(xpad, geom, ow), chunk)


def _dw_per_image(geom, cg, og, p):
    """Whether :func:`_conv_dw_row_taps` sums per-image partials: they (O/g,
    C/g*kw) are no larger than an output plane (p)."""
    return og * cg * geom[1] <= p


def _conv_dw_row_taps(x, dy, geom, group, oh, ow):
    """Weight gradient by kernel rows (vertical stride 1; see
    :func:`_conv_row_taps`): row i's part is dy times the transposed column
    range u_i of the width-unfolded input that row i reads.  No full column
    matrix (kh times smaller copies).  Two layouts, measured per batch at 1
    BLAS thread against the full column matrix:

    * per image, dy (O/g, oh*ow) @ u_i.T summed over the images, when those
      partials are small (:func:`_dw_per_image`): no reordering copies
      (CIFAR10-quick conv1 9.2 -> 6.2 ms, LeNet conv1 1.15 -> 0.58);
    * otherwise one product per chunk of images with the images innermost:
      x reordered to (C, H, W, m) and unfolded to (C*kw, Hp*ow*m), where u_i
      is one contiguous column range over all images, times dy reordered to
      (oh*ow*m, O): one long reduction (LeNet conv2 3.25 -> 2.9,
      CIFAR10-quick conv2 21.2 -> 17.5, conv3 9.35 -> 7.9).  With few input
      channels the reorders cost more than that saves (LeNet conv1 1.95)."""
    kh, kw, _, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = dy.shape[1]
    g, og, cg = group, o // group, c // group
    p = oh * ow
    hp, wp = h + 2 * ph, wd + 2 * pw
    if _dw_per_image(geom, cg, og, p):
        gt = np.zeros((kh, g, og, cg * kw), dy.dtype)
        dyr = dy.reshape(n, g, og, p)
        xpad = _pad(x, ph, pw)

        def chunk(a, m):
            u = _unfold_chunk(xpad, geom, ow, g, a, m)
            part = np.empty_like(gt)
            for i in range(kh):
                np.matmul(dyr[a:a + m], u[..., i * dh * ow:i * dh * ow + p].transpose(0, 1, 3, 2)).sum(0, out=part[i])
            return part
        _each_chunk(_unfolded_chunks(xpad, geom, ow), chunk, gt.__iadd__)
        gw = gt.reshape(kh, g, og, cg, kw).transpose(1, 2, 3, 0, 4)
        return np.ascontiguousarray(gw).reshape(o, cg, kh, kw)
    gt = np.zeros((kh, g, cg * kw, og), dy.dtype)
    span = sw * (ow - 1) + 1

    def chunk(a, m):
        xt = _work("dw_xt", c * hp * wp * m, x.dtype).reshape(c, hp, wp, m)
        if ph or pw:
            xt.fill(0)
        np.copyto(xt[:, ph:ph + h, pw:pw + wd], x[a:a + m].transpose(1, 2, 3, 0))
        u = _work("unfold", c * kw * hp * ow * m, x.dtype).reshape(c, kw, hp, ow, m)
        for j in range(kw):
            np.copyto(u[:, j], xt[:, :, j * dw:j * dw + span:sw])
        u = u.reshape(g, cg * kw, hp * ow * m)
        d = _work("dw_dy", p * m * o, dy.dtype).reshape(oh, ow, m, o)
        np.copyto(d, dy[a:a + m].transpose(2, 3, 0, 1))
        d = d.reshape(p * m, g, og).transpose(1, 0, 2)
        part = np.empty_like(gt)
        for i in range(kh):
            np.matmul(u[..., i * dh * ow * m:(i * dh * ow + p) * m], d, out=part[i])
        return part
    _each_chunk(_chunks(n, c * kw * hp * ow * x.itemsize), chunk, gt.__iadd__)
    gw = gt.reshape(kh, g, cg, kw, og).transpose(1, 4, 2, 0, 3)
    return np.ascontiguousarray(gw).reshape(o, cg, kh, kw)


def _flipped_weights(w, group):
    """Weights of the convolution that maps dy to dx for stride 1: spatially
    flipped, input and output channels swapped within each group."""
    o, cg, kh, kw = w.shape
    og = o // group
    wf = w.reshape(group, og, cg, kh, kw)[:, :, :, ::-1, ::-1].transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(wf).reshape(group * cg, og, kh, kw)


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
    if is_pointwise(geom):
        dyr = dy.reshape(n, g, og, oh * ow)
        if need_dw:
            xr = x.reshape(n, g, cg, h * wd)
            gw = np.zeros((g, og, cg), dtype)
        if need_dx:
            gx = np.empty(x_shape, dtype)
            gxr = gx.reshape(n, g, cg, h * wd)

        def chunk(a, m):
            if need_dx:
                np.matmul(wg.transpose(0, 2, 1), dyr[a:a + m], out=gxr[a:a + m])
            if need_dw:
                return np.matmul(dyr[a:a + m], xr[a:a + m].transpose(0, 1, 3, 2)).sum(0)
        _each_chunk(_chunks(n, (c + o) * h * wd * dtype.itemsize), chunk, gw.__iadd__ if need_dw else None)
        return gx, (gw.reshape(w.shape) if need_dw else None)
    p = oh * ow
    k = c * kh * kw
    # With stride 1, dx is itself a convolution of dy (padded by the kernel
    # extent minus pad) with the flipped weights: an im2col + GEMM like the
    # forward, which beats GEMM + col2im (kh*kw strided scatter-adds).
    # That conv runs over all h*w inputs, so use it only when that is not much
    # more than the oh*ow outputs (padded "same" convs, not LeNet's valid ones).
    fph, fpw = dh * (kh - 1) - ph, dw_ * (kw - 1) - pw
    dx_as_conv = (need_dx and sh == 1 and sw == 1 and fph >= 0 and fpw >= 0
                  and h * wd <= 1.5 * oh * ow
                  and conv_out_size(oh, kh, 1, fph, dh) == h and conv_out_size(ow, kw, 1, fpw, dw_) == wd)
    if dx_as_conv:
        gx = conv2d_forward(dy, _flipped_weights(w, g), (kh, kw, 1, 1, fph, fpw, dh, dw_), g)
    col_dx = need_dx and not dx_as_conv
    if not need_dw and not col_dx:
        return gx, gw
    if need_dw and _by_row_taps(geom, cg, oh * ow):
        gw = _conv_dw_row_taps(x, dy, geom, g, oh, ow)
        need_dw = False
        if not col_dx:
            return gx, gw
    unit = sh == 1 and sw == 1
    if need_dw:
        xpad = _pad(x, ph, pw)
        gwg = np.zeros((g, og, k // g), dtype)
    if col_dx:
        wt = wg.transpose(0, 2, 1)
        if unit:
            gx = np.empty(x_shape, dtype)
            hpd, wpd = dh * (kh - 1) + oh, dw_ * (kw - 1) + ow   # = padded h, w
        else:
            gxpad = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype)

    def chunk(a, m):
        if need_dw or (col_dx and not unit):
            # dy of the chunk as (g, o/g, m*p), matching the columns' order:
            # runs of p floats (a view for one image), where the transposed
            # (g, m*p, o/g) copy that this replaced cost 0.87 ms an image in
            # CaffeNet's conv1 for products of the same speed (3.7 ms)
            dyo = dy[a:a + m].reshape(m, g, og, p).transpose(1, 2, 0, 3)
            if m > 1:
                buf = _work("dyo", o * m * p, dtype).reshape(g, og, m, p)
                np.copyto(buf, dyo)
                dyo = buf
            dyo = dyo.reshape(g, og, m * p)
        if col_dx and unit:
            # GEMM columns ordered (y, x, n) (dy copied in that order), then a
            # two-stage col2im: the kh row taps summed into v (c, kw, hp, ow,
            # m), runs of oh*ow*m floats, then the kw column taps into
            # (c, hp, wp, m), runs of ow*m; one transpose to NCHW at the end.
            # The GEMM is the minimal 2*k*o*p per image (the earlier "widened"
            # layout spent 1.5x that on LeNet's conv2) and no add is shorter
            # than ow*m floats.
            dyc = _work("dyc", o * m * p, dtype).reshape(g, oh, ow, m, og)
            np.copyto(dyc, dy[a:a + m].reshape(m, g, og, oh, ow).transpose(1, 3, 4, 0, 2))
            dcol = np.matmul(wt, dyc.reshape(g, m * p, og).transpose(0, 2, 1),
                             out=_work("dcol", k * m * p, dtype).reshape(g, k // g, m * p))
            dcol = dcol.reshape(c, kh, kw, oh, ow, m)
            v = _work("dcol_v", c * kw * hpd * ow * m, dtype).reshape(c, kw, hpd, ow, m)
            _tap_sum(v, [dcol[:, i] for i in range(kh)], 2, dh, oh)
            gt = _work("dcol_u", c * hpd * wpd * m, dtype).reshape(c, hpd, wpd, m)
            _tap_sum(gt, [v[:, j] for j in range(kw)], 2, dw_, ow)
            np.copyto(gx[a:a + m], gt[:, ph:ph + h, pw:pw + wd].transpose(3, 0, 1, 2))
        elif col_dx:
            dcol = np.matmul(wt, dyo, out=_work("dcol", k * m * p, dtype).reshape(g, k // g, m * p))
            col2im(dcol, geom, oh, ow, gxpad[a:a + m])
        if need_dw:
            col = im2col(xpad[a:a + m], geom, oh, ow, _work("col", k * m * p, dtype)).reshape(g, k // g, m * p)
            return np.matmul(dyo, col.transpose(0, 2, 1))
    # a long-and-small weight gradient alone takes chunks of _DW_CHUNK_BYTES
    limit = _DW_CHUNK_BYTES if need_dw and not col_dx and _long_and_small(k // g, p) else None
    _each_chunk(_chunks(n, k * p * dtype.itemsize, limit), chunk, gwg.__iadd__ if need_dw else None)
    if need_dw:
        gw = gwg.reshape(w.shape)
    if col_dx and not unit:
        gx = gxpad[:, :, ph:ph + h, pw:pw + wd] if (ph or pw) else gxpad
        gx = np.ascontiguousarray(gx)
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


def bias_grad(dy):
    """Sum of dy (N, C, ...) over every axis but the channels."""
    n, c = dy.shape[:2]
    r = dy.reshape(n, c, -1)
    return np.matmul(r, np.ones(r.shape[2], dy.dtype)).sum(0)


# --------------------------------------------------------------------- pooling
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
    best = _work("pool_best", total, dtype)
    best[span:] = 0
    best[:span] = flat[0][:span]
    tap = _work("pool_tap", total, np.int8)
    tap[...] = 0
    sel = None
    if payload is not None:
        pflat = [p.reshape(-1) for p in payload]
        sel = _work("pool_sel", total, payload[0].dtype)
        sel[span:] = 0
        sel[:span] = pflat[0][:span]
    gt = _work("pool_gt", span, bool)
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
    acc = _work("pool_sum", total, phases[0].dtype)
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


def _max_pool_forward(x, geom, oh, ow, y, idx):
    """MAX pooling of the images x into y and idx (:func:`max_pool_forward`),
    the NumPy fallback of the compiled kernels: one argmax for global
    pooling, else separable over stride phases."""
    kh, kw, sh, sw, ph, pw = geom[:6]
    n, c, h, w = x.shape
    if _is_global(geom, h, w, oh, ow):
        flat = x.reshape(n, c, h * w)
        i = flat.argmax(axis=2)
        np.copyto(y.reshape(n, c, 1), np.take_along_axis(flat, i[:, :, None], 2))
        np.copyto(idx.reshape(n, c), i)
        return
    # Separable: row maxima over the kw taps, then over kh rows; taking the
    # first strict maximum at each stage gives the window's raster-order first.
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


def _max_pool_backward(dy, idx, geom, dx):
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


def _over_images(fn, inputs, outs):
    """fn(*inputs[images], *outs[images]) over chunks of images (:func:`_chunks`,
    by the size of an image of inputs and outs together) on the intra-op
    threads, fn writing its results into the chunks of outs: for the pooling
    kernels, which treat every image alike.  Returns outs."""
    n = inputs[0].shape[0]

    def chunk(a, m):
        fn(*[t[a:a + m] for t in inputs + outs])
    _each_chunk(_chunks(n, sum(t[:1].nbytes for t in inputs + outs)), chunk)
    return outs


def max_pool_forward(x, geom, oh, ow):
    """Returns (y, idx): y the window maxima, idx the flat h*W+w index in the
    unpadded image of each window's first maximum in raster order (Caffe's)."""
    n, c = x.shape[:2]
    y, idx = np.empty((n, c, oh, ow), x.dtype), np.empty((n, c, oh, ow), np.int32)
    if pooling.available(x.dtype):
        return tuple(_over_images(lambda t, yt, it: pooling.max_forward(t, geom, yt, it),
                                  [np.ascontiguousarray(x)], [y, idx]))
    return tuple(_over_images(lambda t, yt, it: _max_pool_forward(t, geom, oh, ow, yt, it), [x], [y, idx]))


def max_pool_backward(dy, idx, geom, x_shape):
    dx = np.empty(x_shape, dy.dtype)
    if pooling.available(dy.dtype):
        inputs = [np.ascontiguousarray(dy), np.ascontiguousarray(idx, np.int32)]
        return _over_images(pooling.max_backward, inputs, [dx])[0]
    return _over_images(lambda d, i, dxt: _max_pool_backward(d, i, geom, dxt), [dy, idx], [dx])[0]


def ave_pool_forward(x, geom, oh, ow):
    y = np.empty(x.shape[:2] + (oh, ow), x.dtype)
    return _over_images(lambda t, yt: _ave_pool_forward(t, geom, oh, ow, yt), [x], [y])[0]


def ave_pool_backward(dy, geom, x_shape):
    dx = np.empty(x_shape, dy.dtype)
    return _over_images(lambda d, dxt: _ave_pool_backward(d, geom, dxt), [dy], [dx])[0]


def _is_global(geom, h, w, oh, ow):
    kh, kw, sh, sw, ph, pw = geom[:6]
    return oh == 1 and ow == 1 and kh >= h and kw >= w and ph == 0 and pw == 0


def _ave_scale(geom, h, w, oh, ow, dtype):
    kh, kw, sh, sw, ph, pw = geom[:6]
    div = np.outer(_ave_divisor(h, kh, sh, ph, oh), _ave_divisor(w, kw, sw, pw, ow))
    return (1.0 / div).astype(dtype)


# AVE pooling with at most this many outputs per plane is one GEMM against
# the (h*w, oh*ow) averaging matrix (see _ave_matrix).
_AVE_GEMM_MAX_OUT = 64


@functools.lru_cache(maxsize=64)
def _ave_matrix(geom, h, w, oh, ow, dtype):
    """The averaging as a matrix: column (oy, ox) holds 1/divisor at the
    pixels of its (clipped) window.  The GEMM does 2*h*w FLOPs per output,
    which for small outputs beats the separable strided sums by far
    (CIFAR10-quick's 3x3/2 AVE pools, 16x16 -> 8x8 and 8x8 -> 4x4, at batch
    100: forward 2.8 -> 1.5 and 2.3 -> 0.2 ms, backward 4.0 -> 1.2 and
    3.9 -> 0.2 ms; at 28x28 -> 14x14 it is 2.5x slower).  Read-only."""
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
    # (strided adds measured faster here than the phase trick of the forward)
    rows = np.zeros((n, c, hp, ow), dy.dtype)
    for sl in _window_slices(kh, sh, oh):
        rows[:, :, sl] += g
    dxpad = np.zeros((n, c, hp, wp), dy.dtype)
    for sl in _window_slices(kw, sw, ow):
        dxpad[:, :, :, sl] += rows
    np.copyto(dx, dxpad[:, :, ph:ph + h, pw:pw + w])


def channel_window_sum(a, size, pre):
    """s[:, c] = sum of a[:, c-pre .. c-pre+size-1] (zeros outside)."""
    n, c = a.shape[:2]
    padded = np.zeros((n, c + size - 1) + a.shape[2:], a.dtype)
    padded[:, pre:pre + c] = a
    s = padded[:, 0:c].copy()
    for t in range(1, size):
        s += padded[:, t:t + c]
    return s


def spatial_window_sum(a, size, pre):
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


# --------------------------------------------------------------------- dropout
def dropout_scale(ratio, dtype):
    """1/(1-ratio) rounded as the mask's dtype divides it."""
    return (np.ones(1, dtype) / (1.0 - ratio))[0]


def dropout_mask(shape, ratio, dtype):
    keep = rng().random_sample(shape) > ratio
    return keep.astype(dtype) / (1.0 - ratio)
