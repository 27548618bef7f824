"""The compiled direct convolution (caffempi.backend.direct): values against
plain loops for every geometry it takes (forced, whatever :func:`suits`
says), the data gradient through it, independence from the thread count,
the setting that turns it off, and the GIL released while it runs."""
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


def rand(shape, seed):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


# (images, channels, h, w, outputs, kh, kw, stride, pad, dilation, group, bias):
# output widths below, at and past the 6-pixel tile, 1 to 3 blocks of 16
# outputs with and without a partial one
GEOMETRIES = [
    (2, 3, 9, 11, 16, 3, 3, (1, 1), (1, 1), (1, 1), 1, True),
    (3, 4, 8, 5, 20, 3, 3, (1, 1), (0, 0), (1, 1), 1, False),
    (2, 6, 13, 17, 34, 5, 3, (2, 1), (0, 2), (1, 2), 2, True),
    (1, 3, 23, 23, 48, 11, 11, (4, 4), (0, 0), (1, 1), 1, True),
    (2, 12, 7, 9, 9, 3, 3, (1, 3), (1, 0), (2, 1), 3, True),
    (5, 8, 6, 6, 33, 2, 2, (1, 1), (1, 1), (2, 2), 1, False),
    (2, 2, 4, 4, 7, 1, 1, (2, 2), (1, 1), (1, 1), 1, True),
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


@pytest.mark.parametrize("n,c,h,w,o,kh,kw,stride,pad,dil,group,bias", GEOMETRIES[:4])
def test_avx2_and_avx512_tiles_give_the_same_bits(n, c, h, w, o, kh, kw, stride, pad, dil, group, bias):
    """Each output is summed in the same order whatever the tile (LLVM
    splits the 16-float vectors where the CPU has no AVX-512)."""
    x = rand((n, c, h + 2 * pad[0], w + 2 * pad[1]), 0)
    weights = rand((o, c // group, kh, kw), 1)
    b = rand((o,), 2) if bias else None
    geom = (kh, kw) + stride + (0, 0) + dil
    shape = (n, o, cpu.conv_out_size(x.shape[2], kh, stride[0], 0, dil[0]),
             cpu.conv_out_size(x.shape[3], kw, stride[1], 0, dil[1]))
    ys = []
    for tile in (direct.AVX2_TILE, direct.AVX512_TILE):
        y = np.empty(shape, np.float32)
        direct.forward(x, weights, geom, group, y, b, tile)(0, n)
        ys.append(y)
    assert np.array_equal(ys[0], ys[1])


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
    assert direct.suits(3, 96, (11, 11, 4, 4)) and not direct.suits(256, 384, (3, 3, 1, 1))
    assert direct.suits(64, 32, (5, 5, 1, 1)) and not direct.suits(256, 64, (3, 3, 1, 1))


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
# must be no worse than the GEMM path's (10% slack), in the forward and,
# where it computes one, the data gradient (issue 40).
NET_SHAPES = {
    "cifar10_quick conv1": (4, 3, 32, 32, 32, 5, 1, 2),
    "cifar10_quick conv2": (4, 32, 16, 16, 32, 5, 1, 2),
    "cifar10_quick conv3": (4, 32, 8, 8, 64, 5, 1, 2),
    "lenet conv2 at 32 outputs": (8, 20, 12, 12, 32, 5, 1, 0),
    "caffenet conv1": (1, 3, 115, 115, 96, 11, 4, 0),
    "resnet50 conv1": (1, 3, 112, 112, 64, 7, 2, 3),
    "resnet50 res2 3x3": (2, 64, 28, 28, 64, 3, 1, 1),
    "resnet50 res3a 3x3 stride 2": (2, 128, 28, 28, 128, 3, 2, 1),
    "resnet50 res3a projection": (2, 256, 28, 28, 512, 1, 2, 0),
    "resnet50 res5a projection": (2, 1024, 14, 14, 2048, 1, 2, 0),
}


def _errors(got, want):
    e = got - want
    return float(np.sqrt((e * e).mean())), float(np.abs(e).max())


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
        (rms, top), (gemm_rms, gemm_top) = errors["direct"][what], errors["gemm"][what]
        assert rms <= 1.1 * gemm_rms and top <= 1.1 * gemm_top, (what, errors)
