"""Float16 conversions for ``--comm_dtype=fp16`` (host buffers): scale and
round to float16, sum float16 pieces in float32, widen and unscale.

Why: NumPy converts float32 to float16 at 6-8 ns a value and back at 3-5 on
this project's x86 hosts, a scalar loop; a bucket's sum converts each value
about three times, which cost more than the link saved (docs/design/
parallel.md).  Here the conversions are F16C's vector instructions,
compiled from LLVM IR (backend/llvm.py) and called through ctypes, which
releases the GIL (they run on the communication thread).

Results are bitwise those of the NumPy expressions in each docstring, which
are the fallback where the kernels do not run (no llvmlite, not x86-64 with
F16C) or the arrays are not contiguous float32 / float16.
"""
import ctypes
import functools

import numpy as np

from . import llvm

BLOCK = 32          # values a loop step (four 8-float vectors)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# name: (ctypes arguments, the array types it takes in argument order)
_KERNELS = {"to_half": ((_P, _P, _I, _F), (np.float32, np.float16)),
            "from_half": ((_P, _P, _I, _F), (np.float16, np.float32)),
            "sum_halves": ((_P, _P, _I, _I, _I, _P, _F), (np.float16, np.float16))}


def _elementwise(m, name, arguments, body):
    """name(src, dst, n, *extra): dst[i:i+w] = body(b, src, i, w, n, *extra)
    for blocks of BLOCK values, then value by value."""
    fn, b = m.function(name, arguments)
    src, dst, n, *extra = fn.args
    whole = b.sdiv(n, m.const(BLOCK))

    def run(lanes, at):
        m.store_vector(b, body(b, src, at, lanes, n, *extra), dst, at)
    m.counted(b, whole, lambda i, _: run(BLOCK, b.mul(i, m.const(BLOCK))))
    first = b.mul(whole, m.const(BLOCK))
    m.counted(b, b.sub(n, first), lambda i, _: run(1, b.add(first, i)))
    b.ret_void()


def _ir():
    m = llvm.Builder("caffempi_half", BLOCK)
    ir = m.ir

    def vectors(element, lanes):
        return ir.VectorType(element, lanes)

    def to_half(b, src, at, lanes, n, scale):
        return b.fptrunc(b.fmul(m.vector_at(b, src, at, lanes), m.spread(b, scale, lanes)), vectors(m.f16, lanes))

    def from_half(b, src, at, lanes, n, scale):
        return b.fmul(b.fpext(m.vector_at(b, src, at, lanes), vectors(m.f32, lanes)), m.spread(b, scale, lanes))

    def sum_halves(b, src, at, lanes, n, ranks, stride, scales, out_scale):
        def piece(r):
            wide = b.fpext(m.vector_at(b, src, b.add(b.mul(r, stride), at), lanes), vectors(m.f32, lanes))
            return b.fmul(wide, m.spread(b, b.load(b.gep(scales, [r])), lanes))
        total = m.counted(b, b.sub(ranks, m.const(1)),
                          lambda r, acc: [b.fadd(acc[0], piece(b.add(r, m.const(1))))], [piece(m.const(0))])
        return b.fptrunc(b.fmul(total[0], m.spread(b, out_scale, lanes)), vectors(m.f16, lanes))

    _elementwise(m, "to_half", [m.fp, m.hp, m.i64, m.f32], to_half)
    _elementwise(m, "from_half", [m.hp, m.fp, m.i64, m.f32], from_half)
    _elementwise(m, "sum_halves", [m.hp, m.hp, m.i64, m.i64, m.i64, m.fp, m.f32], sum_halves)
    return str(m.module)


@functools.lru_cache(maxsize=None)
def _compiled():
    """{name: ctypes function}, or None where they do not run."""
    return llvm.compile_functions(_ir(), ("f16c", "avx"),
                                  {name: arguments for name, (arguments, _) in _KERNELS.items()})


def available():
    """Whether the compiled conversions run here."""
    return _compiled() is not None


def _kernel(name, *arrays):
    """The compiled ``name`` if every array is C-contiguous and of the
    kernel's type (float32 / float16, in argument order), else None."""
    compiled = _compiled()
    kinds = _KERNELS[name][1]
    if compiled is None or not all(a.flags.c_contiguous and a.dtype == k for a, k in zip(arrays, kinds)):
        return None
    return compiled[name]


def to_half(src, scale, out):
    """out[...] = (src * np.float32(scale)).astype(np.float16), for float32
    ``src`` and C-contiguous float16 ``out`` of one size."""
    kernel = _kernel("to_half", src, out)
    if kernel is None:
        with np.errstate(over="ignore"):       # as the kernel: overflow gives infinities, silently
            out.reshape(-1)[...] = (src.reshape(-1) * np.float32(scale)).astype(np.float16)
    else:
        kernel(src.ctypes.data, out.ctypes.data, src.size, scale)


def from_half(src, scale, out):
    """np.multiply(src, out.dtype.type(scale), out=out): float16 ``src``,
    C-contiguous ``out`` of one size (float32 for the kernel), each value
    widened to out's type, then scaled."""
    kernel = _kernel("from_half", src, out)
    if kernel is None:
        np.multiply(src.reshape(-1), out.dtype.type(scale), out=out.reshape(-1))
    else:
        kernel(src.ctypes.data, out.ctypes.data, src.size, scale)


def sum_halves(pieces, out, scales=None, out_scale=1.0):
    """out[...] = the float32 sum, in row order, of ``pieces`` (ranks x n
    float16, each row contiguous) each widened and times its row's
    ``scales`` (float32; default 1), times ``out_scale``, rounded to float16
    (``out``: n C-contiguous float16)."""
    scales = np.ones(len(pieces), np.float32) if scales is None else np.asarray(scales, np.float32)
    rows_contiguous = pieces.ndim == 2 and pieces.strides[1] == pieces.itemsize
    kernel = _kernel("sum_halves", pieces[0] if rows_contiguous else pieces, out)
    if kernel is None:
        total = pieces[0].astype(np.float32) * scales[0]
        for piece, scale in zip(pieces[1:], scales[1:]):
            total += piece.astype(np.float32) * scale
        with np.errstate(over="ignore"):
            out.reshape(-1)[...] = total * np.float32(out_scale)
    else:
        kernel(pieces.ctypes.data, out.ctypes.data, out.size, len(pieces), pieces.strides[0] // 2,
               scales.ctypes.data, out_scale)
