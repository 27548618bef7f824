"""CuPy kernels for convolution, pooling and LRN.

Same contracts as :mod:`caffempi.backend.cpu` (NCHW arrays, ``geom`` =
``(kh, kw, sh, sw, ph, pw, dh, dw)``).  Convolution is Caffe's GPU scheme:
im2col into a (C*kh*kw, images*oh*ow) column matrix, one cuBLAS GEMM per
group over a chunk of images, col2im by gathering (each input pixel sums the
column entries that read it, so no atomics and a deterministic order).
Pooling and the window sums are one thread per output element.  CuPy v14
dropped its cuDNN bindings; :mod:`caffempi.backend.cudnn` (ctypes) replaces
the convolution with cuDNN's where the layer's engine asks for it
(:func:`caffempi.config.use_cudnn`) and the library loads.

Everything stays on the device: no host round trip in any kernel here.
"""
import cupy as cp
import numpy as np
import cupyx

from ..common import rng
from . import cudnn
from .cpu import conv_out_size, dropout_scale, images_per_chunk, is_pointwise

# A chunk's column matrix is kept under this size: the whole batch's can be
# gigabytes (AlexNet conv1 at batch 256: 1.1 GB) for no gain in GEMM speed.
_COL_CHUNK_BYTES = 256 << 20

_GEOM_ARGS = "int32 kh, int32 kw, int32 sh, int32 sw, int32 ph, int32 pw, int32 dh, int32 dw"

# col[(ch*kh + i)*kw + j, (n*oh + y)*ow + x] = x[n, ch, y*sh - ph + i*dh, x*sw - pw + j*dw]
_im2col = cp.ElementwiseKernel(
    "raw T src, int32 c, int32 h, int32 w, int32 oh, int32 ow, int32 m, " + _GEOM_ARGS,
    "T col",
    """
    const long long mp = (long long)m * oh * ow;
    const long long row = i / mp;
    const long long rest = i - row * mp;
    const int p = oh * ow;
    const int n = rest / p, yx = rest - (long long)n * p;
    const int y = yx / ow, xo = yx - y * ow;
    const int j = row % kw, t = row / kw, ki = t % kh, ch = t / kh;
    const int hi = y * sh - ph + ki * dh, wi = xo * sw - pw + j * dw;
    col = (hi >= 0 && hi < h && wi >= 0 && wi < w)
        ? src[((long long)(n * c + ch) * h + hi) * w + wi] : (T)0;
    """, "caffempi_im2col")

# The transpose of im2col: dx[n, ch, hi, wi] = sum of the col entries read from it.
_col2im = cp.ElementwiseKernel(
    "raw T col, int32 c, int32 h, int32 w, int32 oh, int32 ow, int32 m, " + _GEOM_ARGS,
    "T dx",
    """
    const int wi = i % w;
    long long t = i / w;
    const int hi = t % h; t /= h;
    const int ch = t % c, n = t / c;
    const long long mp = (long long)m * oh * ow;
    T s = 0;
    for (int ki = 0; ki < kh; ++ki) {
        const int hy = hi + ph - ki * dh;
        if (hy < 0 || hy % sh) continue;
        const int y = hy / sh;
        if (y >= oh) continue;
        for (int j = 0; j < kw; ++j) {
            const int wx = wi + pw - j * dw;
            if (wx < 0 || wx % sw) continue;
            const int xo = wx / sw;
            if (xo >= ow) continue;
            s += col[((long long)(ch * kh + ki) * kw + j) * mp + ((long long)n * oh + y) * ow + xo];
        }
    }
    dx = s;
    """, "caffempi_col2im")


def im2col(x, geom, oh, ow):
    """(C*kh*kw, N*oh*ow) column matrix of the unpadded batch ``x``."""
    n, c, h, w = x.shape
    kh, kw = geom[:2]
    col = cp.empty((c * kh * kw, n * oh * ow), x.dtype)
    _im2col(cp.ascontiguousarray(x), c, h, w, oh, ow, n, *geom, col)
    return col


def col2im(col, x_shape, geom, oh, ow, out=None):
    n, c, h, w = x_shape
    if out is None:
        out = cp.empty(x_shape, col.dtype)
    _col2im(col, c, h, w, oh, ow, n, *geom, out)
    return out


def im2col_conv2d_forward(x, w, geom, group, bias=None):
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x.shape
    o = w.shape[0]
    oh, ow = conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw)
    g = group
    wg = w.reshape(g, o // g, -1)
    if is_pointwise(geom):
        y = cp.matmul(wg, x.reshape(n, g, c // g, h * wd)).reshape(n, o, oh, ow)
        if bias is not None:
            y += bias.reshape(o, 1, 1)
        return y
    y = cp.empty((n, o, oh, ow), x.dtype)
    p, k = oh * ow, c * kh * kw
    nb = images_per_chunk(n, k * p * x.itemsize, _COL_CHUNK_BYTES)
    for a in range(0, n, nb):
        m = min(nb, n - a)
        col = im2col(x[a:a + m], geom, oh, ow)
        r = cp.matmul(wg, col.reshape(g, k // g, m * p)).reshape(o, m, p).transpose(1, 0, 2)
        out = y[a:a + m].reshape(m, o, p)
        if bias is None:
            out[...] = r
        else:
            cp.add(r, bias.reshape(o, 1), out=out)
    return y


def im2col_conv2d_backward(x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None):
    """Returns (dx, dw), None where not asked for; ``x`` may be None when
    only dx is needed (``x_shape`` then gives the input shape)."""
    kh, kw = geom[:2]
    if x_shape is None:
        x_shape = x.shape
    n, c, h, wd = x_shape
    o = w.shape[0]
    _, _, oh, ow = dy.shape
    g = group
    og = o // g
    wg = w.reshape(g, og, -1)
    p, k = oh * ow, c * kh * kw
    gx = cp.empty(x_shape, dy.dtype) if need_dx else None
    if need_dx and is_pointwise(geom):
        gx[...] = cp.matmul(wg.transpose(0, 2, 1), dy.reshape(n, g, og, p)).reshape(x_shape)
        need_dx = False
    gw = cp.zeros((g, og, k // g), dy.dtype) if need_dw else None
    if not need_dw and not need_dx:
        return gx, gw
    nb = images_per_chunk(n, k * p * dy.itemsize, _COL_CHUNK_BYTES)
    for a in range(0, n, nb):
        m = min(nb, n - a)
        # dy of the chunk with images inside the columns, as the col matrix
        dyt = cp.ascontiguousarray(dy[a:a + m].reshape(m, o, p).transpose(1, 0, 2)).reshape(g, og, m * p)
        if need_dw:
            col = im2col(x[a:a + m], geom, oh, ow).reshape(g, k // g, m * p)
            gw += cp.matmul(dyt, col.transpose(0, 2, 1))
        if need_dx:
            dcol = cp.matmul(wg.transpose(0, 2, 1), dyt).reshape(k, m * p)
            col2im(dcol, (m, c, h, wd), geom, oh, ow, gx[a:a + m])
    if gw is not None:
        gw = gw.reshape(w.shape)
    return gx, gw


def conv2d_forward(x, w, geom, group, bias=None, *, use_cudnn=False):
    """cuDNN's convolution when ``use_cudnn`` (the layer's engine) and the
    library loads, since it runs them faster than im2col + GEMM; else ours."""
    if use_cudnn and cudnn.available():
        return cudnn.conv2d_forward(x, w, geom, group, bias)
    return im2col_conv2d_forward(x, w, geom, group, bias)


def conv2d_backward(x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None, *, use_cudnn=False):
    """The gradients with cuDNN or ours, chosen as :func:`conv2d_forward`."""
    if use_cudnn and cudnn.available():
        return cudnn.conv2d_backward(x, w, dy, geom, group, need_dx, need_dw, x_shape)
    return im2col_conv2d_backward(x, w, dy, geom, group, need_dx, need_dw, x_shape)


def bias_grad(dy):
    n, c = dy.shape[:2]
    return dy.reshape(n, c, -1).sum(axis=(0, 2))


# --------------------------------------------------------------------- pooling
_POOL_ARGS = "int32 h, int32 w, int32 oh, int32 ow, int32 kh, int32 kw, int32 sh, int32 sw, int32 ph, int32 pw"

# An output's window clipped to the image: rows [hs, he), columns [ws, we)
# of the plane at src.
_WINDOW = """
    const int xo = i % ow, yo = (i / ow) % oh;
    const long long plane = i / ((long long)oh * ow);
    const int hs = max(yo * sh - ph, 0), he = min(yo * sh - ph + kh, h);
    const int ws = max(xo * sw - pw, 0), we = min(xo * sw - pw + kw, w);
    const T* src = &x[plane * h * w];
"""

# An input pixel's covering windows: outputs [pys, pye) x [pxs, pxe) of the
# output plane at base (the gather form of the backward).
_COVERING = """
    const int wi = i % w, hi = (i / w) % h;
    const long long plane = i / ((long long)h * w);
    const int pys = (hi + ph < kh) ? 0 : (hi + ph - kh) / sh + 1, pye = min((hi + ph) / sh + 1, oh);
    const int pxs = (wi + pw < kw) ? 0 : (wi + pw - kw) / sw + 1, pxe = min((wi + pw) / sw + 1, ow);
    const long long base = plane * oh * ow;
"""

# Caffe's MaxPoolForward: the window clipped to the image, the first maximum
# in raster order; idx is its h*W + w in the unpadded plane.
_max_pool_fwd = cp.ElementwiseKernel(
    "raw T x, " + _POOL_ARGS, "T y, int32 idx",
    _WINDOW + """
    T best = (T)__int_as_float(0xff800000);    // -inf
    int arg = hs * w + ws;
    for (int r = hs; r < he; ++r)
        for (int q = ws; q < we; ++q)
            if (src[r * w + q] > best) { best = src[r * w + q]; arg = r * w + q; }
    y = best;
    idx = arg;
    """, "caffempi_max_pool_fwd")

# Gather form of the backward: each input pixel sums the output gradients of
# the windows that cover it and chose it.
_max_pool_bwd = cp.ElementwiseKernel(
    "raw T dy, raw int32 idx, " + _POOL_ARGS, "T dx",
    _COVERING + """
    const int me = hi * w + wi;
    T s = 0;
    for (int py = pys; py < pye; ++py)
        for (int px = pxs; px < pxe; ++px)
            if (idx[base + py * ow + px] == me) s += dy[base + py * ow + px];
    dx = s;
    """, "caffempi_max_pool_bwd")

# Caffe's AVE divisor: the window clipped to the padded image (padding
# counts, overhang past it does not), the sum over the unpadded part.
_AVE_DIVISOR = """
    __device__ int ave_divisor(int yo, int xo, int h, int w, int kh, int kw, int sh, int sw, int ph, int pw) {
        const int hs = yo * sh - ph, ws = xo * sw - pw;
        return (min(hs + kh, h + ph) - hs) * (min(ws + kw, w + pw) - ws);
    }
"""

_ave_pool_fwd = cp.ElementwiseKernel(
    "raw T x, " + _POOL_ARGS, "T y",
    _WINDOW + """
    T s = 0;
    for (int r = hs; r < he; ++r)
        for (int q = ws; q < we; ++q)
            s += src[r * w + q];
    y = s / (T)ave_divisor(yo, xo, h, w, kh, kw, sh, sw, ph, pw);
    """, "caffempi_ave_pool_fwd", preamble=_AVE_DIVISOR)

_ave_pool_bwd = cp.ElementwiseKernel(
    "raw T dy, " + _POOL_ARGS, "T dx",
    _COVERING + """
    T s = 0;
    for (int py = pys; py < pye; ++py)
        for (int px = pxs; px < pxe; ++px)
            s += dy[base + py * ow + px] / (T)ave_divisor(py, px, h, w, kh, kw, sh, sw, ph, pw);
    dx = s;
    """, "caffempi_ave_pool_bwd", preamble=_AVE_DIVISOR)


def max_pool_forward(x, geom, oh, ow):
    n, c, h, w = x.shape
    y = cp.empty((n, c, oh, ow), x.dtype)
    idx = cp.empty((n, c, oh, ow), cp.int32)
    _max_pool_fwd(cp.ascontiguousarray(x), h, w, oh, ow, *geom[:6], y, idx)
    return y, idx


def max_pool_backward(dy, idx, geom, x_shape):
    n, c, h, w = x_shape
    oh, ow = dy.shape[2:]
    dx = cp.empty(x_shape, dy.dtype)
    _max_pool_bwd(cp.ascontiguousarray(dy), idx, h, w, oh, ow, *geom[:6], dx)
    return dx


def ave_pool_forward(x, geom, oh, ow):
    n, c, h, w = x.shape
    y = cp.empty((n, c, oh, ow), x.dtype)
    _ave_pool_fwd(cp.ascontiguousarray(x), h, w, oh, ow, *geom[:6], y)
    return y


def ave_pool_backward(dy, geom, x_shape):
    n, c, h, w = x_shape
    oh, ow = dy.shape[2:]
    dx = cp.empty(x_shape, dy.dtype)
    _ave_pool_bwd(cp.ascontiguousarray(dy), h, w, oh, ow, *geom[:6], dx)
    return dx


# ------------------------------------------------------------------ LRN sums
_channel_sum = cp.ElementwiseKernel(
    "raw T a, int32 c, int32 hw, int32 size, int32 pre", "T s",
    """
    const long long pix = i % hw;
    const int ch = (i / hw) % c;
    const long long img = i / ((long long)hw * c);
    const int lo = max(ch - pre, 0), hi = min(ch - pre + size, c);
    T acc = 0;
    for (int q = lo; q < hi; ++q) acc += a[(img * c + q) * hw + pix];
    s = acc;
    """, "caffempi_channel_sum")

_spatial_sum = cp.ElementwiseKernel(
    "raw T a, int32 h, int32 w, int32 size, int32 pre", "T s",
    """
    const int wi = i % w, hi = (i / w) % h;
    const long long plane = i / ((long long)h * w);
    const int r0 = max(hi - pre, 0), r1 = min(hi - pre + size, h);
    const int q0 = max(wi - pre, 0), q1 = min(wi - pre + size, w);
    T acc = 0;
    for (int r = r0; r < r1; ++r)
        for (int q = q0; q < q1; ++q) acc += a[(plane * h + r) * w + q];
    s = acc;
    """, "caffempi_spatial_sum")


# Caffe's LRN across channels, each direction one kernel (as separate passes
# it was the squares, the window sums, four passes of the power and the
# products: 12 ms of AlexNet's 55 ms step, docs/performance/gpu.md); the
# same steps as kernels.lrn_forward / lrn_backward, in the same order.
_NEGATIVE_POWER = """
template <typename T> __device__ T caffempi_negative_power(T s, T beta) {
    if (beta == (T)0.75) {          // 1 / sqrt(s * sqrt(s)), as kernels._negative_power
        T r = sqrt(s);
        r *= s;
        return (T)1 / sqrt(r);
    }
    return pow(s, -beta);
}
"""

_WINDOW_INDEX = """
    const long long pix = i % hw;
    const int ch = (i / hw) % c;
    const long long img = i / ((long long)hw * c);
    const int lo = max(ch - pre, 0), hi = min(ch - pre + size, c);
"""

_lrn_across_fwd = cp.ElementwiseKernel(
    "raw T x, int32 c, int32 hw, int32 size, int32 pre, T alpha_over_size, T k, T beta", "T y, T scale",
    _WINDOW_INDEX + """
    T acc = 0;
    for (int q = lo; q < hi; ++q) {
        const T v = x[(img * c + q) * hw + pix];
        acc += v * v;
    }
    acc *= alpha_over_size;
    acc += k;
    scale = acc;
    y = caffempi_negative_power(acc, beta) * x[i];
    """, "caffempi_lrn_across_fwd", preamble=_NEGATIVE_POWER)

_lrn_across_bwd = cp.ElementwiseKernel(
    "raw T x, raw T y, raw T scale, raw T dy, int32 c, int32 hw, int32 size, int32 pre, T neg_coef, T beta",
    "T dx",
    _WINDOW_INDEX + """
    T acc = 0;
    for (int q = lo; q < hi; ++q) {
        const long long e = (img * c + q) * hw + pix;
        T t = dy[e] * y[e];
        t /= scale[e];
        acc += t;
    }
    acc *= x[i];
    acc *= neg_coef;
    dx = acc + dy[i] * caffempi_negative_power(scale[i], beta);
    """, "caffempi_lrn_across_bwd", preamble=_NEGATIVE_POWER)


def lrn_across_forward(x, size, alpha, beta, k):
    """(y, scale) of :func:`caffempi.backend.kernels.lrn_forward` across
    channels, in one kernel."""
    x = cp.ascontiguousarray(x)
    t = x.dtype.type
    y, scale = cp.empty_like(x), cp.empty_like(x)
    _lrn_across_fwd(x, x.shape[1], x[0, 0].size, size, (size - 1) // 2, t(alpha / size), t(k), t(beta), y, scale)
    return y, scale


def lrn_across_backward(x, y, scale, dy, size, alpha, beta):
    """dx of :func:`caffempi.backend.kernels.lrn_backward` across channels,
    in one kernel."""
    x, y, scale, dy = (cp.ascontiguousarray(a) for a in (x, y, scale, dy))
    t = x.dtype.type
    dx = cp.empty_like(x)
    _lrn_across_bwd(x, y, scale, dy, x.shape[1], x[0, 0].size, size, size - 1 - (size - 1) // 2,
                    t(-2.0 * alpha * beta / size), t(beta), dx)
    return dx


def channel_window_sum(a, size, pre):
    n, c = a.shape[:2]
    s = cp.empty_like(a)
    _channel_sum(cp.ascontiguousarray(a), c, a[0, 0].size, size, pre, s)
    return s


def spatial_window_sum(a, size, pre):
    h, w = a.shape[2:]
    s = cp.empty_like(a)
    _spatial_sum(cp.ascontiguousarray(a), h, w, size, pre, s)
    return s


# ------------------------------------------------------- fused elementwise
# One launch for what a layer's few CuPy calls compute (kernels.elementwise's
# ``fused``), the same roundings: ReLU's gradient dy * (y > 0) (NaN and the
# sign of zero as the product gives them), a sum of two arrays, its max with
# 0 as NumPy's maximum takes it (NaN kept, -0 kept).
_FUSED_BODIES = {
    "relu_gradient": ("T dy, T y", "dy * (T)(y > (T)0)"),
    "sum": ("T a, T b", "a + b"),
    "sum_relu": ("T a, T b", "a + b < (T)0 ? (T)0 : a + b"),
}
_fused = {}


def fused_kernel(name, inputs, outputs):
    """The kernel named in _FUSED_BODIES taking ``inputs`` arrays and
    writing its value to each of ``outputs`` arrays, or None."""
    params, value = _FUSED_BODIES.get(name, (None, None))
    if params is None or params.count(",") + 1 != inputs:
        return None
    key = (name, outputs)
    if key not in _fused:
        outs = ["out%d" % k for k in range(outputs)]
        body = "const T v = %s; %s" % (value, " ".join("%s = v;" % o for o in outs))
        _fused[key] = cp.ElementwiseKernel(params, ", ".join("T " + o for o in outs), body,
                                           "caffempi_%s_%d" % (name, outputs))
    return _fused[key]


# -------------------------------------------------------------------- dropout
# A counter-based draw (splitmix64 of seed + index): no generator state on
# the device, one host draw per mask, where drawing on the host and
# uploading was a large part of a fc layer's time (docs/design/gpu.md).
_dropout = cp.ElementwiseKernel(
    "uint64 seed, float64 ratio, T scale", "T mask",
    """
    unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    mask = (z >> 11) * (1.0 / 9007199254740992.0) > ratio ? scale : (T)0;
    """, "caffempi_dropout_mask")


def dropout_mask(shape, ratio, dtype):
    seed = int(rng().randint(0, 2 ** 62, dtype=np.int64))
    mask = cp.empty(shape, dtype)
    _dropout(np.uint64(seed), float(ratio), dropout_scale(ratio, dtype), mask)
    return mask


# ------------------------------------------------------------- batch upload
def empty_pinned(shape, dtype):
    """A host array in page-locked memory (CuPy's pinned pool reuses the
    blocks), which the copy engine reads without a staging copy."""
    return cupyx.empty_pinned(shape, dtype)


def copies_to_host(arrays):
    """(host arrays, event): each array's copy into pinned memory queued
    on the current stream without waiting, then an event recorded after
    them (backend/reads.py)."""
    stream = cp.cuda.get_current_stream()
    hosts = []
    for a in arrays:
        src = cp.ascontiguousarray(a)           # at least 1-d: a 0-d loss comes back 0-d below
        host = empty_pinned(src.shape, src.dtype)
        cp.asnumpy(src, stream=stream, out=host, blocking=False)
        hosts.append(host.reshape(a.shape))
    # captured (a CUDA graph): no event; the replay's caller waits for it.
    # The legacy default stream (ptr 0) is never captured: not queried.
    return hosts, None if stream.ptr and stream.is_capturing() else stream.record()


class GraphStream:
    """Captures device work as CUDA graphs and replays them on a stream of
    its own, ordered with the caller's current stream: what the caller
    issued before a capture or replay runs first, and what it issues after
    waits for it.  What a capture allocates comes from a memory pool of its
    own that nothing else uses, so every replay finds its arrays where the
    capture left them (solvers/captured.py)."""

    def __init__(self):
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()

    def capture(self, fn):
        """(graph, fn's result), fn's device work captured, not run."""
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream, cp.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                result = fn()
            except BaseException:
                try:
                    self.stream.end_capture()
                except Exception:       # the capture was invalidated: the error above says why
                    pass
                raise
            graph = self.stream.end_capture()
        return graph, result

    def launch(self, graph):
        """Replays ``graph``; returns an event recorded after it."""
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        graph.launch(stream=self.stream)
        done = self.stream.record()
        caller.wait_event(done)
        return done


class BatchUploader:
    """Host batches to the device one batch ahead, on a side stream.

    ``next()`` hands out the batch uploaded during the previous iteration
    (the compute stream waits for its copy event) and starts the upload of
    the following one, which then overlaps this iteration's compute.  The
    side stream first waits for everything queued on the compute stream, so
    a device block freed by an earlier batch is not overwritten while in use.
    """

    def __init__(self, fetch):
        self.fetch = fetch            # () -> tuple of host arrays
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ahead = None

    def _start(self):
        host = self.fetch()
        queued = cp.cuda.Event(disable_timing=True)
        queued.record()
        self.stream.wait_event(queued)
        dev = []
        for h in host:
            d = cp.empty(h.shape, h.dtype)
            d.set(h, stream=self.stream)
            dev.append(d)
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(self.stream)
        self._ahead = (dev, ready, host)

    def next(self):
        if self._ahead is None:
            self._start()
        dev, ready, host = self._ahead
        cp.cuda.get_current_stream().wait_event(ready)
        # the host arrays may go back to the pinned pool only once copied
        # (issued an iteration ago, so this rarely waits)
        ready.synchronize()
        del host
        self._start()
        return tuple(dev)
