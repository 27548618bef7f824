"""BatchNorm's and Scale's per-channel passes on the CPU compiled from LLVM
IR (backend/llvm.py): each channel's planes read in vectors, its sums in
registers, its per-channel operands scalars.

Why: as NumPy calls these passes take a per-channel operand broadcast
over the rows, 2-2.5 times slower than a scalar one, and a call per step
of a block (docs/design/cpu.md); compiled, a channel is read once per
step from cache and the passes are bound by memory.

For channels c0..c1 of (planes, C, S) float32 arrays, C-contiguous:

forward (BatchNorm's): with batch statistics, mean = sum(x) / m, var =
sum((x - mean)^2) / m, std = sqrt(var + eps) (m = planes * S), written to
the per-channel arrays; with given statistics mean and std are read.
y = (x - mean) / std is stored in ``y``; then o = y * scale (+ bias),
max(o, 0) where asked, stored in ``out``.

backward: g = dy, times (out > 0) where the forward took the max; the
affine's sums dbias = sum(g), dscale = sum(g * y) (``y``: the affine's
input) and g = g * scale; then dx = ((y * -(sum(g y) / m) + g) - sum(g) /
m) / std with batch statistics, g / std with given ones, g without.

Sums run in ``LANES`` lanes over each plane's whole vectors and one more
accumulator over the rest, added lane by lane at the channel's end: the
same bits for any block of channels and thread count, and, since a
kernel's step sequence depends only on which steps it takes, the same
bits for BatchNorm's or Scale's own pass and for a chain of them fused
(:meth:`~caffempi.layer_types.base.Layer.absorb`).  No fused multiply-add
(LLVM contracts nothing without fast-math flags), so ``v * scale + bias``
and the max are NumPy's bits.  :func:`available` is False off x86-64,
without llvmlite, for float64, or with ``CAFFEMPI_COMPILED_CHANNELS=0``;
the layers then run their NumPy blocks.

For CuPy arrays :func:`available`, :func:`forward` and :func:`backward`
hand over to the CUDA kernels of :mod:`caffempi.backend.gpu_channels`
(the same steps, sums in double, in at most three launches), so the
layers call one interface on either backend.
"""
import ctypes
import functools

import numpy as np

from .. import config
from . import cupy_or_none, llvm
from .channel_steps import BATCH_STATS, GIVEN_STATS, NO_AFFINE, NO_STATS, SCALE, SCALE_BIAS

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Channel:
    """IR idioms over one channel's planes: vectors of ``lanes`` and a tail
    of single values, zero accumulators, lane-by-lane sums."""

    def __init__(self, m, b, lanes, planes, channels, size):
        self.m, self.b, self.lanes = m, b, lanes
        self.planes, self.channels, self.size = planes, channels, size
        self.whole = b.mul(b.sdiv(size, m.const(lanes)), m.const(lanes))
        self.count = b.sitofp(b.mul(planes, size), m.f32)

    def zero(self, width):
        return self.m.ir.Constant(self.m.ir.VectorType(self.m.f32, width), [0.0] * width)

    def spread(self, value, width):
        return self.m.spread(self.b, value, width)

    def load(self, base, at, width):
        return self.m.vector_at(self.b, base, at, width)

    def store(self, value, base, at):
        self.m.store_vector(self.b, value, base, at)

    def over(self, c, body, sums=0):
        """body(at, width, accumulators) -> accumulators for each step of
        channel ``c``: its planes' whole vectors (width ``lanes``), then
        their remaining values (width 1); ``sums`` accumulators of each
        width start at zero.  Returns each sum's total, in float32."""
        m, b, lanes = self.m, self.b, self.lanes
        wide, one = [self.zero(lanes)] * sums, [self.zero(1)] * sums

        def plane(p, carried):
            base = b.mul(b.add(b.mul(p, self.channels), c), self.size)
            vectors = m.counted(b, b.sdiv(self.whole, m.const(lanes)),
                                lambda i, acc: body(b.add(base, b.mul(i, m.const(lanes))), lanes, acc),
                                carried[:sums])
            rest = m.counted(b, b.sub(self.size, self.whole),
                             lambda i, acc: body(b.add(base, b.add(self.whole, i)), 1, acc), carried[sums:])
            return list(vectors) + list(rest)
        totals = m.counted(b, self.planes, plane, wide + one)
        out = []
        for k in range(sums):
            total = b.extract_element(totals[k], m.ir.Constant(m.i32, 0))
            for lane in range(1, lanes):
                total = b.fadd(total, b.extract_element(totals[k], m.ir.Constant(m.i32, lane)))
            out.append(b.fadd(total, b.extract_element(totals[sums + k], m.ir.Constant(m.i32, 0))))
        return out


def _forward(m, lanes, stats, affine, relu, store_out):
    """kernel(x, y, out, mean, var, std, scale, bias, planes, C, S, c0, c1, eps)."""
    fn, b = m.function("kernel", [m.fp] * 8 + [m.i64] * 5 + [m.f32])
    x, y, out, mean, var, std, scale, bias, planes, channels, size, c0, c1, eps = fn.args
    sqrt = m.module.declare_intrinsic("llvm.sqrt", [m.f32])
    ch = _Channel(m, b, lanes, planes, channels, size)

    def channel(ci, _):
        c = b.add(c0, ci)
        if stats == BATCH_STATS:
            mean_c = b.fdiv(ch.over(c, lambda at, w, acc: [b.fadd(acc[0], ch.load(x, at, w))], 1)[0], ch.count)

            def square(at, w, acc):
                d = b.fsub(ch.load(x, at, w), ch.spread(mean_c, w))
                return [b.fadd(acc[0], b.fmul(d, d))]
            var_c = b.fdiv(ch.over(c, square, 1)[0], ch.count)
            std_c = b.call(sqrt, [b.fadd(var_c, eps)])
            for value, array in ((mean_c, mean), (var_c, var), (std_c, std)):
                b.store(value, b.gep(array, [c]))
        else:
            mean_c, std_c = b.load(b.gep(mean, [c])), b.load(b.gep(std, [c]))
        scale_c = b.load(b.gep(scale, [c])) if affine else None
        bias_c = b.load(b.gep(bias, [c])) if affine == SCALE_BIAS else None

        def step(at, w, _):
            v = b.fdiv(b.fsub(ch.load(x, at, w), ch.spread(mean_c, w)), ch.spread(std_c, w))
            ch.store(v, y, at)
            if affine:
                v = b.fmul(v, ch.spread(scale_c, w))
            if bias_c is not None:
                v = b.fadd(v, ch.spread(bias_c, w))
            if relu:     # NumPy's maximum(v, 0): v where v >= 0 or NaN
                v = b.select(b.fcmp_unordered(">=", v, ch.zero(w)), v, ch.zero(w))
            if store_out:
                ch.store(v, out, at)
            return []
        ch.over(c, step)
    m.counted(b, b.sub(c1, c0), channel)
    b.ret_void()


def _backward(m, lanes, stats, affine, relu, write_dx):
    """kernel(dy, out, y, dx, std, scale, dscale, dbias, planes, C, S, c0, c1)."""
    ir = m.ir
    fn, b = m.function("kernel", [m.fp] * 8 + [m.i64] * 5)
    dy, out, y, dx, std, scale, dscale, dbias, planes, channels, size, c0, c1 = fn.args
    ch = _Channel(m, b, lanes, planes, channels, size)
    one = ir.Constant(m.f32, 1.0)

    def gradient(at, w, scale_c):
        """(g after the max, g after the affine) at ``at``."""
        g = ch.load(dy, at, w)
        if relu:     # NumPy's dy * (out > 0)
            mask = b.select(b.fcmp_ordered(">", ch.load(out, at, w), ch.zero(w)), ch.spread(one, w), ch.zero(w))
            g = b.fmul(g, mask)
        return g, (b.fmul(g, ch.spread(scale_c, w)) if affine else g)

    def channel(ci, _):
        c = b.add(c0, ci)
        scale_c = b.load(b.gep(scale, [c])) if affine else None
        names = (["bias"] if affine == SCALE_BIAS else []) + (["scale"] if affine else []) \
            + (["g", "gy"] if stats == BATCH_STATS else [])

        def sums(at, w, acc):
            g, g2 = gradient(at, w, scale_c)
            yv = ch.load(y, at, w)
            terms = {"bias": g, "scale": b.fmul(g, yv), "g": g2, "gy": b.fmul(g2, yv)}
            return [b.fadd(a, terms[name]) for a, name in zip(acc, names)]
        totals = dict(zip(names, ch.over(c, sums, len(names)))) if names else {}
        for name, array in (("bias", dbias), ("scale", dscale)):
            if name in totals:
                b.store(totals[name], b.gep(array, [c]))
        if not write_dx:
            return
        if stats != NO_STATS:
            std_c = b.load(b.gep(std, [c]))
        if stats == BATCH_STATS:
            minus_mean_gy = b.fneg(b.fdiv(totals["gy"], ch.count))
            mean_g = b.fdiv(totals["g"], ch.count)

        def step(at, w, _):
            _, g2 = gradient(at, w, scale_c)
            if stats == BATCH_STATS:
                t = b.fmul(ch.load(y, at, w), ch.spread(minus_mean_gy, w))
                t = b.fsub(b.fadd(t, g2), ch.spread(mean_g, w))
                g2 = b.fdiv(t, ch.spread(std_c, w))
            elif stats == GIVEN_STATS:
                g2 = b.fdiv(g2, ch.spread(std_c, w))
            ch.store(g2, dx, at)
            return []
        ch.over(c, step)
    m.counted(b, b.sub(c1, c0), channel)
    b.ret_void()


@functools.lru_cache(maxsize=None)
def _kernel(kind, *variant):
    """The compiled ``kind`` ("forward" or "backward") of ``variant`` (its
    flags, as the builders take them) as a ctypes function, compiled when
    first asked for; None where it does not run.  Threads may ask at once:
    LLVM compiles one at a time, and a copy compiled meanwhile is dropped."""
    lanes = 16 if llvm.has_avx512() else 8
    m = llvm.Builder("caffempi_channels", lanes)
    if kind == "forward":
        _forward(m, lanes, *variant)
        arguments = [_P] * 8 + [_I] * 5 + [_F]
    else:
        _backward(m, lanes, *variant)
        arguments = [_P] * 8 + [_I] * 5
    functions = llvm.compile_functions(str(m.module), (), {"kernel": arguments})
    return functions and functions["kernel"]


def available(*arrays):
    """Whether the compiled kernels run here (``CAFFEMPI_COMPILED_CHANNELS``,
    default on) for these arrays: float32 NumPy arrays, C-contiguous, or
    CuPy arrays as :func:`caffempi.backend.gpu_channels.available` says."""
    if not config.settings.compiled_channels:
        return False
    if not all(isinstance(a, np.ndarray) for a in arrays):
        return cupy_or_none() is not None and _device().available(*arrays)
    return (all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)
            and _kernel("backward", NO_STATS, SCALE, False, True) is not None)


def _device():
    """The GPU's kernels (imported with CuPy, on first use)."""
    from . import gpu_channels
    return gpu_channels


def _address(a):
    return 0 if a is None else a.ctypes.data


def forward(x, y, out, stats, mean, var, std, scale=None, bias=None, relu=False, eps=0.0, block=slice(None),
            running=None):
    """The forward steps, as the module says, for the channels of ``block``
    (a slice of axis 1) of (planes, C, S) ``x``, ``y`` and ``out`` (None:
    not stored; not ``y``); ``stats``: BATCH_STATS or GIVEN_STATS; ``mean``,
    ``var``, ``std``: (C,) arrays, written with BATCH_STATS, read (mean,
    std) with GIVEN_STATS; ``scale``, ``bias``: (C,) or None; ``running``:
    with BATCH_STATS, the running sums to update (:func:`update_running`)
    or None."""
    if not isinstance(x, np.ndarray):
        return _device().forward(x, y, out, stats, mean, var, std, scale, bias, relu, eps, block, running)
    planes, channels, size = x.shape
    affine = NO_AFFINE if scale is None else SCALE if bias is None else SCALE_BIAS
    c0, c1, _ = block.indices(channels)
    _kernel("forward", stats, affine, bool(relu), out is not None)(
        x.ctypes.data, y.ctypes.data, _address(out), _address(mean), _address(var), _address(std),
        _address(scale), _address(bias), planes, channels, size, c0, c1, eps)
    if running is not None:
        update_running(running, mean, var, block)


def update_running(running, mean, var, block):
    """Caffe's moving averages of BatchNorm's statistics for the channels
    of ``block``: sums = sums * maf + mean, squares = squares * maf +
    correction * var, in place, for ``running`` = (sums, squares, maf,
    correction) (float32 roundings as NumPy's, on either backend)."""
    sums, squares, maf, correction = running
    sums[block] *= maf
    sums[block] += mean[block]
    squares[block] *= maf
    squares[block] += var[block] * correction


def backward(dy, y, dx, stats, std=None, scale=None, dscale=None, dbias=None, out=None, block=slice(None)):
    """The backward steps, as the module says, for the channels of
    ``block`` of (planes, C, S) ``dy`` and ``y`` (the affine's input, and
    the normalised values with statistics); ``out``: the forward's output
    where it took the max, else None; ``dx``: written unless None;
    ``dscale`` (with ``scale``) and ``dbias``: (C,), written."""
    if not isinstance(dy, np.ndarray):
        return _device().backward(dy, y, dx, stats, std, scale, dscale, dbias, out, block)
    planes, channels, size = dy.shape
    affine = NO_AFFINE if scale is None else SCALE if dbias is None else SCALE_BIAS
    c0, c1, _ = block.indices(channels)
    _kernel("backward", stats, affine, out is not None, dx is not None)(
        dy.ctypes.data, _address(out), y.ctypes.data, _address(dx), _address(std), _address(scale),
        _address(dscale), _address(dbias), planes, channels, size, c0, c1)
