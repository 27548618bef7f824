"""BatchNorm's and Scale's per-channel passes on the GPU as CUDA kernels,
with the contract of :mod:`caffempi.backend.channels` (which calls these
for CuPy arrays): for (planes, C, S) arrays, C-contiguous, float32 or
float64.

Why: as CuPy calls a BatchNorm, Scale and ReLU in ResNet-50 cost about
twenty launches each way, sums over axes (0, 2) that CuPy's reductions
spread badly, and a pass over memory per step; here each direction is at
most three launches:

1. ``sums``: two per-channel sums (x and x*x forward; g and g*y backward)
   over chunks of the channel's planes*S values, one block per (channel,
   chunk), each thread's sums in double, then a tree in shared memory;
2. ``finish``: one thread per channel adds its chunks' sums in order (the
   same bits every run) and writes the statistics (mean, var = E[x^2] -
   mean^2 in double, std) or the gradients' sums and dx's coefficients;
3. ``apply``: one pass over rows of S values (a row is one plane's
   channel), the channel's operands read once per block.

Compiled with ``--fmad=false``: ``v * scale + bias`` rounds as CuPy's
ufuncs do, so only the sums (double here, float32 in CuPy's reductions)
separate these numbers from the layers' CuPy path
(``CAFFEMPI_COMPILED_CHANNELS=0``).
"""
import functools

import cupy as cp
import numpy as np

from .channel_steps import BATCH_STATS, GIVEN_STATS, NO_STATS

_THREADS = 256          # threads of a sums block (a power of two: the tree)
_BLOCKS_PER_SM = 4      # sums blocks aimed at per multiprocessor
_MIN_PER_THREAD = 16    # values a sums thread reads at least before chunks split further

_SOURCE = r"""
typedef %(type)s T;
#define THREADS %(threads)d
#define FORWARD %(forward)d
#define STATS %(stats)d
#define AFFINE %(affine)d
#define BIAS %(bias)d
#define RELU %(relu)d
#define STORE %(store)d      // forward: out stored; backward: dx written
#define STORE_RUNNING %(running)d
#define BATCH_STATS %(batch)d
#define GIVEN_STATS %(given)d
#define NO_STATS %(none)d

// The value the sums and apply read at e: forward x; backward dy through
// the max (zero where the forward's output is not positive).
__device__ __forceinline__ T gradient_at(const T* a, const T* mask, long long e) {
#if RELU && !FORWARD
    return mask[e] > (T)0 ? a[e] : (T)0;
#else
    return a[e];
#endif
}

extern "C" __global__ void sums(const T* __restrict__ a, const T* __restrict__ b,
                                const T* __restrict__ mask, double* __restrict__ part,
                                long long planes, int channels, long long size, long long per_chunk) {
    __shared__ double s0[THREADS], s1[THREADS];
    const int c = blockIdx.x;
    const long long n = planes * size;
    const long long end = (long long)(blockIdx.y + 1) * per_chunk;
    const long long j1 = end < n ? end : n;
    long long j = (long long)blockIdx.y * per_chunk + threadIdx.x;
    long long p = j / size, s = j - p * size;
    const long long dp = THREADS / size, ds = THREADS - dp * size;
    double acc0 = 0, acc1 = 0;
    for (; j < j1; j += THREADS) {
        const long long e = (p * channels + c) * size + s;
        const double v = (double)gradient_at(a, mask, e);
        acc0 += v;
#if FORWARD
        acc1 += v * v;
#else
        acc1 += v * (double)b[e];
#endif
        s += ds;
        p += dp;
        if (s >= size) { s -= size; ++p; }
    }
    s0[threadIdx.x] = acc0;
    s1[threadIdx.x] = acc1;
    __syncthreads();
    for (int k = THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) {
            s0[threadIdx.x] += s0[threadIdx.x + k];
            s1[threadIdx.x] += s1[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double* out = part + 2 * ((long long)c * gridDim.y + blockIdx.y);
        out[0] = s0[0];
        out[1] = s1[0];
    }
}

// forward: mean, var, std (and the running sums, Caffe's moving averages); backward: dbias = sum(g), dscale = sum(g y), and
// with batch statistics coef = (mean(g' y), mean(g')) for g' = g * scale
extern "C" __global__ void finish(const double* __restrict__ part, int chunks, int channels, double count,
                                  T eps, const T* __restrict__ scale, T* __restrict__ first,
                                  T* __restrict__ second, T* __restrict__ third,
                                  T* __restrict__ run_mean, T* __restrict__ run_var, T maf, T correction) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    double t0 = 0, t1 = 0;
    for (int k = 0; k < chunks; ++k) {
        t0 += part[2 * ((long long)c * chunks + k)];
        t1 += part[2 * ((long long)c * chunks + k) + 1];
    }
#if FORWARD
    const double mean = t0 / count;
    const double d = t1 / count - mean * mean;
    const double var = d > 0.0 ? d : 0.0;
    first[c] = (T)mean;
    second[c] = (T)var;
    third[c] = sqrt((T)var + eps);
#if STORE_RUNNING
    run_mean[c] = run_mean[c] * maf + (T)mean;
    run_var[c] = run_var[c] * maf + correction * (T)var;
#endif
#else
#if AFFINE
    second[c] = (T)t1;
#if BIAS
    first[c] = (T)t0;
#endif
#endif
#if STATS == BATCH_STATS && STORE
#if AFFINE
    const double sc = (double)scale[c];
#else
    const double sc = 1.0;
#endif
    third[2 * c] = (T)(sc * t1 / count);
    third[2 * c + 1] = (T)(sc * t0 / count);
#endif
#endif
}

// forward: y = (x - mean) / std; o = y * scale (+ bias), max(o, 0); y and o stored
// backward: g = gradient_at(dy) (* scale); dx from g as the statistics say
extern "C" __global__ void apply(const T* __restrict__ a, const T* __restrict__ mask,
                                 const T* __restrict__ y, T* __restrict__ out, T* __restrict__ stored,
                                 const T* __restrict__ mean, const T* __restrict__ std,
                                 const T* __restrict__ scale, const T* __restrict__ bias,
                                 const T* __restrict__ coef, int channels, long long size) {
    const long long row = blockIdx.x;
    const int c = (int)(row %% channels);
#if AFFINE
    const T sc = scale[c];
#endif
#if FORWARD
    const T mu = mean[c], sd = std[c];
#if BIAS
    const T bi = bias[c];
#endif
#else
#if STATS != NO_STATS
    const T sd = std[c];
#endif
#if STATS == BATCH_STATS
    const T k1 = coef[2 * c], k0 = coef[2 * c + 1];
#endif
#endif
    for (long long s = (long long)blockIdx.y * blockDim.x + threadIdx.x; s < size;
         s += (long long)gridDim.y * blockDim.x) {
        const long long e = row * size + s;
#if FORWARD
        const T v = (a[e] - mu) / sd;
        out[e] = v;
        T o = v;
#if AFFINE
        o = o * sc;
#endif
#if BIAS
        o = o + bi;
#endif
#if RELU
        o = o < (T)0 ? (T)0 : o;
#endif
#if STORE
        stored[e] = o;
#endif
#else
        T g = gradient_at(a, mask, e);
#if AFFINE
        g = g * sc;
#endif
#if STATS == BATCH_STATS
        g = ((y[e] * -k1 + g) - k0) / sd;
#elif STATS == GIVEN_STATS
        g = g / sd;
#endif
        out[e] = g;
#endif
    }
}
"""


@functools.lru_cache(maxsize=None)
def _kernels(dtype, forward, stats, affine, bias, relu, store, running=False):
    """The kernels (sums, finish, apply) of one variant, compiled by NVRTC
    on first use (then from CuPy's cache on disk)."""
    code = _SOURCE % dict(type="float" if dtype == np.float32 else "double", threads=_THREADS,
                          forward=int(forward), stats=stats, affine=int(affine), bias=int(bias),
                          relu=int(relu), store=int(store), running=int(running), batch=BATCH_STATS, given=GIVEN_STATS, none=NO_STATS)
    module = cp.RawModule(code=code, options=("--fmad=false",))
    return tuple(module.get_function(name) for name in ("sums", "finish", "apply"))


def available(*arrays):
    """Whether these kernels take the arrays: CuPy, C-contiguous, all
    float32 or all float64."""
    dtypes = {a.dtype for a in arrays}
    return (len(dtypes) == 1 and dtypes.pop() in (np.float32, np.float64)
            and all(isinstance(a, cp.ndarray) and a.flags.c_contiguous for a in arrays))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id):
    return cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _sums(kernels, a, b, mask, planes, channels, size):
    """The per-channel chunk sums of a's (and b's) values: (partials, chunks)."""
    n = planes * size
    target = _BLOCKS_PER_SM * _multiprocessors(cp.cuda.Device().id)
    chunks = max(1, min(-(-target // channels), -(-n // (_THREADS * _MIN_PER_THREAD)), 65535))
    per_chunk = max(1, -(-n // chunks))
    chunks = max(1, -(-n // per_chunk))
    part = cp.empty((channels, chunks, 2), np.float64)
    kernels[0]((channels, chunks), (_THREADS,),
               (a, b, mask, part, np.int64(planes), np.int32(channels), np.int64(size), np.int64(per_chunk)))
    return part, chunks


def _finish(kernels, part, chunks, channels, count, eps, scale, first, second, third, dtype, running=None):
    sums, squares, maf, correction = running or (first, first, 0.0, 0.0)
    threads = min(256, channels)
    kernels[1]((-(-channels // threads),), (threads,),
               (part, np.int32(chunks), np.int32(channels), np.float64(count), dtype.type(eps), scale,
                first, second, third, sums, squares, dtype.type(maf), dtype.type(correction)))


def _apply(kernels, planes, channels, size, args):
    threads = min(256, -(-size // 32) * 32)
    kernels[2]((planes * channels, min(65535, -(-size // threads))), (threads,),
               args + (np.int32(channels), np.int64(size)))


def forward(x, y, out, stats, mean, var, std, scale=None, bias=None, relu=False, eps=0.0, block=slice(None),
            running=None):
    """:func:`caffempi.backend.channels.forward` for CuPy arrays, over all
    channels (``block`` is the whole axis on the GPU); the running sums
    updated in the kernel that finishes the statistics."""
    planes, channels, size = x.shape
    dtype = x.dtype
    kernels = _kernels(dtype.type, True, stats, scale is not None, bias is not None, bool(relu), out is not None,
                       running is not None)
    if stats == BATCH_STATS:
        part, chunks = _sums(kernels, x, x, x, planes, channels, size)
        _finish(kernels, part, chunks, channels, planes * size, eps, mean, mean, var, std, dtype, running)
    # unused pointers are x: the variant's code never reads or writes them
    _apply(kernels, planes, channels, size,
           (x, x, x, y, x if out is None else out, mean, std,
            x if scale is None else scale, x if bias is None else bias, x))


def backward(dy, y, dx, stats, std=None, scale=None, dscale=None, dbias=None, out=None, block=slice(None)):
    """:func:`caffempi.backend.channels.backward` for CuPy arrays, over all
    channels."""
    planes, channels, size = dy.shape
    dtype = dy.dtype
    affine = scale is not None
    kernels = _kernels(dtype.type, False, stats, affine, dbias is not None, out is not None, dx is not None)
    mask = dy if out is None else out
    coef = cp.empty((channels, 2), dtype) if stats == BATCH_STATS and dx is not None else dy
    if affine or coef is not dy:
        part, chunks = _sums(kernels, dy, y, mask, planes, channels, size)
        _finish(kernels, part, chunks, channels, planes * size, 0.0, scale if affine else dy,
                dy if dbias is None else dbias, dscale if affine else dy, coef, dtype)
    if dx is not None:
        _apply(kernels, planes, channels, size,
               (dy, mask, y, dx, dy, dy, dy if std is None else std, scale if affine else dy, dy, coef))
