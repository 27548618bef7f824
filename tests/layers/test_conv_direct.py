"""The compiled direct convolution (caffempi.backend.direct): values against
plain loops for every geometry it takes (forced, whatever :func:`suits`
says), the data gradient through it, the weight gradient's kernel,
independence from the tile and the thread count, the setting that turns it
off, the GIL released while it runs, and accuracy against the GEMM path."""
import numpy as np
import pytest

from caffempi.backend import cpu, direct, threads
from caffempi.backend.cpu import chunking
from caffempi.config import using_config
from caffempi.testing.gil import stall_shares
from .test_conv import ref_conv

pytestmark = pytest.mark.skipif(not direct.available(),
                                reason="the direct kernel needs x86-64 with AVX2 and FMA, and llvmlite")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(direct, "suits", lambda cg, og, geom: True)


@pytest.fixture
def forced_weight_gradient(monkeypatch):
    monkeypatch.setattr(direct, "suits_weight_gradient", lambda cg, og, geom, p: True)


@pytest.fixture
def forced_data_gradient(monkeypatch):
    monkeypatch.setattr(direct, "suits_data_gradient",
                        lambda cg, geom, plane: geom[2] == geom[3] == geom[6] == geom[7] == 1)


def rand(shape, seed):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


# (images, channels, h, w, outputs, kh, kw, stride, pad, dilation, group, bias):
# output widths below, at and past the 6-pixel tile, 1 to 3 blocks of 16
# outputs with and without a partial one, and two blocks of 64 (the wide
# tiles)
GEOMETRIES = [
    (2, 3, 9, 11, 16, 3, 3, (1, 1), (1, 1), (1, 1), 1, True),
    (3, 4, 8, 5, 20, 3, 3, (1, 1), (0, 0), (1, 1), 1, False),
    (2, 6, 13, 17, 34, 5, 3, (2, 1), (0, 2), (1, 2), 2, True),
    (1, 3, 23, 23, 48, 11, 11, (4, 4), (0, 0), (1, 1), 1, True),
    (2, 12, 7, 9, 9, 3, 3, (1, 3), (1, 0), (2, 1), 3, True),
    (5, 8, 6, 6, 33, 2, 2, (1, 1), (1, 1), (2, 2), 1, False),
    (2, 2, 4, 4, 7, 1, 1, (2, 2), (1, 1), (1, 1), 1, True),
    (2, 8, 7, 9, 128, 3, 3, (1, 1), (1, 1), (1, 1), 1, True),
]


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,stride,pad,dil,group,bias", GEOMETRIES)
def test_forward_matches_loops(forced, n, c, h, w, o, kh, kw, stride, pad, dil, group, bias):
    x = rand((n, c, h, w), 0)
    weights = rand((o, c // group, kh, kw), 1)
    b = rand((o,), 2) if bias else None
    geom = (kh, kw) + stride + pad + dil
    y = cpu.conv2d_forward(x, weights, geom, group, b)
    assert y.dtype == np.float32
    ref = ref_conv(x.astype(np.float64), weights.astype(np.float64), None if b is None else b.astype(np.float64),
                   stride, pad, dil, group)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_data_gradient_through_the_direct_forward_is_the_adjoint(forced):
    # stride 1 and padded: dx is the convolution of dy with the flipped weights
    x = rand((4, 16, 10, 10), 0)
    weights = rand((32, 16, 3, 3), 1)
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    dy = rand((4, 32, 10, 10), 2)
    gx, _ = cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)
    with using_config(direct_conv=False):
        gx_gemm, _ = cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)
    np.testing.assert_allclose(gx, gx_gemm, rtol=1e-4, atol=1e-4 * np.abs(gx_gemm).max())
    y = cpu.conv2d_forward(x, weights, geom, 1).astype(np.float64)
    assert np.isclose((y * dy).sum(), (x.astype(np.float64) * gx).sum(), rtol=1e-4)


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,stride,pad,dil,group,bias", GEOMETRIES[:4] + GEOMETRIES[-1:])
def test_avx2_and_avx512_tiles_give_the_same_bits(n, c, h, w, o, kh, kw, stride, pad, dil, group, bias):
    """Each output is summed in the same order whatever the tile (LLVM
    splits the 16-float vectors where the CPU has no AVX-512), two or four
    vectors of outputs, banded or with each tile's totals in registers."""
    x = rand((n, c, h + 2 * pad[0], w + 2 * pad[1]), 0)
    weights = rand((o, c // group, kh, kw), 1)
    b = rand((o,), 2) if bias else None
    geom = (kh, kw) + stride + (0, 0) + dil
    shape = (n, o, cpu.conv_out_size(x.shape[2], kh, stride[0], 0, dil[0]),
             cpu.conv_out_size(x.shape[3], kw, stride[1], 0, dil[1]))
    ys = []
    for tile in (direct.AVX2_TILE, direct.AVX512_TILE, direct.AVX512_WIDE_TILE):
        for banded in (False, True):
            y = np.empty(shape, np.float32)
            direct.forward(x, weights, geom, group, y, b, tile, banded)(0, n)
            ys.append(y)
    assert all(np.array_equal(ys[0], y) for y in ys[1:])


def loop_weight_gradient(x, dy, geom, group):
    """dw[o, c, i, j] = the sum over images and output pixels of dy times the
    input under tap (i, j), in float64, one tap at a time."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    n, c = x.shape[:2]
    o, oh, ow = dy.shape[1:]
    xpad = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    cg, og = c // group, o // group
    out = np.zeros((o, cg, kh, kw))
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                window = xpad[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                              j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out[g * og:(g + 1) * og, :, i, j] = np.einsum("noyx,ncyx->oc", dy[:, g * og:(g + 1) * og], window)
    return out


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,stride,pad,dil,group,bias", GEOMETRIES)
def test_weight_gradient_matches_loops(forced_weight_gradient, n, c, h, w, o, kh, kw, stride, pad, dil, group, bias):
    x = rand((n, c, h, w), 0)
    weights = rand((o, c // group, kh, kw), 1)
    geom = (kh, kw) + stride + pad + dil
    y = cpu.conv2d_forward(x, weights, geom, group)
    dy = rand(y.shape, 2)
    calls = []
    real = direct.WeightGradient.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct.WeightGradient, "run", lambda self, *a: calls.append(a) or real(self, *a))
        gx, gw = cpu.conv2d_backward(x, weights, dy, geom, group, need_dx=False)
    assert calls and gx is None and gw.dtype == np.float32 and gw.shape == weights.shape
    ref = loop_weight_gradient(x, dy, geom, group)
    np.testing.assert_allclose(gw, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# few input channels at vertical stride 1, output planes of whole vectors
# (16 and 8 lanes): pads, a horizontal stride and a dilation, outputs and
# taps past whole tiles
PIXEL_GEOMETRIES = [
    (3, 1, 12, 12, 20, 5, 5, (1, 1), (0, 0), (1, 1)),
    (2, 3, 16, 16, 7, 3, 3, (1, 1), (1, 1), (1, 1)),
    (2, 2, 10, 37, 9, 3, 5, (1, 2), (3, 1), (1, 2)),
    (4, 4, 20, 20, 33, 5, 5, (1, 1), (0, 2), (1, 1)),
]


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,stride,pad,dil", PIXEL_GEOMETRIES)
def test_pixel_weight_gradient_matches_loops(monkeypatch, n, c, h, w, o, kh, kw, stride, pad, dil):
    monkeypatch.setattr(direct, "suits_pixel_weight_gradient", lambda c, geom, p: True)
    x = rand((n, c, h, w), 0)
    weights = rand((o, c, kh, kw), 1)
    geom = (kh, kw) + stride + pad + dil
    dy = rand(cpu.conv2d_forward(x, weights, geom, 1).shape, 2)
    assert dy.shape[2] * dy.shape[3] % 16 == 0
    made = counting(monkeypatch, "PixelWeightGradient")
    gw = cpu.conv2d_backward(x, weights, dy, geom, 1, need_dx=False)[1]
    assert made and gw.dtype == np.float32
    ref = loop_weight_gradient(x, dy, geom, 1)
    np.testing.assert_allclose(gw, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_pixel_weight_gradient_same_bits_for_any_tile_thread_count_and_chunking(monkeypatch):
    """Each lane total sums its images in order whatever the items (outputs
    or taps on the threads) and the runs of images; the 8-lane tile sums
    other lanes, so it is compared with itself only."""
    monkeypatch.setattr(direct, "suits_pixel_weight_gradient", lambda c, geom, p: True)
    x, weights = rand((7, 3, 18, 18), 0), rand((10, 3, 3, 3), 1)
    geom = (3, 3, 1, 1, 0, 0, 1, 1)
    dy = rand((7, 10, 16, 16), 2)
    for tile in (direct.Tile(16, 6), direct.Tile(8, 6)):
        real = direct.PixelWeightGradient
        monkeypatch.setattr(direct, "PixelWeightGradient", lambda *a, tile=tile, real=real: real(*a, tile=tile))
        results = []
        for thread_count, chunk_bytes in ((1, 1 << 30), (2, 1), (3, 5000)):
            monkeypatch.setattr(chunking, "COL_CHUNK_BYTES", chunk_bytes)
            previous = threads.set_thread_count(thread_count)
            try:
                results.append(cpu.conv2d_backward(x, weights, dy, geom, 1, need_dx=False)[1])
            finally:
                threads.set_thread_count(previous)
        monkeypatch.setattr(direct, "PixelWeightGradient", real)
        assert all(np.array_equal(results[0], other) for other in results[1:]), tile


def _tiled_weight_gradient(x, weights, dy, geom, group, tile, thread_count, chunk_bytes, monkeypatch):
    monkeypatch.setattr(direct, "weight_gradient_tile", lambda: tile)
    monkeypatch.setattr(chunking, "COL_CHUNK_BYTES", chunk_bytes)
    previous = threads.set_thread_count(thread_count)
    try:
        return cpu.conv2d_backward(x, weights, dy, geom, group, need_dx=False)[1]
    finally:
        threads.set_thread_count(previous)


def test_weight_gradient_same_bits_for_any_tile_thread_count_and_chunking(forced_weight_gradient, monkeypatch):
    """Each entry sums its bands in order whatever the tile (its taps and
    blocks of outputs), the threads (which split the taps) and the runs of
    bands; bands of a few rows here, so an image is several."""
    x = rand((5, 12, 19, 19), 0)
    weights = rand((40, 6, 3, 5), 1)
    geom = (3, 5, 1, 2, 1, 2, 1, 1)
    dy = rand((5, 40, 19, 10), 2)
    monkeypatch.setattr(direct, "BAND_BYTES", 4 * (12 * 23 + 10 * 20) * 4)        # 4 rows a band
    one = _tiled_weight_gradient(x, weights, dy, geom, 2, direct.AVX2_TILE, 1, 1 << 30, monkeypatch)
    for tile, thread_count, chunk_bytes in ((direct.AVX512_TAPS_TILE, 1, 1 << 30), (direct.AVX512_TAPS_TILE, 2, 1),
                                            (direct.AVX2_TILE, 3, 20000), (direct.Tile(16, 3), 2, 50000)):
        other = _tiled_weight_gradient(x, weights, dy, geom, 2, tile, thread_count, chunk_bytes, monkeypatch)
        assert np.array_equal(one, other), (tile, thread_count, chunk_bytes)


# stride 1 and no dilation, as the direct data gradient takes: padding
# below, at and past the kernel's reach, even kernels, groups, channels
# past a block, rows shorter and longer than a tile
DATA_GRADIENT_GEOMETRIES = [
    (2, 3, 9, 11, 16, 3, 3, (1, 1), 1),
    (3, 4, 8, 5, 20, 3, 3, (0, 0), 1),
    (2, 6, 13, 17, 34, 3, 5, (1, 2), 2),
    (2, 40, 12, 12, 50, 5, 5, (0, 0), 1),
    (1, 13, 21, 37, 3, 4, 2, (2, 1), 1),
    (2, 34, 7, 7, 24, 3, 3, (3, 1), 1),
]


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,pad,group", DATA_GRADIENT_GEOMETRIES)
def test_data_gradient_matches_the_float64_gemm_path(forced_data_gradient, n, c, h, w, o, kh, kw, pad, group):
    x = rand((n, c, h, w), 0)
    weights = rand((o, c // group, kh, kw), 1)
    geom = (kh, kw, 1, 1) + pad + (1, 1)
    dy = rand(cpu.conv2d_forward(x, weights, geom, group).shape, 2)
    with pytest.MonkeyPatch.context() as patch:
        made = counting(patch, "DataGradient")
        gx, gw = cpu.conv2d_backward(x, weights, dy, geom, group, need_dw=False)
    assert made and gw is None and gx.dtype == np.float32 and gx.shape == x.shape
    ref, _ = cpu.conv2d_backward(x.astype(np.float64), weights.astype(np.float64), dy.astype(np.float64), geom,
                                 group, need_dw=False)
    np.testing.assert_allclose(gx, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_data_gradient_same_bits_for_any_tile_thread_count_and_chunking(forced_data_gradient, monkeypatch):
    x = rand((7, 40, 11, 13), 0)
    weights = rand((48, 20, 3, 5), 1)
    geom = (3, 5, 1, 1, 1, 2, 1, 1)
    dy = rand(cpu.conv2d_forward(x, weights, geom, 2).shape, 2)
    results = []
    for tile, thread_count, chunk_bytes in ((direct.AVX2_TILE, 1, 1 << 30), (direct.AVX512_TILE, 2, 1),
                                            (direct.AVX512_WIDE_TILE, 3, 30000)):
        monkeypatch.setattr(chunking, "COL_CHUNK_BYTES", chunk_bytes)
        previous = threads.set_thread_count(thread_count)
        try:
            with pytest.MonkeyPatch.context() as patch:
                real = direct.DataGradient
                patch.setattr(direct, "DataGradient", lambda *a, tile=tile: real(*a, tile=tile))
                results.append(cpu.conv2d_backward(x, weights, dy, geom, 2, need_dw=False)[0])
        finally:
            threads.set_thread_count(previous)
    assert all(np.array_equal(results[0], other) for other in results[1:])


def test_same_bits_for_any_thread_count_and_chunking(forced, monkeypatch):
    x = rand((13, 8, 12, 12), 0)
    weights = rand((32, 8, 5, 5), 1)
    geom = (5, 5, 1, 1, 2, 2, 1, 1)
    one = cpu.conv2d_forward(x, weights, geom, 1)
    previous = threads.set_thread_count(2)
    try:
        monkeypatch.setattr(chunking, "COL_CHUNK_BYTES", x[0].nbytes * 3)   # chunks of 3 images
        two = cpu.conv2d_forward(x, weights, geom, 1)
    finally:
        threads.set_thread_count(previous)
    assert np.array_equal(one, two)


def test_used_only_where_it_suits_and_allowed(monkeypatch):
    calls = []
    real = direct.forward
    monkeypatch.setattr(direct, "forward", lambda *a: calls.append(a) or real(*a))
    x = rand((2, 32, 8, 8), 0)
    cpu.conv2d_forward(x, rand((32, 32, 5, 5), 1), (5, 5, 1, 1, 2, 2, 1, 1), 1)       # CIFAR10-quick conv2
    assert len(calls) == 1
    with using_config(direct_conv=False):
        cpu.conv2d_forward(x, rand((32, 32, 5, 5), 1), (5, 5, 1, 1, 2, 2, 1, 1), 1)
    cpu.conv2d_forward(x.astype(np.float64), rand((32, 32, 5, 5), 1).astype(np.float64),
                       (5, 5, 1, 1, 2, 2, 1, 1), 1)                                      # float64
    cpu.conv2d_forward(x, rand((32, 32, 1, 1), 1), (1, 1, 1, 1, 0, 0, 1, 1), 1)         # 1x1: a GEMM
    cpu.conv2d_forward(rand((2, 1, 8, 8), 0), rand((32, 1, 5, 5), 1), (5, 5, 1, 1, 2, 2, 1, 1), 1)  # 25 taps
    assert len(calls) == 1
    assert direct.suits(3, 96, (11, 11, 4, 4)) and direct.suits(256, 384, (3, 3, 1, 1))
    assert direct.suits(512, 512, (3, 3, 1, 1))                      # ResNet-50 res5: banded
    assert not direct.suits(96, 208, (3, 3, 1, 1))                   # 864 terms, 208 outputs: row taps
    assert direct.suits(64, 32, (5, 5, 1, 1)) and not direct.suits(2048, 128, (1, 1, 1, 1))


def counting(patch, kernel):
    """The argument tuples of each ``direct.<kernel>`` made from now on."""
    made = []
    real = getattr(direct, kernel)
    patch.setattr(direct, kernel, lambda *a, **k: made.append(a) or real(*a, **k))
    return made


def test_weight_gradient_used_only_where_it_suits_and_allowed(monkeypatch):
    made = counting(monkeypatch, "WeightGradient")
    x, weights, dy = rand((2, 32, 8, 8), 0), rand((32, 32, 5, 5), 1), rand((2, 32, 8, 8), 2)
    geom = (5, 5, 1, 1, 2, 2, 1, 1)
    cpu.conv2d_backward(x, weights, dy, geom, 1)                                # CIFAR10-quick conv2
    assert len(made) == 1
    with using_config(direct_conv=False):
        cpu.conv2d_backward(x, weights, dy, geom, 1)
    cpu.conv2d_backward(x.astype(np.float64), weights.astype(np.float64), dy.astype(np.float64), geom, 1)
    cpu.conv2d_backward(x, rand((32, 32, 1, 1), 1), dy, (1, 1, 1, 1, 0, 0, 1, 1), 1)            # 1x1: a GEMM
    cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)
    assert len(made) == 1
    suits = direct.suits_weight_gradient
    assert suits(1, 20, (5, 5, 1, 1), 576) and suits(32, 32, (5, 5, 1, 1), 256)         # LeNet conv1, CIFAR conv2
    assert suits(512, 512, (3, 3, 1, 1), 49) and suits(256, 256, (3, 3, 1, 1), 196)     # ResNet-50 res5, res4
    assert not suits(128, 128, (3, 3, 1, 1), 784) and not suits(3, 96, (11, 11, 4, 4), 3025)
    assert not suits(1024, 2048, (1, 1, 2, 2), 49)                                        # a strided projection
    pixel = direct.suits_pixel_weight_gradient
    assert pixel(1, (5, 5, 1, 1), 576) and pixel(3, (5, 5, 1, 1), 1024)               # LeNet conv1, CIFAR conv1
    assert not pixel(20, (5, 5, 1, 1), 64) and not pixel(3, (11, 11, 4, 4), 3025)       # LeNet conv2, CaffeNet conv1
    assert not pixel(3, (5, 5, 1, 1), 49 * 2)                                            # not whole vectors


def test_data_gradient_used_only_where_it_suits_and_allowed(monkeypatch):
    made = counting(monkeypatch, "DataGradient")
    x, weights, dy = rand((2, 32, 8, 8), 0), rand((64, 32, 5, 5), 1), rand((2, 64, 8, 8), 2)
    geom = (5, 5, 1, 1, 2, 2, 1, 1)
    cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)                  # CIFAR10-quick conv3
    assert len(made) == 1
    with using_config(direct_conv=False):
        cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)
    cpu.conv2d_backward(x.astype(np.float64), weights.astype(np.float64), dy.astype(np.float64), geom, 1,
                        need_dw=False)
    cpu.conv2d_backward(x, weights, dy, geom, 1, need_dx=False)
    assert len(made) == 1
    suits = direct.suits_data_gradient
    assert suits(32, (5, 5, 1, 1, 2, 2, 1, 1), 256) and suits(512, (3, 3, 1, 1, 1, 1, 1, 1), 49)
    assert not suits(20, (5, 5, 1, 1, 0, 0, 1, 1), 144)              # LeNet conv2: 20 channels
    assert suits(64, (3, 3, 1, 1, 1, 1, 1, 1), 3136)                 # ResNet-50 res2: bands of rows
    assert not suits(48, (5, 5, 1, 1, 2, 2, 1, 1), 729)              # CaffeNet conv2: a large plane, 48
    assert not suits(128, (3, 3, 2, 2, 1, 1, 1, 1), 784) and not suits(64, (3, 3, 1, 1, 2, 2, 2, 2), 196)
    assert not suits(256, (1, 1, 1, 1, 0, 0, 1, 1), 196)


def test_lets_other_threads_run():
    """ctypes releases the GIL for the kernel: a ticking thread keeps
    ticking through a long convolution."""
    x = rand((64, 32, 16, 16), 0)
    weights = rand((32, 32, 5, 5), 1)
    shares = stall_shares(lambda: cpu.conv2d_forward(x, weights, (5, 5, 1, 1, 2, 2, 1, 1), 1))
    assert min(shares) < 0.5, shares


# The direct kernel's shapes in CIFAR10-quick, CaffeNet and ResNet-50
# (images, channels, h, w, outputs, kernel, stride, pad), the images smaller
# where the error does not depend on their size, and one of LeNet's at 32
# outputs (LeNet's own take the GEMMs: below): its error against float64
# must be no worse than the GEMM path's (assert_no_worse), in the forward and,
# where it computes one, the data gradient (issue 40).
NET_SHAPES = {
    "cifar10_quick conv1": (4, 3, 32, 32, 32, 5, 1, 2),
    "cifar10_quick conv2": (4, 32, 16, 16, 32, 5, 1, 2),
    "cifar10_quick conv3": (4, 32, 8, 8, 64, 5, 1, 2),
    "lenet conv2 at 32 outputs": (8, 20, 12, 12, 32, 5, 1, 0),
    "caffenet conv1": (1, 3, 115, 115, 96, 11, 4, 0),
    "resnet50 conv1": (1, 3, 112, 112, 64, 7, 2, 3),
    "resnet50 res2 3x3": (2, 64, 28, 28, 64, 3, 1, 1),
    "resnet50 res3 3x3": (2, 128, 28, 28, 128, 3, 1, 1),
    "resnet50 res4 3x3": (8, 256, 14, 14, 256, 3, 1, 1),
    "caffenet conv3": (8, 256, 13, 13, 384, 3, 1, 1),
    "resnet50 res5 3x3": (8, 512, 7, 7, 512, 3, 1, 1),
    "resnet50 res3a 3x3 stride 2": (2, 128, 28, 28, 128, 3, 2, 1),
    "resnet50 res3a projection": (2, 256, 28, 28, 512, 1, 2, 0),
    "resnet50 res5a projection": (2, 1024, 14, 14, 2048, 1, 2, 0),
}


def _errors(got, want):
    e = got - want
    return float(np.sqrt((e * e).mean())), float(np.abs(e).max())


def assert_no_worse(direct_errors, gemm_errors, what=None):
    """(rms, largest) error of the direct path against the GEMM path's: the
    rms no worse (10% slack), and the largest error at most twice the
    GEMM's.  The largest of 10^4-10^6 errors is one element's luck with the
    order of its sums, which the BLAS's blocking sets: on an AMD EPYC Zen 3
    (the AVX2 tile, OpenBLAS's Haswell kernels) the direct forward and data
    gradient's largest errors were 0.36-1.49 times the GEMM path's where
    their rms were 0.43-0.81 times (docs/design/cpu.md)."""
    (rms, top), (gemm_rms, gemm_top) = direct_errors, gemm_errors
    assert rms <= 1.1 * gemm_rms and top <= 2.0 * gemm_top, (what, direct_errors, gemm_errors)


def test_lenet_convolutions_take_the_gemm_path():
    assert not direct.suits(1, 20, (5, 5, 1, 1))        # conv1: 25 taps
    assert not direct.suits(20, 50, (5, 5, 1, 1))       # conv2: 50 outputs, not whole blocks of 16


@pytest.mark.parametrize("name", sorted(NET_SHAPES))
def test_as_accurate_as_the_gemm_path(name):
    n, c, h, w, o, k, stride, pad = NET_SHAPES[name]
    geom = (k, k, stride, stride, pad, pad, 1, 1)
    assert direct.suits(c, o, geom[:4]), "%s no longer takes the direct kernel" % name
    rng = np.random.RandomState(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weights = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = rng.standard_normal(o).astype(np.float32)
    wide = [a.astype(np.float64) for a in (x, weights, bias)]
    y_ref = cpu.conv2d_forward(wide[0], wide[1], geom, 1, wide[2])
    dy = rng.standard_normal(y_ref.shape).astype(np.float32)
    dx_ref, _ = cpu.conv2d_backward(wide[0], wide[1], dy.astype(np.float64), geom, 1, need_dw=False)
    errors = {}
    for path, on in (("direct", True), ("gemm", False)):
        with using_config(direct_conv=on):
            y = cpu.conv2d_forward(x, weights, geom, 1, bias)
            dx, _ = cpu.conv2d_backward(x, weights, dy, geom, 1, need_dw=False)
        errors[path] = {"forward": _errors(y, y_ref), "data gradient": _errors(dx, dx_ref)}
    for what in ("forward", "data gradient"):
        assert_no_worse(errors["direct"][what], errors["gemm"][what], what)


# The direct weight gradient's shapes in LeNet, CIFAR10-quick, CaffeNet,
# ResNet-50 and GoogLeNet at their benchmark batches (its error grows with
# the images and pixels it sums): no worse than the GEMM path's against
# float64 (assert_no_worse; issue 40)
WEIGHT_GRADIENT_SHAPES = {
    "lenet conv1": (64, 1, 28, 28, 20, 5, 1, 0),
    "lenet conv2": (64, 20, 12, 12, 50, 5, 1, 0),
    "cifar10_quick conv1": (100, 3, 32, 32, 32, 5, 1, 2),
    "cifar10_quick conv2": (100, 32, 16, 16, 32, 5, 1, 2),
    "cifar10_quick conv3": (100, 32, 8, 8, 64, 5, 1, 2),
    "caffenet conv3": (8, 256, 13, 13, 384, 3, 1, 1),
    "resnet50 res4 3x3": (8, 256, 14, 14, 256, 3, 1, 1),
    "resnet50 res5 3x3": (8, 512, 7, 7, 512, 3, 1, 1),
    "googlenet inception_3a 5x5": (8, 16, 28, 28, 32, 5, 1, 2),
}


def assert_gradient_as_accurate_as_the_gemm_path(n, c, h, w, o, k, stride, pad, which):
    """The direct path's gradient ``which`` (0: dx, 1: dw) against float64
    no worse than the GEMM path's (:func:`assert_no_worse`)."""
    geom = (k, k, stride, stride, pad, pad, 1, 1)
    oh = cpu.conv_out_size(h, k, stride, pad, 1)
    rng = np.random.RandomState(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weights = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    dy = rng.standard_normal((n, o, oh, oh)).astype(np.float32)
    asked = {"need_dx": which == 0, "need_dw": which == 1}
    ref = cpu.conv2d_backward(x.astype(np.float64), weights.astype(np.float64), dy.astype(np.float64), geom, 1,
                              **asked)[which]
    errors = {}
    for path, on in (("direct", True), ("gemm", False)):
        with using_config(direct_conv=on):
            errors[path] = _errors(cpu.conv2d_backward(x, weights, dy, geom, 1, **asked)[which], ref)
    assert_no_worse(errors["direct"], errors["gemm"])


@pytest.mark.parametrize("name", sorted(WEIGHT_GRADIENT_SHAPES))
def test_weight_gradient_as_accurate_as_the_gemm_path(name):
    n, c, h, w, o, k, stride, pad = WEIGHT_GRADIENT_SHAPES[name]
    oh = cpu.conv_out_size(h, k, stride, pad, 1)
    geom = (k, k, stride, stride)
    # LeNet's and CIFAR10-quick's conv1 take the pixel kernel, the others
    # the outputs' one
    assert direct.suits_weight_gradient(c, o, geom, oh * oh) and (
        direct.suits_pixel_weight_gradient(c, geom, oh * oh) == name.endswith("conv1")), \
        "%s no longer takes the kernel it was measured with" % name
    assert_gradient_as_accurate_as_the_gemm_path(n, c, h, w, o, k, stride, pad, 1)


# The direct data gradient's shapes in CIFAR10-quick, CaffeNet, ResNet-50
# and GoogLeNet at their benchmark batches: no worse than the GEMM path's
# against float64 (assert_no_worse; issue 40)
DATA_GRADIENT_SHAPES = {
    "cifar10_quick conv2": (100, 32, 16, 16, 32, 5, 2),
    "cifar10_quick conv3": (100, 32, 8, 8, 64, 5, 2),
    "caffenet conv3": (8, 256, 13, 13, 384, 3, 1),
    "resnet50 res4 3x3": (8, 256, 14, 14, 256, 3, 1),
    "resnet50 res5 3x3": (8, 512, 7, 7, 512, 3, 1),
    "googlenet inception_4a 3x3": (8, 96, 14, 14, 208, 3, 1),
    "googlenet inception_3a 3x3": (8, 96, 28, 28, 128, 3, 1),
    "resnet50 res2 3x3": (8, 64, 56, 56, 64, 3, 1),
    "googlenet inception_5b 5x5": (8, 48, 7, 7, 128, 5, 2),
}


@pytest.mark.parametrize("name", sorted(DATA_GRADIENT_SHAPES))
def test_data_gradient_as_accurate_as_the_gemm_path(name):
    n, c, h, w, o, k, pad = DATA_GRADIENT_SHAPES[name]
    assert direct.suits_data_gradient(c, (k, k, 1, 1, pad, pad, 1, 1), h * w), \
        "%s no longer takes the direct kernel" % name
    assert_gradient_as_accurate_as_the_gemm_path(n, c, h, w, o, k, 1, pad, 0)
