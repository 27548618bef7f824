"""LRN, both norm regions: forward values against plain loops, finite-difference
gradients, parameter checks."""
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def lrn_text(extra):
    return 'type: "LRN" lrn_param { %s }' % extra


def f32(v):
    """The proto stores alpha/beta/k as float32."""
    return float(np.float32(v))


def ref_across(x, size, alpha, beta, k):
    alpha, beta, k = f32(alpha), f32(beta), f32(k)
    n, c, h, w = x.shape
    pre = (size - 1) // 2
    y = np.zeros_like(x)
    for a in range(n):
        for ch in range(c):
            s = np.zeros((h, w))
            for cc in range(ch - pre, ch - pre + size):
                if 0 <= cc < c:
                    s += x[a, cc] ** 2
            y[a, ch] = x[a, ch] * (k + alpha / size * s) ** -beta
    return y


def ref_within(x, size, alpha, beta):
    # Caffe: AVE pooling of x^2 with pad (size-1)/2 (divisor size^2), then (1 + alpha * avg)^-beta
    alpha, beta = f32(alpha), f32(beta)
    n, c, h, w = x.shape
    pre = (size - 1) // 2
    y = np.zeros_like(x)
    for a in range(n):
        for ch in range(c):
            for i in range(h):
                for j in range(w):
                    s = 0.0
                    for ii in range(i - pre, i - pre + size):
                        for jj in range(j - pre, j - pre + size):
                            if 0 <= ii < h and 0 <= jj < w:
                                s += x[a, ch, ii, jj] ** 2
                    y[a, ch, i, j] = x[a, ch, i, j] * (1 + alpha * s / size ** 2) ** -beta
    return y


ACROSS = [
    ("", 5, 1.0, 0.75, 1.0),
    ("local_size: 3 alpha: 0.5 beta: 0.6 k: 2", 3, 0.5, 0.6, 2.0),
    ("local_size: 7 alpha: 2 beta: 1.5 k: 0.5", 7, 2.0, 1.5, 0.5),
]
WITHIN = [
    ("norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.8 beta: 0.75", 3, 0.8, 0.75),
    ("norm_region: WITHIN_CHANNEL local_size: 5 alpha: 2 beta: 0.5 k: 7", 5, 2.0, 0.5),  # k unused
    ("norm_region: WITHIN_CHANNEL local_size: 1 alpha: 1 beta: 1", 1, 1.0, 1.0),
]


@pytest.mark.parametrize("text,size,alpha,beta,k", ACROSS)
def test_across_channels_forward(text, size, alpha, beta, k):
    x = rand(2, 6, 3, 4)
    _, _, top = run_layer(lrn_text(text), [x])
    np.testing.assert_allclose(top[0].data, ref_across(x, size, alpha, beta, k), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("text,size,alpha,beta", WITHIN)
def test_within_channel_forward(text, size, alpha, beta):
    x = rand(2, 2, 5, 6)
    _, _, top = run_layer(lrn_text(text), [x])
    np.testing.assert_allclose(top[0].data, ref_within(x, size, alpha, beta), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("text", [t[0] for t in ACROSS] + [t[0] for t in WITHIN])
def test_gradient(text):
    check_gradient(lrn_text(text), [rand(2, 7, 3, 4, seed=1)])


def test_float32():
    x = rand(2, 8, 4, 4).astype(np.float32)
    _, _, top = run_layer(lrn_text("local_size: 5 alpha: 0.0001 beta: 0.75"), [x], dtype=np.float32)
    assert top[0].data.dtype == np.float32
    np.testing.assert_allclose(top[0].data, ref_across(x.astype(np.float64), 5, 1e-4, 0.75, 1.0), rtol=1e-5)


@pytest.mark.parametrize("text,shape", [
    ("local_size: 4", (1, 4, 3, 3)),
    ("local_size: 3", (4, 3, 3)),
])
def test_errors(text, shape):
    with pytest.raises(CaffeError):
        run_layer(lrn_text(text), [np.zeros(shape)])
