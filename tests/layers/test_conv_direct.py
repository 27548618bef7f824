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
