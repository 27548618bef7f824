"""Scale and Bias: broadcasting against plain NumPy, parameter shapes,
finite-difference gradients for parameters and second bottoms."""
import numpy as np
import pytest

from caffempi.blob import Blob
from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer

FILL = 'type: "uniform" min: 0.5 max: 1.5'


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def scale(extra=""):
    return 'type: "Scale" scale_param { filler { %s } bias_filler { %s } %s }' % (FILL, FILL, extra)


def bias(extra=""):
    return 'type: "Bias" bias_param { filler { %s } %s }' % (FILL, extra)


def expand(operand, ndim, axis):
    """Reference broadcast: put operand's axes at [axis, axis+k) of an ndim array."""
    return operand.reshape((1,) * axis + operand.shape + (1,) * (ndim - axis - operand.ndim))


@pytest.mark.parametrize("extra,pshape,axis", [
    ("", (3,), 1),
    ("axis: 0 num_axes: 2", (2, 3), 0),
    ("axis: 1 num_axes: -1", (3, 4, 2), 1),
    ("axis: -1", (2,), 3),
    ("num_axes: 0", (), 0),
])
def test_scale_param_forward(extra, pshape, axis):
    x = rand(2, 3, 4, 2)
    layer, _, top = run_layer(scale(extra), [x])
    assert len(layer.blobs) == 1
    s = layer.blobs[0].data
    assert s.shape == pshape
    np.testing.assert_allclose(top[0].data, x * expand(s, 4, axis), rtol=1e-12)


def test_scale_default_filler_is_identity():
    x = rand(2, 3)
    layer, _, top = run_layer('type: "Scale"', [x])
    np.testing.assert_array_equal(layer.blobs[0].data, np.ones(3))
    np.testing.assert_array_equal(top[0].data, x)


def test_scale_bias_term_forward():
    x = rand(2, 3, 4)
    layer, _, top = run_layer(scale("bias_term: true"), [x])
    s, b = (p.data for p in layer.blobs)
    assert s.shape == b.shape == (3,)
    np.testing.assert_allclose(top[0].data, x * s[None, :, None] + b[None, :, None])


def test_scale_two_bottoms_forward():
    x, s = rand(2, 3, 4), rand(3, 4, seed=1)
    layer, _, top = run_layer(scale("bias_term: true"), [x, s])
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (3, 4)
    np.testing.assert_allclose(top[0].data, x * s[None] + layer.blobs[0].data[None])


def test_scale_shape_mismatch():
    with pytest.raises(CaffeError, match="does not match"):
        run_layer(scale(), [rand(2, 3, 4), rand(4)])


def test_scale_in_place():
    layer = make_layer(scale())
    x = rand(2, 3, 2)
    blob = Blob(x.shape, np, np.float64)
    blob.data = x.copy()
    layer.setup([blob], [blob])
    layer.reshape([blob], [blob])
    layer.forward([blob], [blob])
    s = layer.blobs[0].data
    np.testing.assert_allclose(blob.data, x * s[None, :, None])
    blob.diff = np.ones(x.shape)
    layer.blobs[0].diff = np.zeros(3)
    layer.backward([blob], [True], [blob])
    np.testing.assert_allclose(layer.blobs[0].diff, x.sum(axis=(0, 2)))
    np.testing.assert_allclose(blob.diff, np.broadcast_to(s[None, :, None], x.shape))


@pytest.mark.parametrize("extra", [
    "", "bias_term: true", "axis: 0 num_axes: 2", "num_axes: -1 bias_term: true",
    "axis: -1", "num_axes: 0 bias_term: true",
])
def test_scale_param_gradient(extra):
    check_gradient(scale(extra), [rand(2, 3, 2, 2)])


@pytest.mark.parametrize("extra,sshape", [
    ("", (3,)), ("", (3, 2)), ("axis: 0", (2, 3)), ("bias_term: true", (3, 2)),
    ("axis: 2", (2,)), ("", ()),
])
def test_scale_two_bottom_gradient(extra, sshape):
    check_gradient(scale(extra), [rand(2, 3, 2, 2), rand(*sshape, seed=1)])


@pytest.mark.parametrize("extra,pshape,axis", [
    ("", (3,), 1), ("axis: 0 num_axes: 2", (2, 3), 0), ("num_axes: -1", (3, 4), 1),
    ("num_axes: 0", (), 0),
])
def test_bias_param_forward(extra, pshape, axis):
    x = rand(2, 3, 4)
    layer, _, top = run_layer(bias(extra), [x])
    b = layer.blobs[0].data
    assert b.shape == pshape
    np.testing.assert_allclose(top[0].data, x + expand(b, 3, axis), rtol=1e-12)


def test_bias_default_filler_is_zero():
    layer, _, top = run_layer('type: "Bias"', [rand(2, 3)])
    np.testing.assert_array_equal(layer.blobs[0].data, np.zeros(3))


def test_bias_two_bottoms_forward():
    x, b = rand(2, 3, 4), rand(3, 4, seed=1)
    layer, _, top = run_layer(bias(), [x, b])
    assert layer.blobs == []
    np.testing.assert_allclose(top[0].data, x + b[None])


@pytest.mark.parametrize("extra", ["", "axis: 0 num_axes: 2", "num_axes: -1", "num_axes: 0"])
def test_bias_param_gradient(extra):
    check_gradient(bias(extra), [rand(2, 3, 2, 2)])


@pytest.mark.parametrize("extra,bshape", [("", (3,)), ("", (3, 2)), ("axis: 0", (2, 3)), ("", ())])
def test_bias_two_bottom_gradient(extra, bshape):
    check_gradient(bias(extra), [rand(2, 3, 2, 2), rand(*bshape, seed=1)])


@pytest.mark.parametrize("text,nbottom", [
    (scale("bias_term: true"), 1), (scale("bias_term: true"), 2), (bias(), 1), (bias(), 2),
])
def test_float32_stays_float32(text, nbottom):
    arrays = [rand(2, 3, 2), rand(3, seed=1)][:nbottom]
    layer, bottom, top = run_layer(text, arrays, dtype=np.float32)
    assert top[0].data.dtype == np.float32
    top[0].diff = np.ones(top[0].shape, np.float32)
    layer.backward(top, [True] * nbottom, bottom)
    assert all(b.diff.dtype == np.float32 for b in bottom + layer.blobs)
