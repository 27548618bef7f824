"""Direct convolution on the CPU: a register-tiled kernel written in LLVM IR,
compiled for this machine at first use and called through ctypes, which
releases the GIL (backend/llvm.py).

Why: OpenBLAS runs the convolutions' products well below its rate for a
square sgemm where a group has few output channels (CIFAR10-quick's 32 and
64): every column of the unfolded input is packed for only O/group outputs.
A direct kernel reads the padded input where it lies and keeps its sums in
registers for the whole reduction (measurements: docs/design/cpu.md).

The kernel.  A tile (:class:`Tile`) is ``out_block`` output channels (two
vectors) by up to ``pixels`` neighbouring outputs of one output row; its
2 x pixels sums stay in registers while it runs over the reduction (input
channel, kernel row, kernel column): per step two weight vectors, one
broadcast input value per pixel and 2 x pixels fused multiply-adds.  The
tile is chosen from the host's features: 8-float vectors by 6 pixels with
AVX2 (15 of its 16 vector registers), 16-float vectors by 8 pixels with
AVX-512 (its 32) where the outputs a group fill its blocks of 32.  The sums start from zero every
:data:`REDUCTION_BLOCK` steps, added to running totals between the runs,
and the bias is added last (as accurate as the GEMM path or more; a single
sum over the whole reduction was not).  The reduction's input offsets come
from a table, so strides, dilation and padding (the input arrives padded)
are all the same code; a group is a call of its own.  The weights are
reordered to (group, block of out_block outputs, reduction, out_block),
zero-filled past O/group; sums past O/group are not stored.  Each output is
summed in a fixed order, whatever the tile, so results do not depend on the
tile or on how images are split over threads; they differ from the GEMM
kernels' in the last bits (another summation order).

Float32 on x86-64 with AVX2 and FMA (AVX-512 used where present), what
the kernel is written and measured for; :func:`available` is False elsewhere (no llvmlite, another
CPU, ``CAFFEMPI_DIRECT_CONV=0``) and the callers use the GEMM kernels.
"""
import ctypes
import functools
import typing

import numpy as np

from .. import config
from . import llvm



class Tile(typing.NamedTuple):
    """A tile's shape: ``vector`` float32 lanes a register, two registers
    of outputs (``out_block``) by ``pixels`` outputs of a row."""
    vector: int
    pixels: int

    @property
    def out_block(self):
        return 2 * self.vector


#: AVX2's 16 vector registers: 12 sums, 2 weight vectors, a broadcast
AVX2_TILE = Tile(8, 6)
#: AVX-512's 32: 16 sums and their totals, weights and a broadcast (8
#: pixels ran 1.5-1.7 times as fast as AVX2_TILE, 7, 9, 10 and 12 slower)
AVX512_TILE = Tile(16, 8)
#: terms of the reduction summed from zero in registers before they are
#: added to the running totals (also in registers), and the bias added
#: last: one sum over a whole reduction, from the bias, was 1.5-3.8 times
#: less accurate than the GEMM path, whose products sum a kernel row or a
#: cache block at a time; runs of 32 are more accurate than it on every
#: shape the kernel takes (tests/layers/test_conv_direct.py,
#: docs/design/cpu.md)
REDUCTION_BLOCK = 32

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Builder(llvm.Builder):
    """The shared IR idioms for ``tile``, with the fused multiply-add of its
    vectors and a run of tiles."""

    def __init__(self, tile):
        super().__init__("caffempi_direct_conv", tile.vector)
        self.tile = tile
        self.fma = self.ir.Function(self.module, self.ir.FunctionType(self.vec, [self.vec] * 3),
                                    name="llvm.fma.v%df32" % tile.vector)

    def tiled(self, b, n, tiles, call):
        """call(tiles[pixels], start) for the whole tiles of a run of ``n``,
        then call(tiles[r], start) for its last r < pixels."""
        pixels = self.tile.pixels
        whole = b.sdiv(n, self.const(pixels))
        rest_at = b.mul(whole, self.const(pixels))
        self.counted(b, whole, lambda t, _: call(tiles[pixels], b.mul(t, self.const(pixels))))
        after = b.function.append_basic_block()
        switch = b.switch(b.sub(n, rest_at), after)
        for r in range(1, pixels):
            case = b.function.append_basic_block()
            switch.add_case(self.const(r), case)
            b.position_at_end(case)
            call(tiles[r], rest_at)
            b.branch(after)
        b.position_at_end(after)


def _forward_tile(m, r):
    """tile(x, w, bias, y, koff, K, sw, p, valid): y[o*p + t] = (sum over k
    of w[k*out_block + o] * x[koff[k] + t*sw]) + bias[o], for the r pixels t
    and the outputs o < valid; the sum in runs of REDUCTION_BLOCK terms,
    each run's partial sums added to running totals, the bias last (see
    :data:`REDUCTION_BLOCK`)."""
    fn, b = m.function("forward%d" % r, [m.fp] * 4 + [m.ip] + [m.i64] * 4, internal=True)
    x, w, bias, y, koff, k_len, sw, p, valid = fn.args
    pixel = [b.mul(sw, m.const(t)) for t in range(r)]
    vector, out_block = m.tile.vector, m.tile.out_block
    block = m.const(REDUCTION_BLOCK)
    zero = m.ir.Constant(m.vec, [0.0] * vector)

    def run(j, totals):
        """Terms j*REDUCTION_BLOCK on, up to REDUCTION_BLOCK of them, summed
        from zero, then added to ``totals``."""
        first = b.mul(j, block)

        def step(i, sums):
            k = b.add(first, i)
            offset = b.load(b.gep(koff, [k]))
            wk = b.mul(k, m.const(out_block))
            weights = [m.vector_at(b, w, b.add(wk, m.const(v * vector))) for v in range(2)]
            out = []
            for t in range(r):
                spread = m.spread(b, b.load(b.gep(x, [b.add(offset, pixel[t])])))
                out += [b.call(m.fma, [spread, weights[v], sums[2 * t + v]]) for v in range(2)]
            return out
        sums = m.counted(b, m.smaller(b, b.sub(k_len, first), block), step, [zero] * (2 * r))
        return [b.fadd(total, s) for total, s in zip(totals, sums)]

    totals = m.counted(b, b.sdiv(b.add(k_len, m.const(REDUCTION_BLOCK - 1)), block), run, [zero] * (2 * r))
    bias_vectors = [m.vector_at(b, bias, m.const(v * vector)) for v in range(2)]
    totals = [b.fadd(total, bias_vectors[i % 2]) for i, total in enumerate(totals)]
    for o in range(out_block):
        store, after = fn.append_basic_block(), fn.append_basic_block()
        b.cbranch(b.icmp_signed("<", m.const(o), valid), store, after)
        b.position_at_end(store)
        row = b.mul(m.const(o), p)
        for t in range(r):
            lane = b.extract_element(totals[2 * t + o // vector], m.ir.Constant(m.i32, o % vector))
            b.store(lane, b.gep(y, [b.add(row, m.const(t))]))
        b.branch(after)
        b.position_at_end(after)
    b.ret_void()
    return fn


def _forward(m):
    """forward(x, w, bias, y, koff, images, K, blocks, outputs, oh, ow,
    x image stride, x row stride, sh, sw, y image stride): the tiles of every
    image, block of outputs and output row."""
    tiles = {r: _forward_tile(m, r) for r in range(1, m.tile.pixels + 1)}
    fn, b = m.function("forward", [m.fp] * 4 + [m.ip] + [m.i64] * 11)
    x, w, bias, y, koff, images, k_len, blocks, outputs, oh, ow, x_image, x_row, sh, sw, y_image = fn.args
    p = b.mul(oh, ow)

    def image(n, _):
        xi, yi = b.gep(x, [b.mul(n, x_image)]), b.gep(y, [b.mul(n, y_image)])

        def block(ob, _):
            first = b.mul(ob, m.const(m.tile.out_block))
            wb, bb = b.gep(w, [b.mul(first, k_len)]), b.gep(bias, [first])
            yb, valid = b.gep(yi, [b.mul(first, p)]), b.sub(outputs, first)

            def out_row(oy, _):
                xr, yr = b.gep(xi, [b.mul(b.mul(oy, sh), x_row)]), b.gep(yb, [b.mul(oy, ow)])
                m.tiled(b, ow, tiles, lambda tile, ox: b.call(
                    tile, [b.gep(xr, [b.mul(ox, sw)]), wb, bb, b.gep(yr, [ox]), koff, k_len, sw, p, valid]))
            m.counted(b, oh, out_row)
        m.counted(b, blocks, block)
    m.counted(b, images, image)
    b.ret_void()


def _ir(tile):
    """The module's LLVM IR (text): ``forward`` and its tiles of ``tile``."""
    m = _Builder(tile)
    _forward(m)
    return str(m.module)


def tile_for(og):
    """The tile for ``og`` outputs a group here: :data:`AVX512_TILE` where
    the CPU has AVX-512F and they fill its blocks of 32, else
    :data:`AVX2_TILE` (blocks of 16)."""
    return AVX512_TILE if llvm.has_avx512() and og % AVX512_TILE.out_block == 0 else AVX2_TILE


@functools.lru_cache(maxsize=None)
def compiled_for(tile):
    """The kernel of ``tile`` compiled for this CPU as a ctypes function, or
    None where it does not run here (any tile compiles on an AVX2 CPU: LLVM
    splits wider vectors)."""
    functions = llvm.compile_functions(_ir(tile), ("avx2", "fma"), {"forward": [_P] * 5 + [_I] * 11})
    return functions and functions["forward"]


def available():
    """Whether the direct kernel runs here and is allowed
    (``CAFFEMPI_DIRECT_CONV``, default on)."""
    return bool(config.settings.direct_conv) and compiled_for(AVX2_TILE) is not None


# Where the direct kernel beats the GEMM kernels (:func:`suits`): a
# reduction of at least _MIN_REDUCTION (in shorter ones its tiles' stores
# weigh), whole blocks of outputs a group, and either at most _FEW_OUTPUTS
# outputs a group (the GEMMs' weakest shapes, at any reduction) or a
# reduction of at most _MAX_REDUCTION (in longer ones the weight blocks
# leave the fast caches) with at most _MAX_OUTPUTS outputs a group or a
# stride over 1 (docs/design/cpu.md, "Where the direct kernel is used").
_MIN_REDUCTION = 64
_MAX_REDUCTION = 1536
_MAX_OUTPUTS = 64
_FEW_OUTPUTS = 32


def suits(cg, og, geom):
    """Whether a convolution of ``cg`` input and ``og`` output channels per
    group and window ``geom`` runs faster by the direct kernel than by the
    GEMM kernels here (see the bounds above)."""
    kh, kw, sh, sw = geom[:4]
    k = cg * kh * kw
    return (k >= _MIN_REDUCTION and og % AVX2_TILE.out_block == 0
            and (og <= _FEW_OUTPUTS or (k <= _MAX_REDUCTION and (og <= _MAX_OUTPUTS or sh > 1 or sw > 1))))


@functools.lru_cache(maxsize=64)
def _offsets(cg, kh, kw, hp, wp, dh, dw):
    """The reduction's input offsets in (channel, kernel row, kernel column)
    order, relative to a window's first input."""
    c, i, j = np.meshgrid(np.arange(cg), np.arange(kh) * dh * wp, np.arange(kw) * dw, indexing="ij")
    offsets = (c * hp * wp + i + j).astype(np.int64).ravel()
    offsets.flags.writeable = False
    return offsets


def forward(xpad, w, geom, group, y, bias=None, tile=None):
    """A function run(a, m) that writes y[a:a+m] (images, C-contiguous
    (N, O, oh, ow) float32) = the convolution of xpad[a:a+m] (C-contiguous
    float32, already padded) with ``w`` (O, C/group, kh, kw), plus ``bias``
    (O,) if given, by the kernel of ``tile`` (default: :func:`tile_for`
    the outputs a group).  Call only where :func:`available`."""
    tile = tile or tile_for(w.shape[0] // group)
    kh, kw, sh, sw, _, _, dh, dw = geom
    _, c, hp, wp = xpad.shape
    _, o, oh, ow = y.shape
    g = group
    cg, og = c // g, o // g
    k = cg * kh * kw
    out_block = tile.out_block
    blocks = -(-og // out_block)
    wr = np.zeros((g, blocks * out_block, k), np.float32)
    wr[:, :og] = w.reshape(g, og, k)
    wr = np.ascontiguousarray(wr.reshape(g, blocks, out_block, k).transpose(0, 1, 3, 2))
    br = np.zeros((g, blocks * out_block), np.float32)
    if bias is not None:
        br[:, :og] = bias.reshape(g, og)
    koff = _offsets(cg, kh, kw, hp, wp, dh, dw)
    kernel = compiled_for(tile)
    x_image, y_image = c * hp * wp, o * oh * ow
    item = xpad.itemsize

    def run(a, m):
        for gi in range(g):
            kernel(xpad.ctypes.data + item * (a * x_image + gi * cg * hp * wp), wr[gi].ctypes.data,
                   br[gi].ctypes.data, y.ctypes.data + item * (a * y_image + gi * og * oh * ow), koff.ctypes.data,
                   m, k, blocks, og, oh, ow, x_image, wp, sh, sw, y_image)
    return run

