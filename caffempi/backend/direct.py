"""Direct convolution on the CPU: register-tiled kernels written in LLVM IR,
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

Banded.  From :data:`BANDED_REDUCTION` terms on, the forward runs each run
of REDUCTION_BLOCK terms over a band of output pixels (any pixels, of any
rows and images, each with its input and output offset from a table, so
no short tile at a row's end) before the next: that run's weights stay
in the fast caches, and the tiles' totals wait in memory (``BAND_TOTALS``
floats a band), which leaves the registers to wider tiles
(:data:`AVX512_WIDE_TILE`, four vectors of outputs).  The same terms are
summed in the same order, so the bits are those of the tiles with their
totals in registers.  The data gradient is the same kernel (``banded``)
with other tables.

The weight gradient (:class:`WeightGradient`) turns the tile around: its
vectors run along the outputs (dy copied with each pixel's outputs
contiguous), its ``pixels`` are kernel taps, and it runs over the output
pixels, ``pixels`` x 2 sums of a block of outputs by taps in registers.
The sums start from zero every run of rows (about :data:`REDUCTION_BLOCK`
pixels), each run is added to the band's totals and each band's to dw, in
band order: each entry's bits do not depend on the tile, the threads (they
split the taps) or the runs of bands.

For few input channels (the first layers) :class:`PixelWeightGradient`
runs its vectors along the output pixels instead, over the input unfolded
along the kernel width, with no copy of dy.

The data gradient (:class:`DataGradient`, stride 1) runs the banded
forward's tiles over dy with the weights flipped, input and output channels
swapped, and sums each row of dx over the kernel rows that reach it only:
its terms are ordered (kernel row, output, kernel column), so those rows
are one run of them, and dy's rows need no zero rows above or below.

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
    vectors: int = 2

    @property
    def out_block(self):
        return self.vectors * self.vector


#: AVX2's 16 vector registers: 12 sums, 2 weight vectors, a broadcast
AVX2_TILE = Tile(8, 6)
#: AVX-512's 32: 16 sums and their totals, weights and a broadcast (8
#: pixels ran 1.5-1.7 times as fast as AVX2_TILE, 7, 9, 10 and 12 slower)
AVX512_TILE = Tile(16, 8)
#: AVX-512's wide tile, four vectors of outputs by 6 pixels: 24 sums, the
#: four weight vectors and a broadcast (the sums' totals are in memory)
AVX512_WIDE_TILE = Tile(16, 6, 4)
#: the weight gradient's tile with AVX-512, ``pixels`` being kernel taps:
#: 28 sums, two dy vectors and a broadcast (14 taps ran 1.1-1.4 times as
#: fast as 8 on the nets' shapes; docs/design/cpu.md)
AVX512_TAPS_TILE = Tile(16, 14)
#: terms of the reduction summed from zero in registers before they are
#: added to the running totals (also in registers), and the bias added
#: last: one sum over a whole reduction, from the bias, was 1.5-3.8 times
#: less accurate than the GEMM path, whose products sum a kernel row or a
#: cache block at a time; runs of 32 are more accurate than it on every
#: shape the kernel takes (tests/layers/test_conv_direct.py,
#: docs/design/cpu.md)
REDUCTION_BLOCK = 32
#: the weight gradient's input and dy rows taken at a time (a band; its
#: sums are added to dw at its end): large images in pieces that stay in
#: the fast caches while every tap runs over them
BAND_BYTES = 256 << 10
#: the banded kernel's sums a band, in floats (pixels * out_block; kept in
#: memory between runs of terms)
BAND_TOTALS = 8192
#: reductions from which the forward runs banded: each run of terms over a
#: band of output pixels before the next, its weights in the fast caches,
#: and the tiles' totals in memory (wider tiles: 1.1-1.3 times as fast on
#: the nets' 3x3 convolutions from 1152 terms); shorter ones keep each
#: tile's totals in registers (CIFAR10-quick's conv1, 75 terms, ran 1.5-1.8
#: times slower banded)
BANDED_REDUCTION = 1024

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Builder(llvm.Builder):
    """The shared IR idioms for ``tile``, with the fused multiply-add of its
    vectors and a run of tiles."""

    def __init__(self, tile):
        super().__init__("caffempi_direct_conv", tile.vector)
        self.tile = tile
        self.fma = self.ir.Function(self.module, self.ir.FunctionType(self.vec, [self.vec] * 3),
                                    name="llvm.fma.v%df32" % tile.vector)
        self.zero = self.ir.Constant(self.vec, [0.0] * tile.vector)

    def add_to(self, b, base, at, value):
        """base[at:at+lanes] += the vector ``value``."""
        self.store_vector(b, b.fadd(self.vector_at(b, base, at), value), base, at)

    def tiled(self, b, n, tiles, call):
        """call(tiles[pixels], start) for the whole tiles of a run of ``n``,
        then call(tiles[r], start) for its last r < pixels (``pixels``: the
        largest key of ``tiles``)."""
        pixels = max(tiles)
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


def _products(m, b, vectors, value, sums):
    """sums[len(vectors)*t + v] + value(t) (broadcast) * vectors[v], for the
    len(sums) / len(vectors) pixels (or taps) t: one term of a tile.  Each
    value is loaded beside its products (loaded first, they would be live
    at once, and the registers spill)."""
    out = []
    for t in range(len(sums) // len(vectors)):
        spread = m.spread(b, value(t))
        out += [b.call(m.fma, [spread, vector, sums[len(out) + v]]) for v, vector in enumerate(vectors)]
    return out


def _forward_tile(m, r):
    """tile(x, w, bias, y, koff, K, sw, p, valid): y[o*p + t] = (sum over k
    of w[k*out_block + o] * x[koff[k] + t*sw]) + bias[o], for the r pixels t
    and the outputs o < valid; the sum in runs of REDUCTION_BLOCK terms,
    each run's partial sums added to running totals, the bias last (see
    :data:`REDUCTION_BLOCK`)."""
    fn, b = m.function("forward%d" % r, [m.fp] * 4 + [m.ip] + [m.i64] * 4, internal=True)
    x, w, bias, y, koff, k_len, sw, p, valid = fn.args
    pixel = [b.mul(sw, m.const(t)) for t in range(r)]
    vector, vectors, out_block = m.tile.vector, m.tile.vectors, m.tile.out_block
    block = m.const(REDUCTION_BLOCK)

    def run(j, totals):
        """Terms j*REDUCTION_BLOCK on, up to REDUCTION_BLOCK of them, summed
        from zero, then added to ``totals``."""
        first = b.mul(j, block)

        def step(i, sums):
            k = b.add(first, i)
            offset = b.load(b.gep(koff, [k]))
            wk = b.mul(k, m.const(out_block))
            weights = [m.vector_at(b, w, b.add(wk, m.const(v * vector))) for v in range(vectors)]
            return _products(m, b, weights, lambda t: b.load(b.gep(x, [b.add(offset, pixel[t])])), sums)
        sums = m.counted(b, m.smaller(b, b.sub(k_len, first), block), step, [m.zero] * (vectors * r))
        return [b.fadd(total, s) for total, s in zip(totals, sums)]

    totals = m.counted(b, b.sdiv(b.add(k_len, m.const(REDUCTION_BLOCK - 1)), block), run,
                       [m.zero] * (vectors * r))
    bias_vectors = [m.vector_at(b, bias, m.const(v * vector)) for v in range(vectors)]
    totals = [b.fadd(total, bias_vectors[i % vectors]) for i, total in enumerate(totals)]
    for o in range(out_block):
        store, after = fn.append_basic_block(), fn.append_basic_block()
        b.cbranch(b.icmp_signed("<", m.const(o), valid), store, after)
        b.position_at_end(store)
        row = b.mul(m.const(o), p)
        for t in range(r):
            lane = b.extract_element(totals[vectors * t + o // vector], m.ir.Constant(m.i32, o % vector))
            b.store(lane, b.gep(y, [b.add(row, m.const(t))]))
        b.branch(after)
        b.position_at_end(after)
    b.ret_void()
    return fn


def _forward(m):
    """forward(x, w, bias, y, koff, images, K, blocks, outputs, oh, ow,
    x image stride, x row stride, sh, sw, y image stride): the tiles of every
    image, block of outputs and output row, each tile's totals in
    registers (for short reductions: see :data:`BANDED_REDUCTION`)."""
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


def _run_tile(m, r):
    """tile(x, w, totals, koff, first, count, poff): totals[t*out_block +
    o] += the sum from zero of the ``count`` terms k = first ..
    first+count-1 of w[k*out_block + o] * x[koff[k] + poff[t]], for the r
    pixels t (one run of at most REDUCTION_BLOCK terms: see
    :data:`REDUCTION_BLOCK`)."""
    fn, b = m.function("run%d" % r, [m.fp] * 3 + [m.ip] + [m.i64] * 2 + [m.ip], internal=True)
    x, w, totals, koff, first, count, poff = fn.args
    pixel = [b.load(b.gep(poff, [m.const(t)])) for t in range(r)]
    vector, vectors, out_block = m.tile.vector, m.tile.vectors, m.tile.out_block

    def step(i, sums):
        k = b.add(first, i)
        xk = b.gep(x, [b.load(b.gep(koff, [k]))])
        wk = b.mul(k, m.const(out_block))
        weights = [m.vector_at(b, w, b.add(wk, m.const(v * vector))) for v in range(vectors)]
        return _products(m, b, weights, lambda t: b.load(b.gep(xk, [pixel[t]])), sums)
    sums = m.counted(b, count, step, [m.zero] * (vectors * r))
    for t in range(r):
        for v in range(vectors):
            m.add_to(b, totals, m.const(t * out_block + v * vector), sums[vectors * t + v])
    b.ret_void()
    return fn


def _zero_totals(m, b, totals, pixels):
    """totals[0 : pixels*out_block] = 0."""
    m.counted(b, pixels, lambda q, _: [m.store_vector(b, m.zero, totals, b.add(
        b.mul(q, m.const(m.tile.out_block)), m.const(v * m.tile.vector))) for v in range(m.tile.vectors)])


def _store_totals(m, b, totals, bias, y, pixels, p, valid, qoff):
    """y[o*p + qoff[q]] = totals[q*out_block + o] + bias[o] for the
    ``pixels`` pixels q and the outputs o < ``valid`` (at most
    out_block)."""
    out_block = m.const(m.tile.out_block)

    def output(o, _):
        yo, bo = b.gep(y, [b.mul(o, p)]), b.load(b.gep(bias, [o]))
        m.counted(b, pixels, lambda q, _: b.store(
            b.fadd(b.load(b.gep(totals, [b.add(b.mul(q, out_block), o)])), bo),
            b.gep(yo, [b.load(b.gep(qoff, [q]))])))
    m.counted(b, m.smaller(b, valid, out_block), output)


def _run_pixels(m, b, tiles, x, w, totals, koff, k_first, k_len, pixels, poff):
    """The terms k_first .. k_first+k_len of ``pixels`` output pixels
    (pixel q's inputs at x[koff[k] + poff[q]]) added to their totals (from
    ``totals`` on, q by q), in runs of REDUCTION_BLOCK terms, each run over
    all the pixels before the next: its weights stay in the fast caches,
    and tiles run across rows (no short tile at each row's end)."""
    block = m.const(REDUCTION_BLOCK)
    out_block = m.const(m.tile.out_block)

    def run(j, _):
        first = b.mul(j, block)
        count = m.smaller(b, b.sub(k_len, first), block)
        m.tiled(b, pixels, tiles, lambda tile, q: b.call(tile, [
            x, w, b.gep(totals, [b.mul(q, out_block)]), koff, b.add(k_first, first), count, b.gep(poff, [q])]))
    m.counted(b, b.sdiv(b.add(k_len, m.const(REDUCTION_BLOCK - 1)), block), run)


def _weight_gradient_tile(m, r):
    """tile(x, dy, dw, totals, koff, oh, ow, x_row, sh, sw, opad, rows), for
    the oh output rows of a band and the r taps k with input offsets
    koff[0:r]:
    dw[k*out_block + o] += the sum over output pixels (oy, ox) of
    dy[(oy*ow + ox)*opad + o] * x[koff[k] + oy*sh*x_row + ox*sw], for the
    out_block outputs o.  Summed from zero over runs of ``rows`` output
    rows, each run's sums added to the band's ``totals`` (r*out_block
    floats), and those to dw: three levels, more accurate than the GEMM
    path (see :data:`REDUCTION_BLOCK`)."""
    fn, b = m.function("weight_gradient%d" % r, [m.fp] * 4 + [m.ip] + [m.i64] * 7, internal=True)
    x, dy, dw, totals, koff, oh, ow, x_row, sh, sw, opad, rows = fn.args
    vector = m.tile.vector
    offsets = [b.load(b.gep(koff, [m.const(t)])) for t in range(r)]
    for i in range(2 * r):
        m.store_vector(b, m.zero, totals, m.const(i * vector))

    def run(j, _):
        first = b.mul(j, rows)

        def row(i, sums):
            oy = b.add(first, i)
            xr = b.gep(x, [b.mul(b.mul(oy, sh), x_row)])
            dr = b.gep(dy, [b.mul(b.mul(oy, ow), opad)])

            def pixel(ox, sums):
                at = b.mul(ox, opad)
                d = [m.vector_at(b, dr, b.add(at, m.const(v * vector))) for v in range(2)]
                xp = b.gep(xr, [b.mul(ox, sw)])
                return _products(m, b, d, lambda t: b.load(b.gep(xp, [offsets[t]])), sums)
            return m.counted(b, ow, pixel, sums)
        sums = m.counted(b, m.smaller(b, b.sub(oh, first), rows), row, [m.zero] * (2 * r))
        for i, s in enumerate(sums):
            m.add_to(b, totals, m.const(i * vector), s)
    m.counted(b, b.sdiv(b.add(oh, b.sub(rows, m.const(1))), rows), run)
    for i in range(2 * r):
        at = m.const(i * vector)
        m.add_to(b, dw, at, m.vector_at(b, totals, at))
    b.ret_void()
    return fn


def _weight_gradient(m):
    """weight_gradient(x, dy, dw, totals, koff, bands, K, k_first, k_count,
    block, oh, ow, x image stride, x row stride, sh, sw, opad, rows,
    band_rows, first band): the taps k_first .. k_first+k_count of one
    block of outputs, each summed over ``bands`` bands of ``band_rows``
    output rows in order, from the ``first band``th of the batch on (x and
    dy point at the batch's first image).  A band is a tile call."""
    tiles = {r: _weight_gradient_tile(m, r) for r in range(1, m.tile.pixels + 1)}
    fn, b = m.function("weight_gradient", [m.fp] * 4 + [m.ip] + [m.i64] * 15)
    (x, dy, dw, totals, koff, bands, k_len, k_first, k_count, block, oh, ow, x_image, x_row, sh, sw, opad,
     rows, band_rows, first_band) = fn.args
    out_block = m.const(m.tile.out_block)
    dyb = b.gep(dy, [b.mul(block, out_block)])
    dwb = b.gep(dw, [b.mul(b.mul(block, k_len), out_block)])
    dy_image = b.mul(b.mul(oh, ow), opad)
    per_image = b.sdiv(b.add(oh, b.sub(band_rows, m.const(1))), band_rows)

    def taps(tile, start):
        k = b.add(k_first, start)
        dwk, koffk = b.gep(dwb, [b.mul(k, out_block)]), b.gep(koff, [k])

        def band(i, _):
            at = b.add(first_band, i)
            n, oy = b.sdiv(at, per_image), b.mul(b.srem(at, per_image), band_rows)
            xn = b.gep(x, [b.add(b.mul(n, x_image), b.mul(b.mul(oy, sh), x_row))])
            dyn = b.gep(dyb, [b.add(b.mul(n, dy_image), b.mul(b.mul(oy, ow), opad))])
            b.call(tile, [xn, dyn, dwk, totals, koffk, m.smaller(b, b.sub(oh, oy), band_rows), ow, x_row, sh, sw,
                          opad, rows])
        m.counted(b, bands, band)
    m.tiled(b, k_count, tiles, taps)
    b.ret_void()


def _banded(m):
    """banded(x, w, bias, y, koff, totals, poff, qoff, bands, band count, K,
    blocks, outputs, plane): for each block of outputs and band, the band's
    pixels summed in ``totals`` over its terms in runs (:func:`_run_pixels`)
    and stored with the bias.  A band (first pixel, pixels, first term,
    terms) is any pixels, of any rows and images, that sum the same terms;
    pixel q reads x from poff[q] on and writes y at qoff[q] (+ o*plane).
    The forward's bands sum every term; the data gradient's the kernel rows
    that reach their dx rows (its terms ordered (kernel row, output, kernel
    column), so they are one run)."""
    tiles = {r: _run_tile(m, r) for r in range(1, m.tile.pixels + 1)}
    fn, b = m.function("banded", [m.fp] * 4 + [m.ip] + [m.fp] + [m.ip] * 3 + [m.i64] * 5)
    x, w, bias, y, koff, totals, poff, qoff, bands, band_count, k_len, blocks, outputs, plane = fn.args
    out_block = m.const(m.tile.out_block)

    def block(ob, _):
        first = b.mul(ob, out_block)
        wb, bb, yb, valid = (b.gep(w, [b.mul(first, k_len)]), b.gep(bias, [first]), b.gep(y, [b.mul(first, plane)]),
                             b.sub(outputs, first))

        def band(i, _):
            start, pixels, k_first, terms = (b.load(b.gep(bands, [b.add(b.mul(i, m.const(4)), m.const(f))]))
                                             for f in range(4))
            _zero_totals(m, b, totals, pixels)
            _run_pixels(m, b, tiles, x, wb, totals, koff, k_first, terms, pixels, b.gep(poff, [start]))
            _store_totals(m, b, totals, bb, yb, pixels, plane, valid, b.gep(qoff, [start]))
        m.counted(b, band_count, band)
    m.counted(b, blocks, block)
    b.ret_void()


def pixel_tile():
    """:class:`PixelWeightGradient`'s tile here, ``pixels`` being taps:
    16-float vectors where the CPU has AVX-512F, else 8-float ones."""
    return Tile(16, 6) if llvm.has_avx512() else Tile(8, 6)


def pixel_outputs(tile):
    """Outputs a tile of :class:`PixelWeightGradient` takes: 4 with
    16-float vectors (4 x 6 sums, 4 dy vectors and an input vector in 32
    registers), 2 with 8-float ones (16 registers)."""
    return 4 if tile.vector == 16 else 2


def _pixel_weight_gradient_tile(m, ro, rt):
    """tile(u, dy, totals, toff, vectors, p, row): for ro outputs a (dy rows
    a*p on) and rt taps t (input rows toff[t] on), totals[a*row + t*lanes
    + lane] += the sum over the image's ``vectors`` vectors of pixels of dy
    * u, lane by lane, summed from zero over the image."""
    fn, b = m.function("pixel_weight_gradient%d_%d" % (ro, rt), [m.fp] * 3 + [m.ip] + [m.i64] * 3, internal=True)
    u, dy, totals, toff, vectors, p, row = fn.args
    lanes = m.tile.vector
    rows = [b.gep(u, [b.load(b.gep(toff, [m.const(t)]))]) for t in range(rt)]
    outputs = [b.gep(dy, [b.mul(m.const(a), p)]) for a in range(ro)]

    def step(v, sums):
        q = b.mul(v, m.const(lanes))
        d = [m.vector_at(b, out, q) for out in outputs]
        updated = list(sums)
        for t, start in enumerate(rows):
            x = m.vector_at(b, start, q)
            for a in range(ro):
                updated[a * rt + t] = b.call(m.fma, [d[a], x, sums[a * rt + t]])
        return updated
    sums = m.counted(b, vectors, step, [m.zero] * (ro * rt))
    for a in range(ro):
        for t in range(rt):
            m.add_to(b, totals, b.add(b.mul(m.const(a), row), m.const(t * lanes)), sums[a * rt + t])
    b.ret_void()
    return fn


def _pixel_weight_gradient(m):
    """pixel_weight_gradient(u, dy, totals, toff, images, p, K, u image,
    dy image, o_first, o_count, t_first, t_count): for each image, every
    tile of the outputs o_first .. o_first+o_count by the taps t_first ..
    t_first+t_count; totals (O, K, lanes)."""
    rt_max, ro_max = m.tile.pixels, pixel_outputs(m.tile)
    tiles = {ro: {rt: _pixel_weight_gradient_tile(m, ro, rt) for rt in range(1, rt_max + 1)}
             for ro in range(1, ro_max + 1)}
    fn, b = m.function("pixel_weight_gradient", [m.fp] * 3 + [m.ip] + [m.i64] * 9)
    u, dy, totals, toff, images, p, k_len, u_image, dy_image, o_first, o_count, t_first, t_count = fn.args
    lanes = m.const(m.tile.vector)
    row = b.mul(k_len, lanes)
    vectors = b.sdiv(p, lanes)

    def image(n, _):
        un, dyn = b.gep(u, [b.mul(n, u_image)]), b.gep(dy, [b.mul(n, dy_image)])

        def outputs(by_taps, o_start):
            o = b.add(o_first, o_start)
            dyo, totals_o = b.gep(dyn, [b.mul(o, p)]), b.gep(totals, [b.mul(o, row)])
            m.tiled(b, t_count, by_taps, lambda tile, t_start: b.call(tile, [
                un, dyo, b.gep(totals_o, [b.mul(b.add(t_first, t_start), lanes)]),
                b.gep(toff, [b.add(t_first, t_start)]), vectors, p, row]))
        m.tiled(b, o_count, tiles, outputs)
    m.counted(b, images, image)
    b.ret_void()


#: the signatures of the kernels, by name, and the functions that write them
_KERNELS = {"forward": ([_P] * 5 + [_I] * 11, _forward),
            "banded": ([_P] * 9 + [_I] * 5, _banded),
            "weight_gradient": ([_P] * 5 + [_I] * 15, _weight_gradient),
            "pixel_weight_gradient": ([_P] * 4 + [_I] * 9, _pixel_weight_gradient)}


def tile_for(og, banded=True):
    """The tile for ``og`` outputs a group here: where the CPU has AVX-512F,
    :data:`AVX512_WIDE_TILE` where they fill its blocks of 64 and the
    kernel is ``banded`` (its totals in memory: in registers they would not
    fit beside its sums), else
    :data:`AVX512_TILE` for at least 32 (its blocks of 32 pad less; 16-float
    vectors even where padded: 208 outputs ran 1.6 times as fast as by
    8-float ones); else :data:`AVX2_TILE` (blocks of 16)."""
    if llvm.has_avx512() and banded and og % AVX512_WIDE_TILE.out_block == 0:
        return AVX512_WIDE_TILE
    return AVX512_TILE if llvm.has_avx512() and og >= AVX512_TILE.out_block else AVX2_TILE


@functools.lru_cache(maxsize=None)
def compiled_for(tile, kernel="forward"):
    """The ``kernel`` (a key of ``_KERNELS``) of ``tile``
    compiled for this CPU as a ctypes function, or None where it does not
    run here (any tile compiles on an AVX2 CPU: LLVM splits wider
    vectors)."""
    arguments, write = _KERNELS[kernel]
    m = _Builder(tile)
    write(m)
    functions = llvm.compile_functions(str(m.module), ("avx2", "fma"), {kernel: arguments})
    return functions and functions[kernel]


def available():
    """Whether the direct kernel runs here and is allowed
    (``CAFFEMPI_DIRECT_CONV``, default on)."""
    return bool(config.settings.direct_conv) and compiled_for(AVX2_TILE) is not None


# Where the direct kernel beats the GEMM kernels (:func:`suits`): a
# reduction of at least _MIN_REDUCTION (in shorter ones its tiles' stores
# weigh), whole blocks of outputs a group, and one of: at most _FEW_OUTPUTS
# outputs a group (the GEMMs' weakest shapes, at any reduction); a window
# over more than one pixel and a reduction the kernel runs banded; a
# reduction of at most _MAX_REDUCTION with at most _MAX_OUTPUTS outputs
# a group or a stride over 1 (docs/design/cpu.md, "Where the direct kernel
# is used" and "Banded").
_MIN_REDUCTION = 64
_MAX_REDUCTION = 1536
_MAX_OUTPUTS = 64
_FEW_OUTPUTS = 32


# Where the direct weight gradient beats the GEMM kernels
# (:func:`suits_weight_gradient`).
_TINY_PLANE = 64
_SMALL_PLANE = 256
_LONG_TAPS = 1536


def suits(cg, og, geom):
    """Whether a convolution of ``cg`` input and ``og`` output channels per
    group and window ``geom`` runs faster by the direct kernel than by the
    GEMM kernels here (see the bounds above)."""
    kh, kw, sh, sw = geom[:4]
    k = cg * kh * kw
    return (k >= _MIN_REDUCTION and og % AVX2_TILE.out_block == 0
            and (og <= _FEW_OUTPUTS or (kh * kw > 1 and k >= BANDED_REDUCTION)
                 or (k <= _MAX_REDUCTION and (og <= _MAX_OUTPUTS or sh > 1 or sw > 1))))


@functools.lru_cache(maxsize=64)
def _offsets(cg, kh, kw, hp, wp, dh, dw):
    """The reduction's input offsets in (channel, kernel row, kernel column)
    order, relative to a window's first input."""
    c, i, j = np.meshgrid(np.arange(cg), np.arange(kh) * dh * wp, np.arange(kw) * dw, indexing="ij")
    offsets = (c * hp * wp + i + j).astype(np.int64).ravel()
    offsets.flags.writeable = False
    return offsets


def aligned_empty(shape):
    """An uninitialised float32 array of ``shape`` starting at a multiple of
    64 bytes: the tiles' vectors then never straddle two cache lines (NumPy
    aligns to 16)."""
    count = int(np.prod(shape))
    raw = np.empty(count + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + count].reshape(shape)


def _in_blocks(w, out_block):
    """Weights (groups, outputs, *term axes), any strides, as the tiles read
    them: (groups, blocks of out_block outputs, K, out_block), K the term
    axes flattened in order, zero past the outputs; aligned, and written
    in one strided copy (the reorder is paid at every call)."""
    g, o, terms = w.shape[0], w.shape[1], w.shape[2:]
    k = int(np.prod(terms))
    blocks, full = -(-o // out_block), o // out_block
    out = aligned_empty((g, blocks) + terms + (out_block,))
    last = len(terms) + 2
    order = (0, 1) + tuple(range(3, last + 1)) + (2,)
    np.copyto(out[:, :full], w[:, :full * out_block].reshape((g, full, out_block) + terms).transpose(order))
    if full < blocks:
        rest = o - full * out_block
        np.copyto(out[:, full, ..., :rest], np.moveaxis(w[:, full * out_block:], 1, -1))
        out[:, full, ..., rest:] = 0
    return out.reshape(g, blocks, k, out_block)


def forward(xpad, w, geom, group, y, bias=None, tile=None, banded=None):
    """A function run(a, m) that writes y[a:a+m] (images, C-contiguous
    (N, O, oh, ow) float32) = the convolution of xpad[a:a+m] (C-contiguous
    float32, already padded) with ``w`` (O, C/group, kh, kw), plus ``bias``
    (O,) if given, by the kernel of ``tile`` (default: :func:`tile_for`
    the outputs a group), ``banded`` (default: for reductions of at least
    :data:`BANDED_REDUCTION` terms) or with each tile's totals in
    registers; the same bits either way.  Call only where
    :func:`available`."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    _, c, hp, wp = xpad.shape
    _, o, oh, ow = y.shape
    g = group
    cg, og = c // g, o // g
    k = cg * kh * kw
    banded = k >= BANDED_REDUCTION if banded is None else banded
    tile = tile or tile_for(og, banded)
    out_block = tile.out_block
    wr = _in_blocks(w.reshape(g, og, k), out_block)
    blocks = wr.shape[1]
    br = np.zeros((g, blocks * out_block), np.float32)
    if bias is not None:
        br[:, :og] = bias.reshape(g, og)
    koff = _offsets(cg, kh, kw, hp, wp, dh, dw)
    x_image, y_image = c * hp * wp, o * oh * ow
    item = xpad.itemsize

    def at(a, gi):
        """The first input, the weights, the bias and the first output of
        images a on, group gi."""
        return (xpad.ctypes.data + item * (a * x_image + gi * cg * hp * wp), wr[gi].ctypes.data, br[gi].ctypes.data,
                y.ctypes.data + item * (a * y_image + gi * og * oh * ow), koff.ctypes.data)
    if not banded:
        kernel = compiled_for(tile)

        def run(a, m):
            for gi in range(g):
                kernel(*at(a, gi), m, k, blocks, og, oh, ow, x_image, wp, sh, sw, y_image)
        return run
    kernel = compiled_for(tile, "banded")
    pixels = band_pixels(tile)

    def banded_run(a, m):
        poff, qoff, bands = _forward_tables(m, oh, ow, x_image, wp, sh, sw, y_image, k, pixels)
        totals = aligned_empty(pixels * out_block)
        for gi in range(g):
            kernel(*at(a, gi), totals.ctypes.data, poff.ctypes.data, qoff.ctypes.data, bands.ctypes.data,
                   len(bands), k, blocks, og, oh * ow)
    return banded_run


def weight_gradient_tile():
    """The weight gradient's tile here: :data:`AVX512_TAPS_TILE` where the
    CPU has AVX-512F (even where its blocks of 32 outputs pad more: the
    8-float tile ran 1.5-2 times slower), else :data:`AVX2_TILE`."""
    return AVX512_TAPS_TILE if llvm.has_avx512() else AVX2_TILE


class WeightGradient:
    """The weight gradient of a convolution by the compiled kernel, in
    pieces for the intra-op threads: :meth:`copy_dy` for runs of images
    first, then for each of :meth:`items` (ranges of taps: group, block of
    outputs, first tap, taps) :meth:`run` over runs of bands (its
    :attr:`units`) in order and :meth:`finish`; :meth:`result` gives dw.  Each entry of dw sums its
    bands in order, one at a time, so the bits do not depend on the items,
    the runs or the threads.

    dy is copied with each pixel's outputs contiguous and zero-filled to
    whole blocks: the kernel's vectors run along the outputs."""

    def __init__(self, xpad, dy, geom, group, w_shape, tile=None):
        o, cg, kh, kw = w_shape
        n, c, hp, wp = xpad.shape
        _, _, oh, ow = dy.shape
        self.group, self.og, self.k = group, o // group, cg * kh * kw
        self.tile = tile or weight_gradient_tile()
        self.blocks = -(-self.og // self.tile.out_block)
        opad = self.blocks * self.tile.out_block
        self.xpad, self.dy_given, self.w_shape = xpad, dy, w_shape
        self.dy = np.empty((group, n, oh * ow, opad), np.float32)
        self.dw = np.zeros((group, self.blocks, self.k, self.tile.out_block), np.float32)
        self.out = np.empty((o, self.k), np.float32)
        self.koff = _offsets(cg, kh, kw, hp, wp, geom[6], geom[7])
        self.kernel = compiled_for(self.tile, "weight_gradient")
        # bands from the outputs, not the tile's padded blocks: the same
        # bands, so the same bits, with either tile
        row_bytes = 4 * (c * geom[2] * wp + ow * self.og)
        band_rows = max(1, min(oh, BAND_BYTES // row_bytes))
        #: the units :meth:`run` takes, bands (rows of an image, in image
        #: order), and the bytes of input and dy each reads
        self.units = n * -(-oh // band_rows)
        self.unit_bytes = band_rows * row_bytes
        self.sizes = (oh, ow, c * hp * wp, wp, geom[2], geom[3], opad, max(1, REDUCTION_BLOCK // ow), band_rows)

    def copy_dy(self, a, m):
        """Copies images a .. a+m-1 of dy into the kernel's layout."""
        g, og = self.group, self.og
        part = self.dy[:, a:a + m]
        given = self.dy_given[a:a + m]
        np.copyto(part[..., :og], given.reshape(m, g, og, -1).transpose(1, 0, 3, 2))
        part[..., og:] = 0

    def items(self, parts):
        """(group, block, first tap, taps): each group's and block's taps
        in ranges of whole tiles, at least ``parts`` items (the threads) and
        a multiple of them where the tiles allow, so no thread idles."""
        tiles = -(-self.k // self.tile.pixels)
        pieces = self.group * self.blocks
        ranges = next((r for r in range(-(-parts // pieces), tiles + 1) if r * pieces % parts == 0),
                      min(tiles, -(-parts // pieces)))
        per = -(-tiles // ranges) * self.tile.pixels
        return [(g, b, k, min(per, self.k - k)) for g in range(self.group) for b in range(self.blocks)
                for k in range(0, self.k, per)]

    def run(self, item, a, m):
        """Adds bands a .. a+m-1's sums to the taps of ``item``."""
        g, block, k_first, k_count = item
        cg, hp, wp = self.w_shape[1], self.xpad.shape[2], self.xpad.shape[3]
        totals = np.empty(self.tile.pixels * self.tile.out_block, np.float32)
        x = self.xpad.ctypes.data + self.xpad.itemsize * g * cg * hp * wp
        self.kernel(x, self.dy[g].ctypes.data, self.dw[g].ctypes.data, totals.ctypes.data,
                    self.koff.ctypes.data, m, self.k, k_first, k_count, block, *self.sizes, a)

    def finish(self, item):
        """Writes ``item``'s sums, over every band, to :meth:`result`."""
        g, block, k_first, k_count = item
        first = block * self.tile.out_block
        valid = min(self.tile.out_block, self.og - first)
        rows = self.out[g * self.og + first:g * self.og + first + valid]
        np.copyto(rows[:, k_first:k_first + k_count], self.dw[g, block, k_first:k_first + k_count, :valid].T)

    def result(self):
        """dw (O, C/group, kh, kw)."""
        return self.out.reshape(self.w_shape)


def suits_weight_gradient(cg, og, geom, p):
    """Whether the weight gradient of a convolution of ``cg`` input and
    ``og`` output channels a group, window ``geom`` and ``p`` output pixels
    an image runs faster by the direct kernel than by the GEMM kernels
    here: a window over one pixel (strided 1x1 convolutions read their
    input sparsely), and at most :data:`_FEW_OUTPUTS` outputs a group, at
    most :data:`_TINY_PLANE` output pixels, or a reduction of at least
    :data:`_LONG_TAPS` over at most :data:`_SMALL_PLANE` pixels
    (docs/design/cpu.md, "The weight gradient")."""
    taps = cg * geom[0] * geom[1]
    return (geom[0] * geom[1] > 1
            and (og <= _FEW_OUTPUTS or p <= _TINY_PLANE or (p <= _SMALL_PLANE and taps >= _LONG_TAPS)))


def band_pixels(tile):
    """Pixels a band of the banded kernel: its totals, BAND_TOTALS floats."""
    return BAND_TOTALS // tile.out_block


def _tables(groups, pixels):
    """(poff, qoff, bands) of the banded kernel from ``groups``, each (input
    offsets, output offsets, first term, terms) of pixels that sum the same
    terms: each group cut in bands of at most ``pixels`` pixels; read-only
    (cached by the callers)."""
    bands, at = [], 0
    for poff, _, first, terms in groups:
        bands += [(at + start, min(pixels, poff.size - start), first, terms) for start in range(0, poff.size, pixels)]
        at += poff.size
    tables = tuple(np.ascontiguousarray(np.concatenate([g[f].ravel() for g in groups]), np.int64)
                   for f in (0, 1)) + (np.array(bands, np.int64),)
    for t in tables:
        t.flags.writeable = False
    return tables


@functools.lru_cache(maxsize=64)
def _forward_tables(images, oh, ow, x_image, x_row, sh, sw, y_image, k, pixels):
    """The forward's tables for runs of ``images`` images: every output
    pixel, image by image, row by row, sums all ``k`` terms."""
    n, oy, ox = np.meshgrid(np.arange(images), np.arange(oh), np.arange(ow), indexing="ij")
    return _tables([(n * x_image + oy * sh * x_row + ox * sw, n * y_image + oy * ow + ox, 0, k)], pixels)


@functools.lru_cache(maxsize=64)
def _data_gradient_tables(images, kh, ph, dy_image, oh, row, dx_image, h, wd, row_terms, pixels):
    """:class:`DataGradient`'s tables for runs of ``images`` images: dx's
    pixels grouped by the kernel rows that reach their row (pixels of
    every image and row alike together, image by image, row by row)."""
    reach = {}
    for yy in range(h):
        reach.setdefault((max(0, yy + ph - (oh - 1)), min(kh - 1, yy + ph)), []).append(yy)
    groups = []
    for (first, last), rows in reach.items():
        n, yy, x = np.meshgrid(np.arange(images), np.array(rows), np.arange(wd), indexing="ij")
        groups.append((n * dy_image + (yy + ph) * row + x, n * dx_image + yy * wd + x, first * row_terms,
                       max(0, last - first + 1) * row_terms))
    return _tables(groups, pixels)


class DataGradient:
    """dx of a stride-1, undilated convolution by the banded forward's
    tiles (:func:`tile_for` the channels): the
    convolution of dy with the weights flipped (input and output channels
    swapped), where each row of dx sums only the kernel rows that reach it
    (no zero rows above or below dy, which the flipped convolution of
    :mod:`caffempi.backend.cpu.conv` pays for) and dy's columns sit between
    zeros; dx's rows in bands that the same kernel rows reach.  :meth:`run`
    for runs of images (on the intra-op threads), then :meth:`result`; each
    entry is summed in one order whatever the runs.

    Layouts: dy copied per image, output and row between ``kw - 1`` zero
    columns before and enough after; the weights as (group, blocks of
    out_block channels, kh * O/group * kw terms, out_block), zero past
    C/group."""

    def __init__(self, dy, w, geom, group, x_shape, tile=None):
        o, cg, kh, kw = w.shape
        n, c, h, wd = x_shape
        _, _, oh, ow = dy.shape
        self.tile = tile or tile_for(cg)
        out_block = self.tile.out_block
        self.group, self.og, self.cg = group, o // group, cg
        self.blocks = -(-cg // out_block)
        self.geom, self.x_shape, self.dy_given, self.w_shape = geom, x_shape, dy, w.shape
        self.before = kw - 1
        row = self.before + max(ow, wd + geom[5])
        self.dy = np.zeros((n, o, oh, row), np.float32)
        # the channels are the tiles' outputs; terms (kernel row, output,
        # kernel column)
        self.w = _in_blocks(w.reshape(group, self.og, cg, kh, kw).transpose(0, 2, 3, 1, 4), out_block)
        i, o_, j = np.meshgrid(np.arange(kh), np.arange(self.og), np.arange(kw), indexing="ij")
        self.koff = np.ascontiguousarray((o_ * oh * row - i * row - j).ravel(), np.int64)
        self.zeros = np.zeros(self.blocks * out_block, np.float32)     # the bias: none
        self.dx = np.empty(x_shape, np.float32)
        self.kernel = compiled_for(self.tile, "banded")

    def run(self, a, m):
        """dx of images a .. a+m-1 (into :meth:`result`'s array)."""
        pw = self.geom[5]
        n, c, h, wd = self.x_shape
        _, o, oh, row = self.dy.shape
        ow = self.dy_given.shape[3]
        self.dy[a:a + m, :, :, self.before:self.before + ow] = self.dy_given[a:a + m]
        kh, ph = self.geom[0], self.geom[4]
        pixels = band_pixels(self.tile)
        poff, qoff, bands = _data_gradient_tables(m, kh, ph, o * oh * row, oh, row, c * h * wd, h, wd,
                                                  self.og * self.w_shape[3], pixels)
        totals = aligned_empty(pixels * self.tile.out_block)
        for g in range(self.group):
            dy = self.dy.ctypes.data + 4 * (a * o * oh * row + g * self.og * oh * row + self.before + pw)
            dx = self.dx.ctypes.data + 4 * (a * c * h * wd + g * self.cg * h * wd)
            self.kernel(dy, self.w[g].ctypes.data, self.zeros.ctypes.data, dx, self.koff.ctypes.data,
                        totals.ctypes.data, poff.ctypes.data, qoff.ctypes.data, bands.ctypes.data, len(bands),
                        self.w.shape[2], self.blocks, self.cg, h * wd)

    def result(self):
        """dx (N, C, H, W)."""
        return self.dx


def suits_data_gradient(cg, geom, plane):
    """Whether the data gradient of a convolution of ``cg`` input channels
    a group, window ``geom`` and input planes of ``plane`` pixels runs
    faster by the direct kernel (:class:`DataGradient`) than by the other
    algorithms here: stride 1, no dilation, a window over more than one
    pixel, at least :data:`_FEW_OUTPUTS` channels a group (its blocks of
    outputs are the channels), and planes of at most :data:`_SMALL_PLANE`
    pixels, where the flipped convolution's zero rows weigh, or channels
    in whole blocks of 32, where larger planes run in bands of rows as fast
    (docs/design/cpu.md, "The data gradient")."""
    return (geom[2] == geom[3] == geom[6] == geom[7] == 1 and geom[0] * geom[1] > 1
            and cg >= _FEW_OUTPUTS and (plane <= _SMALL_PLANE or cg % AVX512_TILE.out_block == 0))


class PixelWeightGradient:
    """The weight gradient of a convolution of few input channels (one
    group) at vertical stride 1, vectors along the output pixels: over the
    input unfolded along the kernel width, u[n, c, j, h, x] = xpad[n, c, h,
    x*sw + j*dw] (rows of ow), tap (c, i, j) reads rows i*dh .. i*dh+oh of
    u[n, c, j] as one contiguous run of oh*ow values beside dy's plane.  No
    copy of dy; a tile is outputs by 6 taps, lane-wise sums from zero over
    an image, added to lane totals (O, K, lanes), summed across the lanes
    at the end.  For each of :meth:`items` :meth:`run` over runs of images
    in order, then :meth:`result`; each total sums its images in order, so
    the bits do not depend on the items, the runs or the threads."""

    def __init__(self, u, dy, geom, w_shape, tile=None):
        o, c, kh, kw = w_shape
        n, _, _, hp, ow = u.shape
        self.tile = tile or pixel_tile()
        self.u, self.dy, self.w_shape = u, np.ascontiguousarray(dy), w_shape
        self.p, self.k = dy.shape[2] * ow, c * kh * kw
        #: the units :meth:`run` takes, images, and the bytes each reads
        self.units, self.unit_bytes = n, u[0].nbytes + self.dy[0].nbytes
        self.totals = np.zeros((o, self.k, self.tile.vector), np.float32)
        c_, i, j = np.meshgrid(np.arange(c), np.arange(kh), np.arange(kw), indexing="ij")
        self.toff = np.ascontiguousarray(((c_ * kw + j) * hp + i * geom[6]) * ow, np.int64).ravel()
        self.kernel = compiled_for(self.tile, "pixel_weight_gradient")

    def items(self, parts):
        """(first output, outputs, first tap, taps): the outputs in up to
        ``parts`` ranges of whole tiles (the taps whole), or the taps where
        the outputs make fewer tiles than ``parts``."""
        o = self.w_shape[0]
        per_tile = pixel_outputs(self.tile)
        tiles = -(-o // per_tile)
        if tiles >= parts:
            per = -(-tiles // parts) * per_tile
            return [(f, min(per, o - f), 0, self.k) for f in range(0, o, per)]
        taps = -(-self.k // self.tile.pixels)
        per = -(-taps // max(1, parts // tiles)) * self.tile.pixels
        return [(f, min(per_tile, o - f), t, min(per, self.k - t)) for f in range(0, o, per_tile)
                for t in range(0, self.k, per)]

    def run(self, item, a, m):
        """Adds images a .. a+m-1 to the totals of ``item``."""
        o_first, o_count, t_first, t_count = item
        u_image, dy_image = self.u[0].size, self.dy[0].size
        self.kernel(self.u.ctypes.data + 4 * a * u_image, self.dy.ctypes.data + 4 * a * dy_image,
                    self.totals.ctypes.data, self.toff.ctypes.data, m, self.p, self.k, u_image, dy_image,
                    o_first, o_count, t_first, t_count)

    def finish(self, item):
        """Nothing: :meth:`result` sums every item's lanes."""

    def result(self):
        """dw (O, C, kh, kw)."""
        return self.totals.sum(axis=2).reshape(self.w_shape)


def suits_pixel_weight_gradient(c, geom, p):
    """Whether the weight gradient of a convolution of ``c`` input channels
    (one group) runs faster by :class:`PixelWeightGradient` here."""
    return geom[2] == 1 and p % pixel_tile().vector == 0 and geom[0] * geom[1] > 1 and c <= 4
