"""cuDNN convolution through ctypes (CuPy v14 dropped its cuDNN bindings).

Same contracts as :func:`caffempi.backend.gpu.conv2d_forward` and
:func:`~caffempi.backend.gpu.conv2d_backward` (NCHW, ``geom`` = ``(kh, kw, sh,
sw, ph, pw, dh, dw)``, w (O, C/group, kh, kw)), on cuDNN's legacy (v7-style)
convolution API, which cuDNN 9 still ships in libcudnn_cnn.

Nothing CUDA is touched at import: the library loads on the first
:func:`available` or convolution call, so this module imports on machines
without a GPU.  Algorithms are chosen like ``torch.backends.cudnn.benchmark``:
the first call for a (shapes, geometry, group, dtype) times every algorithm
with cudnnFind*AlgorithmEx on a workspace from CuPy's pool and keeps the
fastest that succeeds within ``WORKSPACE_CAP``.  FP32 runs with
CUDNN_FMA_MATH (no TF32 tensor cores, so results stay within ~1e-5 of the
CPU's) unless ``config.settings.tf32`` (CAFFEMPI_TF32=1);
``config.settings.cudnn_deterministic`` (CAFFEMPI_CUDNN_DETERMINISTIC=1)
keeps only bit-reproducible algorithms.  Both are read per call and are part
of the plan's key.
"""
import collections
import ctypes
import ctypes.util
import os
import threading

from .. import config
from . import cupy_or_none
from .cpu import conv_out_size

WORKSPACE_CAP = 1 << 30          # bytes an algorithm may use
PLAN_CACHE_SIZE = 256            # (shape, geometry) plans kept, least recent dropped
find_calls = 0                   # cudnnFind*Ex calls made (tests check plans are reused)
# WINOGRAD_NONFUSED (forward 7, backward data 5, backward filter 5) is never
# picked: on an H100 with cuDNN 9.19 it was off by ~1e-2 of the output's
# magnitude for 5x5 kernels (~1e-5 for 3x3), where every other algorithm,
# FFT included, stayed near 1e-6.  Changing this set needs clear_cache().
EXCLUDED_ALGOS = {"fwd": {7}, "bwd_data": {5}, "bwd_filter": {5}}
last_find = []                   # the last search's (algo, status, ms, bytes, determinism, mathType)

# Enum values from cudnn_graph.h / cudnn_cnn.h (cuDNN 8 and 9).
_SUCCESS = 0
_TENSOR_NCHW = 0
_DATA_TYPE = {"float32": 0, "float64": 1}          # CUDNN_DATA_FLOAT, CUDNN_DATA_DOUBLE
_CROSS_CORRELATION = 1                             # Caffe's "convolution" does not flip w
_DEFAULT_MATH, _FMA_MATH = 0, 3
_TENSOR_OP_MATHS = (1, 2)                          # TENSOR_OP_MATH, ..._ALLOW_CONVERSION
_DETERMINISTIC = 1
# Direction -> the name part of cudnnFindConvolution<X>AlgorithmEx,
# cudnnGetConvolution<X>WorkspaceSize, cudnnConvolution<X> and friends.  All
# three directions take their arguments in the same order: two inputs, then
# the convolution descriptor, then the output.
_DIRECTIONS = {"fwd": "Forward", "bwd_data": "BackwardData", "bwd_filter": "BackwardFilter"}
# The tensors each direction's call takes: its two inputs, then its output.
_ROLES = {"fwd": ("x", "w", "y"), "bwd_data": ("w", "y", "x"), "bwd_filter": ("x", "y", "w")}


class _Perf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (same layout, cuDNN >= 8)."""
    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int),
                ("mathType", ctypes.c_int), ("reserved", ctypes.c_int * 3)]


_P, _I, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_PP, _PI, _PS = ctypes.POINTER(_P), ctypes.POINTER(_I), ctypes.POINTER(_S)
_SIGNATURES = {      # name: (restype, argtypes); cudnnStatus_t and enums are int
    "cudnnGetVersion": (_S, []),
    "cudnnGetErrorString": (ctypes.c_char_p, [_I]),
    "cudnnCreate": (_I, [_PP]),
    "cudnnSetStream": (_I, [_P, _P]),
    "cudnnCreateTensorDescriptor": (_I, [_PP]),
    "cudnnSetTensor4dDescriptor": (_I, [_P, _I, _I, _I, _I, _I, _I]),   # format, type, n, c, h, w
    "cudnnSetTensor4dDescriptorEx": (_I, [_P, _I] + [_I] * 8),        # type, n, c, h, w, their strides
    "cudnnDestroyTensorDescriptor": (_I, [_P]),
    "cudnnCreateFilterDescriptor": (_I, [_PP]),
    "cudnnSetFilter4dDescriptor": (_I, [_P, _I, _I, _I, _I, _I, _I]),   # type, format, k, c, h, w
    "cudnnDestroyFilterDescriptor": (_I, [_P]),
    "cudnnCreateConvolutionDescriptor": (_I, [_PP]),
    # pad_h, pad_w, u, v, dilation_h, dilation_w, mode, computeType
    "cudnnSetConvolution2dDescriptor": (_I, [_P, _I, _I, _I, _I, _I, _I, _I, _I]),
    "cudnnSetConvolutionGroupCount": (_I, [_P, _I]),
    "cudnnSetConvolutionMathType": (_I, [_P, _I]),
    "cudnnGetConvolution2dForwardOutputDim": (_I, [_P, _P, _P, _PI, _PI, _PI, _PI]),
    "cudnnDestroyConvolutionDescriptor": (_I, [_P]),
}
for _x in _DIRECTIONS.values():
    _SIGNATURES.update({
        "cudnnGetConvolution%sAlgorithmMaxCount" % _x: (_I, [_P, _PI]),
        # handle, aDesc, a, bDesc, b, convDesc, outDesc, out, requested, returned, perf, ws, wsSize
        "cudnnFindConvolution%sAlgorithmEx" % _x:
            (_I, [_P] * 8 + [_I, _PI, ctypes.POINTER(_Perf), _P, _S]),
        # handle, aDesc, bDesc, convDesc, outDesc, algo, sizeInBytes
        "cudnnGetConvolution%sWorkspaceSize" % _x: (_I, [_P] * 5 + [_I, _PS]),
        # handle, alpha, aDesc, a, bDesc, b, convDesc, algo, ws, wsSize, beta, outDesc, out
        "cudnnConvolution%s" % _x: (_I, [_P] * 7 + [_I, _P, _S, _P, _P, _P]),
    })

_lock = threading.RLock()
_lib = None                        # the CDLL once loaded, False when it cannot be
_handles = {}                      # CUDA device id -> cudnnHandle_t
_plans = collections.OrderedDict()  # LRU of _Plan
# alpha = 1, beta = 0 (outputs overwritten), in the type cuDNN reads for the data type
_SCALARS = {"float32": (ctypes.c_float(1.0), ctypes.c_float(0.0)),
            "float64": (ctypes.c_double(1.0), ctypes.c_double(0.0))}


def _library_paths():
    """The pip wheel's copy (nvidia-cudnn-cu13/cu12) first, then the system's."""
    try:
        import nvidia.cudnn
        dirs = [os.path.join(d, "lib") for d in nvidia.cudnn.__path__]
    except Exception:        # not installed (namespace package absent)
        dirs = []
    for d in dirs:
        # libcudnn.so.9 dlopens its sub-libraries by soname; loading them first,
        # global, from the same folder makes that work even without an RPATH.
        for sub in ("graph", "ops", "cnn"):
            try:
                ctypes.CDLL(os.path.join(d, "libcudnn_%s.so.9" % sub), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
        yield os.path.join(d, "libcudnn.so.9")
    found = ctypes.util.find_library("cudnn")
    if found:
        yield found
    yield "libcudnn.so.9"


def _load():
    global _lib
    with _lock:
        if _lib is None:
            _lib = False
            for path in _library_paths():
                try:
                    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    for name, (restype, argtypes) in _SIGNATURES.items():
                        fn = getattr(lib, name)
                        fn.restype, fn.argtypes = restype, argtypes
                    if lib.cudnnGetVersion() < 8000:    # the perf structs differ before 8
                        continue
                except (OSError, AttributeError):
                    continue
                _lib = lib
                break
    return _lib


def available():
    """True when CuPy imports and a cuDNN >= 8 with the legacy convolution API loads."""
    try:
        return bool(_load()) and cupy_or_none() is not None
    except Exception:
        return False


def version():
    """cudnnGetVersion() (e.g. 91900 for 9.19.0), or None when cuDNN is not available."""
    return int(_lib.cudnnGetVersion()) if available() else None


def _call(name, *args):
    status = getattr(_lib, name)(*args)
    if status != _SUCCESS:
        msg = _lib.cudnnGetErrorString(status)
        raise RuntimeError("%s failed: %s (status %d)" % (name, msg.decode() if msg else "?", status))


def _handle(cp):
    """This device's handle, bound to CuPy's current stream so the work is
    ordered with the CuPy kernels around it."""
    dev = cp.cuda.Device().id
    h = _handles.get(dev)
    if h is None:
        p = ctypes.c_void_p()
        _call("cudnnCreate", ctypes.byref(p))
        h = _handles[dev] = p.value
    _call("cudnnSetStream", h, cp.cuda.get_current_stream().ptr)
    return h


def _workspace(cp, nbytes):
    """A workspace from CuPy's pool (None for zero bytes); on an out-of-memory
    the pool's cached blocks are released and the allocation tried once more."""
    if not nbytes:
        return None
    try:
        return cp.empty(nbytes, cp.uint8)
    except cp.cuda.memory.OutOfMemoryError:
        cp.get_default_memory_pool().free_all_blocks()
        return cp.empty(nbytes, cp.uint8)


def _ptr(a):
    return None if a is None else a.data.ptr


class _Plan:
    """Descriptors for one (x shape, w shape, geom, group, dtype, math mode,
    determinism) and, per direction, the algorithm chosen and the number of
    calls it takes: one for the whole (grouped) convolution, or, for
    ``group`` > 1, one per group on that group's slices of x, w and y, as
    Caffe's own cuDNN layer runs them.  Both are timed and the faster kept:
    cuDNN's grouped kernels ran AlexNet's conv4 (2 groups) 3 times slower
    per FLOP than its conv3 (H200, docs/performance/gpu.md).  Destroyed
    only when evicted."""

    def __init__(self, x_shape, w_shape, geom, group, dtype, math, deterministic):
        kh, kw, sh, sw, ph, pw, dh, dw = geom
        dt = _DATA_TYPE[dtype]
        self.y_shape = _out_shape(x_shape, w_shape, geom)
        self.math = math
        self.deterministic = deterministic
        self.scalars = _SCALARS[dtype]
        self.algo = {}            # direction -> (calls, algo, workspace bytes)
        self.desc, self.conv, self.step = {}, {}, {}     # per number of calls
        self._owned = []
        try:
            ways = [(1, x_shape, w_shape, self.y_shape, group)]
            if group > 1:
                (n, c, h, wd), o = x_shape, w_shape[0]
                ways.append((group, (n, c // group, h, wd), (o // group,) + tuple(w_shape[1:]),
                             (n, o // group) + self.y_shape[2:], 1))
            itemsize = 8 if dtype == "float64" else 4
            for calls, xs, ws, ys, groups in ways:
                self.desc[calls] = {"x": self._tensor(xs, x_shape, dt), "y": self._tensor(ys, self.y_shape, dt),
                                    "w": self._new("Filter")}
                _call("cudnnSetFilter4dDescriptor", self.desc[calls]["w"], dt, _TENSOR_NCHW, *ws)
                self.step[calls] = {"x": _count(xs[1:]) * itemsize, "y": _count(ys[1:]) * itemsize,
                                    "w": _count(ws) * itemsize}
                # One convolution descriptor per direction: each is given the
                # math type its chosen algorithm was timed with.
                self.conv[calls] = {}
                for d in _DIRECTIONS:
                    cd = self.conv[calls][d] = self._new("Convolution")
                    _call("cudnnSetConvolution2dDescriptor", cd, ph, pw, sh, sw, dh, dw, _CROSS_CORRELATION, dt)
                    _call("cudnnSetConvolutionGroupCount", cd, groups)
                    _call("cudnnSetConvolutionMathType", cd, math)
                # Caffe's output size and cuDNN's must agree, or the descriptors are wrong.
                dims = [ctypes.c_int() for _ in range(4)]
                _call("cudnnGetConvolution2dForwardOutputDim", self.conv[calls]["fwd"], self.desc[calls]["x"],
                      self.desc[calls]["w"], *[ctypes.byref(v) for v in dims])
                if tuple(v.value for v in dims) != tuple(ys):
                    raise RuntimeError("cuDNN output shape %s != %s" % ([v.value for v in dims], ys))
        except Exception:
            self.destroy()
            raise

    def _new(self, kind):
        p = ctypes.c_void_p()
        _call("cudnnCreate%sDescriptor" % kind, ctypes.byref(p))
        self._owned.append((kind, p.value))
        return p.value

    def _tensor(self, shape, whole, dt):
        """A descriptor of ``shape``, the leading channels of a C-contiguous
        tensor of shape ``whole``."""
        t = self._new("Tensor")
        n, c, h, w = whole
        _call("cudnnSetTensor4dDescriptorEx", t, dt, *shape, c * h * w, h * w, w, 1)
        return t

    def destroy(self):
        for kind, p in self._owned:
            getattr(_lib, "cudnnDestroy%sDescriptor" % kind)(p)
        self._owned = []

    def run(self, cp, d, arrays):
        """The direction's output (``arrays[role]``, roles x, w, y) from its
        inputs, with its algorithm (found on first use)."""
        h = _handle(cp)
        if d not in self.algo:
            self._choose(cp, h, d, arrays)
        calls, algo, nbytes = self.algo[d]
        ws = _workspace(cp, nbytes)
        one, zero = self.scalars
        desc, step = self.desc[calls], self.step[calls]
        for g in range(calls):
            (a_desc, a), (b_desc, b), (out_desc, out) = (
                (desc[r], _ptr(arrays[r]) + g * step[r]) for r in _ROLES[d])
            _call("cudnnConvolution" + _DIRECTIONS[d], h, ctypes.byref(one), a_desc, a, b_desc, b,
                  self.conv[calls][d], algo, _ptr(ws), nbytes, ctypes.byref(zero), out_desc, out)

    def _ws_size(self, h, d, calls, algo):
        size = ctypes.c_size_t()
        a_desc, b_desc, out_desc = (self.desc[calls][r] for r in _ROLES[d])
        status = getattr(_lib, "cudnnGetConvolution%sWorkspaceSize" % _DIRECTIONS[d])(
            h, a_desc, b_desc, self.conv[calls][d], out_desc, algo, ctypes.byref(size))
        return size.value if status == _SUCCESS else None

    def _choose(self, cp, h, d, arrays):
        """Times each way of running the direction (:meth:`_find`) and keeps
        the fastest: (calls, algo, workspace bytes)."""
        best = None
        for calls in sorted(self.desc):
            try:
                found = self._find(cp, h, d, calls, arrays)
            except RuntimeError:
                if calls == 1:
                    raise
                found = None            # a call per group is only ever an alternative
            if found is not None and (best is None or found[0] * calls < best[0] * best[1]):
                best = (found[0], calls) + found[1:]
        if best is None:
            raise RuntimeError("cuDNN found no usable %s algorithm (deterministic=%s)"
                               % (_DIRECTIONS[d], self.deterministic))
        _, calls, algo, math_type, nbytes = best
        if self.math != _FMA_MATH:          # run it with the math type it was timed with
            _call("cudnnSetConvolutionMathType", self.conv[calls][d], math_type)
        self.algo[d] = (calls, algo, nbytes)

    def _find(self, cp, h, d, calls, arrays):
        """cuDNN's timing of every algorithm for one call of this way (the
        first group's slices where ``calls`` > 1): (ms, algo, math type,
        workspace bytes) of the fastest usable one, or None."""
        global find_calls
        x = _DIRECTIONS[d]
        count = ctypes.c_int()
        _call("cudnnGetConvolution%sAlgorithmMaxCount" % x, h, ctypes.byref(count))
        # Search workspace: the most any algorithm asks for, up to the cap
        # (unsupported algorithms answer with an error status: skipped).
        sizes = [self._ws_size(h, d, calls, i) for i in range(count.value)]
        ws_bytes = max([s for s in sizes if s is not None and s <= WORKSPACE_CAP] or [0])
        try:
            ws = _workspace(cp, ws_bytes)
        except cp.cuda.memory.OutOfMemoryError:
            ws, ws_bytes = None, 0        # time only the algorithms needing none
        perf = (_Perf * count.value)()
        got = ctypes.c_int()
        # The Ex form takes our buffers and workspace (the plain one would
        # cudaMalloc behind CuPy's pool); it scribbles on the output, rewritten after.
        (a_desc, a), (b_desc, b), (out_desc, out) = ((self.desc[calls][r], _ptr(arrays[r])) for r in _ROLES[d])
        _call("cudnnFindConvolution%sAlgorithmEx" % x, h, a_desc, a, b_desc, b, self.conv[calls][d],
              out_desc, out, count.value, ctypes.byref(got), perf, _ptr(ws), ws_bytes)
        find_calls += 1
        del ws
        last_find[:] = [(p.algo, p.status, p.time, p.memory, p.determinism, p.mathType) for p in perf[:got.value]]
        strict = self.math == _FMA_MATH
        ok = [p for p in perf[:got.value]
              if p.status == _SUCCESS and p.memory <= WORKSPACE_CAP and p.algo not in EXCLUDED_ALGOS[d]
              and (not self.deterministic or p.determinism == _DETERMINISTIC)
              and not (strict and p.mathType in _TENSOR_OP_MATHS)]
        if not ok:
            return None
        best = min(ok, key=lambda p: p.time)
        # Find's reported memory has disagreed with Get*WorkspaceSize in some
        # releases: allocate the larger of the two.
        nbytes = max(best.memory, self._ws_size(h, d, calls, best.algo) or 0)
        return best.time, best.algo, best.mathType, nbytes


def _count(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _plan(cp, x_shape, w_shape, geom, group, dtype):
    if dtype.name not in _DATA_TYPE:
        raise TypeError("cuDNN convolution supports float32 and float64, not %s" % dtype)
    math = _DEFAULT_MATH if config.settings.tf32 else _FMA_MATH
    deterministic = bool(config.settings.cudnn_deterministic)
    key = (cp.cuda.Device().id, tuple(x_shape), tuple(w_shape), tuple(int(g) for g in geom),
           int(group), dtype.name, math, deterministic)
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan(x_shape, w_shape, geom, group, dtype.name, math, deterministic)
            if len(_plans) > PLAN_CACHE_SIZE:
                _plans.popitem(last=False)[1].destroy()
        else:
            _plans.move_to_end(key)
    return plan


def clear_cache():
    """Destroy every cached plan (the next call re-runs the algorithm search)."""
    with _lock:
        while _plans:
            _plans.popitem()[1].destroy()


def _out_shape(x_shape, w_shape, geom):
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c, h, wd = x_shape
    return (n, w_shape[0], conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw))


def conv2d_forward(x, w, geom, group, bias=None):
    """y (N, O, oh, ow) = conv(x, w) (+ bias (O,)), a new array."""
    cp = cupy_or_none()
    if not available():
        raise RuntimeError("cuDNN is not available")
    if x.size == 0:            # cuDNN rejects empty tensors (e.g. a batch of 0)
        return cp.zeros(_out_shape(x.shape, w.shape, geom), x.dtype)
    x, w = cp.ascontiguousarray(x), cp.ascontiguousarray(w)
    plan = _plan(cp, x.shape, w.shape, geom, group, x.dtype)
    y = cp.empty(plan.y_shape, x.dtype)
    plan.run(cp, "fwd", {"x": x, "w": w, "y": y})
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)
    return y


def conv2d_backward(x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None):
    """Returns (dx, dw), None where not asked for, both new arrays; ``x`` may be
    None when only dx is needed (``x_shape`` then gives the input shape)."""
    cp = cupy_or_none()
    if not available():
        raise RuntimeError("cuDNN is not available")
    if x_shape is None:
        x_shape = x.shape
    x_shape = tuple(x_shape)
    if dy.size == 0 or 0 in x_shape:      # nothing flows: zero gradients
        return (cp.zeros(x_shape, dy.dtype) if need_dx else None,
                cp.zeros(w.shape, dy.dtype) if need_dw else None)
    w, dy = cp.ascontiguousarray(w), cp.ascontiguousarray(dy)
    plan = _plan(cp, x_shape, w.shape, geom, group, dy.dtype)
    if tuple(dy.shape) != plan.y_shape:
        raise ValueError("dy shape %s, expected %s" % (dy.shape, plan.y_shape))
    dx = dw = None
    if need_dx:
        dx = cp.empty(x_shape, dy.dtype)
        plan.run(cp, "bwd_data", {"w": w, "y": dy, "x": dx})
    if need_dw:
        dw = cp.empty(w.shape, dy.dtype)
        plan.run(cp, "bwd_filter", {"x": cp.ascontiguousarray(x), "y": dy, "w": dw})
    return dx, dw
