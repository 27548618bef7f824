"""MAX pooling on the CPU compiled from LLVM IR (backend/llvm.py): Caffe's
loops for any window, stride and padding, 8 neighbouring outputs a vector
where the column stride is 1-4, or 8 planes a vector where an output row
is shorter than 8 (every plane's windows are alike).

Why: the NumPy fallback (backend/cpu/pool.py) takes a copy of the input
into stride phases and a dozen passes over it to find each window's first
maximum, and its backward is a scatter-add through ``np.add.at``; a
compiled loop reads each input once (measurements: docs/design/cpu.md).

Forward: each output is the first maximum in raster order of its window
clipped to the image (Caffe's ``MaxPoolForward``, as backend/gpu.py), and
``idx`` the flat ``h * W + w`` of that input in its unpadded plane; NaN
inputs are passed over, as in Caffe (``v > best`` is false).  Backward:
dx is zero, plus each output gradient added at its ``idx`` in output order.
Float32 and float64.  :func:`available` is False off x86-64, without
llvmlite or with ``CAFFEMPI_COMPILED_POOLING=0``, and the callers use the
NumPy fallback.
"""
import ctypes
import functools

import numpy as np

from .. import config
from . import llvm

_P, _I = ctypes.c_void_p, ctypes.c_int64
_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
LANES = 8                       # outputs a vector
VECTOR_STRIDES = (1, 2, 3, 4)   # column strides with a vector kernel of their own


def _forward(m, real, name, stride=None, across=1):
    """name(x, y, idx, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw); with
    ``stride`` (sw == stride), LANES neighbouring outputs whose windows lie
    inside the row at a time, in vectors: each tap one load of the row's
    7 * stride + 1 values from the group's first and a shuffle of every
    stride-th (no gathers); the other outputs one at a time.  With
    ``across`` = LANES (``planes`` then a multiple of it), each output of
    LANES planes at once, lane t reading plane t: every plane's windows
    are alike (clipped alike), so a tap is LANES loads hw apart and one
    compare, for output rows too short for the row vectors (LeNet's 4
    outputs a row, GoogLeNet's 7)."""
    ir = m.ir
    i32p = m.i32.as_pointer()
    fn, b = m.function(name, [real.as_pointer()] * 2 + [i32p] + [m.i64] * 11)
    x, y, idx, planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw = fn.args
    hw, out_hw = b.mul(h, w), b.mul(oh, ow)
    lowest = ir.Constant(real, float("-inf"))
    if stride is not None:
        lowest_vector = ir.Constant(ir.VectorType(real, LANES), [float("-inf")] * LANES)
        # lane t's column offset from the group's first: the shuffle's mask too
        every = ir.Constant(ir.VectorType(m.i32, LANES), [t * stride for t in range(LANES)])

    if across > 1:
        lowest = ir.Constant(ir.VectorType(real, across), [float("-inf")] * across)
    in_lane = [b.mul(m.const(t), hw) for t in range(across)]
    out_lane = [b.mul(m.const(t), out_hw) for t in range(across)]

    def plane(p, _):
        first_plane = b.mul(p, m.const(across))
        xp, yp, ip = (b.gep(x, [b.mul(first_plane, hw)]), b.gep(y, [b.mul(first_plane, out_hw)]),
                      b.gep(idx, [b.mul(first_plane, out_hw)]))

        def load_planes(at):
            """The value at ``at`` in each of the ``across`` planes, and ``at``."""
            if across == 1:
                return b.load(b.gep(xp, [at])), b.trunc(at, m.i32)
            v = ir.Constant(lowest.type, ir.Undefined)
            for t in range(across):
                v = b.insert_element(v, b.load(b.gep(xp, [b.add(in_lane[t], at)])), ir.Constant(m.i32, t))
            return v, m.spread(b, b.trunc(at, m.i32), across)

        def store_planes(value, base, at):
            """base[at] = value, in each of the ``across`` planes."""
            if across == 1:
                return b.store(value, b.gep(base, [at]))
            for t in range(across):
                b.store(b.extract_element(value, ir.Constant(m.i32, t)), b.gep(base, [b.add(out_lane[t], at)]))

        def out_row(oy, _):
            top = b.sub(b.mul(oy, sh), ph)
            h0, h1 = m.larger(b, top, m.const(0)), m.smaller(b, b.add(top, kh), h)
            out_row_at = b.mul(oy, ow)

            def window(w0, taps, load, first):
                """The first maximum and its index over rows h0..h1 and
                ``taps`` columns from w0, each tap's value(s) load(index)."""
                def window_row(r, carried):
                    row = b.add(b.mul(b.add(h0, r), w), w0)

                    def tap(q, carried):
                        at = b.add(row, q)
                        v, at = load(at)
                        wins = b.fcmp_ordered(">", v, carried[0])
                        return [b.select(wins, v, carried[0]), b.select(wins, at, carried[1])]
                    return m.counted(b, taps, tap, carried)
                return m.counted(b, b.sub(h1, h0), window_row, first)

            def column(ox):
                left = b.sub(b.mul(ox, sw), pw)
                w0, w1 = m.larger(b, left, m.const(0)), m.smaller(b, b.add(left, kw), w)
                best, arg = window(w0, b.sub(w1, w0), load_planes, [lowest, load_planes(b.add(b.mul(h0, w), w0))[1]])
                out = b.add(out_row_at, ox)
                store_planes(best, yp, out)
                store_planes(arg, ip, out)

            def columns(start, stop):
                m.counted(b, b.sub(stop, start), lambda i, _: column(b.add(start, i)))

            def group(ox):
                left = b.sub(b.mul(ox, sw), pw)

                def load(at):
                    wide = m.vector_at(b, xp, at, 7 * stride + 1)
                    return (b.shuffle_vector(wide, ir.Constant(wide.type, ir.Undefined), every),
                            b.add(m.spread(b, b.trunc(at, m.i32), LANES), every))
                first = b.add(m.spread(b, b.trunc(b.add(b.mul(h0, w), left), m.i32), LANES), every)
                best, arg = window(left, kw, load, [lowest_vector, first])
                out = b.add(out_row_at, ox)
                m.store_vector(b, best, yp, out)
                m.store_vector(b, arg, ip, out)

            if stride is None:
                return columns(m.const(0), ow)
            # outputs lo..hi have windows inside the row: left >= 0, left + kw <= w
            lo = m.smaller(b, b.sdiv(b.add(pw, m.const(stride - 1)), m.const(stride)), ow)
            span = b.sub(b.add(w, pw), kw)
            hi = b.select(b.icmp_signed("<", span, m.const(0)), m.const(0),
                          m.smaller(b, b.add(b.sdiv(span, m.const(stride)), m.const(1)), ow))
            inside = b.sub(m.larger(b, hi, lo), lo)
            with b.if_else(b.icmp_signed(">=", inside, m.const(LANES))) as (vectors, scalars):
                with vectors:
                    columns(m.const(0), lo)
                    m.counted(b, b.sdiv(inside, m.const(LANES)),
                              lambda g, _: group(b.add(lo, b.mul(g, m.const(LANES)))))
                    group(b.sub(hi, m.const(LANES)))        # the last LANES, again in part: same values
                    columns(hi, ow)
                with scalars:
                    columns(m.const(0), ow)
        m.counted(b, oh, out_row)
    m.counted(b, b.sdiv(planes, m.const(across)), plane)
    b.ret_void()


def _backward(m, real, name):
    """name(dy, idx, dx, planes, hw, out_hw): plane by plane, dx zeroed,
    then dx[idx] += dy output by output."""
    ir = m.ir
    fn, b = m.function(name, [real.as_pointer(), m.i32.as_pointer(), real.as_pointer()]
                       + [m.i64] * 3)
    dy, idx, dx, planes, hw, out_hw = fn.args

    def plane(p, _):
        dyp, ip, dxp = b.gep(dy, [b.mul(p, out_hw)]), b.gep(idx, [b.mul(p, out_hw)]), b.gep(dx, [b.mul(p, hw)])
        m.counted(b, hw, lambda i, _: b.store(ir.Constant(real, 0.0), b.gep(dxp, [i])))   # zeroed in cache

        def output(q, _):
            at = b.gep(dxp, [b.sext(b.load(b.gep(ip, [q])), m.i64)])
            b.store(b.fadd(b.load(at), b.load(b.gep(dyp, [q]))), at)
        m.counted(b, out_hw, output)
    m.counted(b, planes, plane)
    b.ret_void()


@functools.lru_cache(maxsize=None)
def _kernel(kind, dtype, stride=None, across=1):
    """The compiled ``kind`` ("forward" or "backward") for ``dtype`` (and a
    column stride with a vector form, or the planes an output vector takes:
    :func:`_forward`) as a ctypes function, each in a module
    of its own, compiled when first asked for (the module of all of them
    took 0.4-0.7 s, paid by every process that pools); None where it does
    not run.  The chunks' threads may ask at once: LLVM compiles one at a
    time, and a second copy compiled meanwhile is dropped by the cache."""
    m = llvm.Builder("caffempi_pooling", 1)
    real = m.f32 if dtype == "f32" else m.f64
    if kind == "forward":
        _forward(m, real, "kernel", stride, across)
        arguments = [_P] * 3 + [_I] * 11
    else:
        _backward(m, real, "kernel")
        arguments = [_P] * 3 + [_I] * 3
    functions = llvm.compile_functions(str(m.module), (), {"kernel": arguments})
    return functions and functions["kernel"]


def available(dtype):
    """Whether the compiled kernels run here for ``dtype`` and are allowed
    (``CAFFEMPI_COMPILED_POOLING``, default on)."""
    return (bool(config.settings.compiled_pooling) and np.dtype(dtype) in _TYPES
            and _kernel("backward", _TYPES[np.dtype(dtype)]) is not None)


def max_forward(x, geom, y, idx):
    """y, idx (C-contiguous (N, C, oh, ow), idx int32) = MAX pooling of the
    C-contiguous images x with ``geom`` (kh, kw, sh, sw, ph, pw, ...), as
    the module says.  Call only where :func:`available`."""
    n, c, h, w = x.shape
    oh, ow = y.shape[2:]
    kind = _TYPES[x.dtype]
    sizes = (h, w, oh, ow) + tuple(geom[:6])
    planes = n * c
    if ow < LANES:      # no row vectors: lanes across planes, the rest one at a time
        grouped = planes - planes % LANES
        _kernel("forward", kind, across=LANES)(x.ctypes.data, y.ctypes.data, idx.ctypes.data, grouped, *sizes)
        rest = [a.reshape(planes, -1)[grouped:].ctypes.data for a in (x, y, idx)]
        _kernel("forward", kind)(*rest, planes - grouped, *sizes)
        return
    stride = geom[3] if geom[3] in VECTOR_STRIDES else None
    _kernel("forward", kind, stride)(x.ctypes.data, y.ctypes.data, idx.ctypes.data, planes, *sizes)


def max_backward(dy, idx, dx):
    """dx (C-contiguous (N, C, h, w)) = the MAX pooling gradient of dy at the
    ``idx`` that :func:`max_forward` wrote (C-contiguous int32, as dy; its
    offsets are trusted to lie in the plane).  Call only where
    :func:`available`."""
    n, c, h, w = dx.shape
    _kernel("backward", _TYPES[dx.dtype])(dy.ctypes.data, idx.ctypes.data, dx.ctypes.data, n * c,
                                          h * w, dy.shape[2] * dy.shape[3])
