"""GEMM with a beta, C = A B + beta C, written straight into a row-major C,
through the CBLAS of NumPy's own BLAS library, called with ctypes.

ctypes releases the GIL for the call.  SciPy's BLAS wrappers (what this
replaces) hold it: every weight-gradient GEMM stalled the communication
thread, the data readers and the other intra-op threads for its whole
length (docs/design/cpu.md).  NumPy has no beta = 1 product without a
temporary.

:data:`gemm` is None where NumPy's BLAS is not an OpenBLAS with its CBLAS
exported (NumPy's PyPI wheels ship ``scipy_openblas``, ILP64 with suffixed
names); the callers then use NumPy's products.
"""
import ctypes

import numpy as np

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

# (symbol suffix, integer type) of the OpenBLAS builds NumPy is shipped with
_BUILDS = (("64_", ctypes.c_int64), ("", ctypes.c_int))


def _numpy_openblas():
    """(library path, symbol prefix) of the OpenBLAS NumPy loaded, or None."""
    from threadpoolctl import threadpool_info
    for lib in threadpool_info():
        if lib.get("internal_api") == "openblas" and "numpy" in lib.get("filepath", ""):
            return lib["filepath"], ("scipy_" if lib.get("prefix", "").startswith("libscipy_openblas") else "")
    return None


def _load():
    """{dtype: cblas_?gemm with argtypes set}, or None."""
    found = _numpy_openblas()
    if found is None:
        return None
    path, prefix = found
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for suffix, blasint in _BUILDS:
        try:
            funcs = {dtype: getattr(lib, "%scblas_%sgemm%s" % (prefix, letter, suffix))
                     for dtype, letter in ((np.float32, "s"), (np.float64, "d"))}
        except AttributeError:
            continue
        for dtype, f in funcs.items():
            real = ctypes.c_float if dtype == np.float32 else ctypes.c_double
            f.restype = None
            f.argtypes = [ctypes.c_int] * 3 + [blasint] * 3 + [real, ctypes.c_void_p, blasint,
                                                                ctypes.c_void_p, blasint, real, ctypes.c_void_p,
                                                                blasint]
        return funcs
    return None


def _layout(a):
    """(transposed, leading dimension) of ``a`` (M, K) as a row-major BLAS
    operand, or None where neither its rows nor its columns are contiguous."""
    item = a.itemsize
    if a.strides[1] == item and a.strides[0] >= a.shape[1] * item:
        return _NO_TRANS, a.strides[0] // item
    if a.strides[0] == item and a.strides[1] >= a.shape[0] * item:
        return _TRANS, a.strides[1] // item
    return None


def operand(a):
    """``a``, or a contiguous copy where :func:`gemm` could not take it as
    it is (so that callers splitting a product copy once, not per block)."""
    return a if _layout(a) is not None else np.ascontiguousarray(a)


def _gemm(a, b, out, beta):
    """out (M, N) = a (M, K) @ b (K, N) + beta * out (beta 0 or 1); all of
    ``out``'s dtype (float32 or float64), ``out``'s rows contiguous."""
    f = _funcs[out.dtype.type]
    m, n = out.shape
    k = a.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not beta:
            out[...] = 0
        return out
    a, b = operand(a), operand(b)
    (trans_a, lda), (trans_b, ldb) = _layout(a), _layout(b)
    f(_ROW_MAJOR, trans_a, trans_b, m, n, k, 1.0, a.ctypes.data, max(lda, 1), b.ctypes.data, max(ldb, 1),
      beta, out.ctypes.data, out.strides[0] // out.itemsize)
    return out


_funcs = _load()
#: gemm(a, b, out, beta), or None where NumPy's BLAS has no CBLAS to call
gemm = None if _funcs is None else _gemm
