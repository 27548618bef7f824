"""InnerProduct and Embed: parameter shapes, forward values against plain
NumPy, finite-difference gradients."""
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, run_layer

GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def ip(extra):
    return 'type: "InnerProduct" inner_product_param { %s %s }' % (GAUSS, extra)


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def test_ip_shapes_and_forward():
    x = rand(2, 3, 2, 2)
    layer, _, top = run_layer(ip("num_output: 4"), [x])
    w, b = (p.data for p in layer.blobs)
    assert w.shape == (4, 12) and b.shape == (4,)
    assert top[0].shape == (2, 4)
    ref = np.array([[sum(x[n].reshape(-1)[k] * w[o, k] for k in range(12)) + b[o]
                     for o in range(4)] for n in range(2)])
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)


def test_ip_axis2_and_transpose_forward():
    x = rand(2, 3, 5)
    layer, _, top = run_layer(ip("num_output: 4 axis: 2 transpose: true"), [x])
    w, b = (p.data for p in layer.blobs)
    assert w.shape == (5, 4)
    assert top[0].shape == (2, 3, 4)
    ref = np.einsum("abk,ko->abo", x, w) + b
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)


def test_ip_no_bias_has_one_blob():
    layer, _, top = run_layer(ip("num_output: 3 bias_term: false"), [rand(2, 4)])
    assert len(layer.blobs) == 1
    np.testing.assert_allclose(top[0].data, rand(2, 4) @ layer.blobs[0].data.T)


@pytest.mark.parametrize("rows", [2, 7])           # fewer / more rows than outputs
@pytest.mark.parametrize("bias", ["true", "false"])
def test_ip_forward_both_product_orientations(rows, bias):
    x = rand(rows, 6)
    layer, _, top = run_layer(ip("num_output: 4 bias_term: %s" % bias), [x])
    ref = x @ layer.blobs[0].data.T + (layer.blobs[1].data if bias == "true" else 0)
    assert top[0].data.flags.c_contiguous
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)


def test_ip_input_size_mismatch():
    layer, bottom, top = run_layer(ip("num_output: 3"), [rand(2, 4)])
    bottom[0].reshape((2, 5))
    with pytest.raises(CaffeError, match="input size"):
        layer.reshape(bottom, top)


@pytest.mark.parametrize("extra,shape", [
    ("num_output: 3", (2, 3, 2)),
    ("num_output: 3 axis: 2", (2, 2, 3)),
    ("num_output: 3 axis: -1 transpose: true", (2, 2, 3)),
    ("num_output: 3 transpose: true", (2, 4)),
    ("num_output: 3 bias_term: false", (2, 4)),
])
def test_ip_gradient(extra, shape):
    check_gradient(ip(extra), [rand(*shape)])


EMBED = ('type: "Embed" embed_param { num_output: 3 input_dim: 5 %s '
         'weight_filler { type: "uniform" min: -1 max: 1 } bias_filler { type: "uniform" min: -1 max: 1 } }')


def test_embed_lookup():
    idx = np.array([[0, 4, 2], [2, 2, 1]], float)
    layer, _, top = run_layer(EMBED % "", [idx])
    w, b = (p.data for p in layer.blobs)
    assert w.shape == (5, 3) and b.shape == (3,)
    assert top[0].shape == (2, 3, 3)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(top[0].data[i, j], w[int(idx[i, j])] + b)


def test_embed_no_bias():
    layer, _, top = run_layer(EMBED % "bias_term: false", [np.array([3.0, 1.0])])
    assert len(layer.blobs) == 1
    np.testing.assert_allclose(top[0].data, layer.blobs[0].data[[3, 1]])


def test_embed_rejects_bad_indices():
    for bad in ([5.0], [-1.0], [1.5]):
        with pytest.raises(CaffeError, match="indices"):
            run_layer(EMBED % "", [np.array(bad)])


@pytest.mark.parametrize("extra", ["", "bias_term: false"])
def test_embed_gradient(extra):
    # Repeated indices check that the rows accumulate.
    idx = np.array([[0, 4, 2, 2], [2, 1, 1, 0]], float)
    check_gradient(EMBED % extra, [idx], check_bottoms=[])


def test_embed_refuses_bottom_gradient():
    layer, bottom, top = run_layer(EMBED % "", [np.array([1.0])])
    top[0].diff = np.ones(top[0].shape)
    with pytest.raises(CaffeError):
        layer.backward(top, [True], bottom)


@pytest.mark.parametrize("text,x", [
    (ip("num_output: 3"), rand(2, 4)), (ip("num_output: 3 transpose: true"), rand(2, 4)),
    (EMBED % "", np.array([[1.0, 2.0]])),
])
def test_float32_stays_float32(text, x):
    layer, bottom, top = run_layer(text, [x], dtype=np.float32)
    assert top[0].data.dtype == np.float32
    top[0].diff = np.ones(top[0].shape, np.float32)
    layer.backward(top, [layer.type != "Embed"], bottom)
    assert all(b.diff.dtype == np.float32 for b in layer.blobs)
