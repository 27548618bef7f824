import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, run_layer


def ref_softmax(x, axis):
    """Plain loops over every position: exp(x - max) / sum."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        v = x[idx]
        e = np.exp(v - v.max())
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_softmax_forward(axis):
    x = np.random.RandomState(0).randn(2, 3, 4, 5)
    text = 'type: "Softmax" softmax_param { axis: %d }' % axis
    _, _, tops = run_layer(text, [x])
    assert tops[0].shape == x.shape
    np.testing.assert_allclose(tops[0].data, ref_softmax(x, axis), rtol=1e-12, atol=1e-14)


def test_softmax_default_axis_is_channels():
    x = np.random.RandomState(1).randn(3, 4, 2)
    _, _, tops = run_layer('type: "Softmax"', [x])
    np.testing.assert_allclose(tops[0].data, ref_softmax(x, 1), rtol=1e-12)
    np.testing.assert_allclose(tops[0].data.sum(axis=1), 1.0)


def test_softmax_stable_for_large_inputs():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -999.0]])
    _, _, tops = run_layer('type: "Softmax"', [x], dtype=np.float32)
    assert np.all(np.isfinite(tops[0].data))
    np.testing.assert_allclose(tops[0].data, ref_softmax(x, 1), rtol=1e-5)
    assert tops[0].data.dtype == np.float32


def test_softmax_bad_axis():
    with pytest.raises(CaffeError, match="axis"):
        run_layer('type: "Softmax" softmax_param { axis: 3 }', [np.zeros((2, 3))])


@pytest.mark.parametrize("axis", [1, 2])
def test_softmax_gradient(axis):
    x = np.random.RandomState(2).randn(2, 3, 4)
    check_gradient('type: "Softmax" softmax_param { axis: %d }' % axis, [x])
