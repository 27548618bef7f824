"""Filter, BatchReindex and Parameter: forward values against NumPy,
gradients by finite differences and by explicit scatter references, the
data-dependent shapes, the non-differentiable bottoms, errors; Parameter
inside a net (its blob is a learnable parameter the net trains)."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


# ------------------------------------------------------------------- Filter
@pytest.mark.parametrize("selector", [np.array([1, 0, 1, 1, 0.]), np.array([0, 0.5, 0, -2, 0]).reshape(5, 1, 1)])
def test_filter_forward_keeps_the_selected_items(selector):
    xs = [rand(5, 2, 3), rand(5, 4, seed=1)]
    _, _, top = run_layer('type: "Filter"', xs + [selector], num_top=2)
    kept = selector.reshape(-1) != 0
    for t, x in zip(top, xs):
        assert t.shape == (int(kept.sum()),) + x.shape[1:]
        np.testing.assert_array_equal(t.data, x[kept])


def test_filter_gradient():
    xs = [rand(5, 2, 3), rand(5, 4, seed=1), np.array([[1], [0], [1], [1], [0.]])]
    check_gradient('type: "Filter"', xs, check_bottoms=[0, 1], num_top=2)


def test_filter_backward_scatters_and_zeros_the_rest():
    x, sel = rand(4, 3), np.array([0, 1, 0, 1.])
    layer, bottom, top = run_layer('type: "Filter"', [x, sel], num_top=1)
    dy = rand(2, 3, seed=5)
    top[0].diff = dy
    layer.backward(top, [True, False], bottom)
    want = np.zeros((4, 3))
    want[[1, 3]] = dy
    np.testing.assert_array_equal(bottom[0].diff, want)


def test_filter_top_shape_follows_each_forward():
    layer, bottom, top = run_layer('type: "Filter"', [rand(4, 3), np.ones(4)], num_top=1)
    assert top[0].shape == (4, 3)
    for sel in ([0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1]):
        bottom[1].data = np.asarray(sel, float)
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        np.testing.assert_array_equal(top[0].data, bottom[0].data[np.asarray(sel) != 0])
    top[0].diff = np.ones((3, 3))
    layer.backward(top, [True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff, np.asarray([[1] * 3, [1] * 3, [0] * 3, [1] * 3]))


def test_filter_first_reshape_gives_every_item():
    # before any data the selector is unknown: all N items, as Caffe's first reshape
    layer = make_layer('type: "Filter"')
    from caffempi.blob import Blob
    bottom = [Blob((6, 2), np, np.float64), Blob((6,), np, np.float64)]
    top = [Blob((), np, np.float64)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    assert top[0].shape == (6, 2)


@pytest.mark.parametrize("bottoms,num_top,match", [
    ([np.zeros((4, 3)), np.zeros((4, 2))], 1, "one value per item"),
    ([np.zeros((4, 3)), np.zeros((5,))], 1, "does not have the selector's 5 items"),
    ([np.zeros((4, 3)), np.zeros((4,))], 2, "one top per filtered bottom"),
])
def test_filter_errors(bottoms, num_top, match):
    with pytest.raises(CaffeError, match=match):
        run_layer('type: "Filter"', bottoms, num_top=num_top)


def test_filter_refuses_gradient_to_the_selector():
    layer, bottom, top = run_layer('type: "Filter"', [rand(3, 2), np.ones(3)], num_top=1)
    with pytest.raises(CaffeError, match="selector"):
        layer.backward(top, [True, True], bottom)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)


FILTER_NET = """
force_backward: true
layer { name: "in" type: "Input" top: "x" top: "y" top: "sel"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "filter" type: "Filter" bottom: "x" bottom: "y" bottom: "sel" top: "fx" top: "fy" }
layer { name: "loss" type: "EuclideanLoss" bottom: "fx" bottom: "fy" top: "loss" }
"""


@pytest.mark.parametrize("memory", ["none", "reuse"])
def test_filter_in_a_net_feeds_each_forward_its_own_count(memory):
    from caffempi import Net
    net = Net(text_format.Parse(FILTER_NET, caffe_pb2.NetParameter()), dtype=np.float64, memory=memory)
    x, y = rand(4, 3), rand(4, 3, seed=1)
    net.blobs["x"].data[...] = x
    net.blobs["y"].data[...] = y
    for sel in ([1, 0, 1, 1], [0, 0, 1, 0]):
        kept = np.asarray(sel) != 0
        net.blobs["sel"].data[...] = sel
        net.forward()
        net.backward()
        k = kept.sum()
        np.testing.assert_allclose(net.blobs["loss"].data, ((x - y)[kept] ** 2).sum() / (2 * k), rtol=1e-12)
        want = np.where(kept[:, None], (x - y) / k, 0)
        np.testing.assert_allclose(net.blobs["x"].diff, want, rtol=1e-12)


# ------------------------------------------------------------- BatchReindex
def test_batch_reindex_forward_repeats_and_truncates():
    x = rand(4, 2, 3)
    idx = np.array([3, 0, 3, 1.7, 2])              # 1.7 -> item 1, as Caffe's int cast
    _, _, top = run_layer('type: "BatchReindex"', [x, idx])
    np.testing.assert_array_equal(top[0].data, x[[3, 0, 3, 1, 2]])


def test_batch_reindex_gradient():
    check_gradient('type: "BatchReindex"', [rand(4, 3), np.array([2, 0, 2, 3, 2.])], check_bottoms=[0])


def test_batch_reindex_backward_sums_repeated_indices():
    idx = np.array([2, 0, 2, 2.])
    layer, bottom, top = run_layer('type: "BatchReindex"', [rand(3, 2), idx])
    dy = rand(4, 2, seed=3)
    top[0].diff = dy
    layer.backward(top, [True, False], bottom)
    want = np.zeros((3, 2))
    np.add.at(want, idx.astype(int), dy)
    np.testing.assert_allclose(bottom[0].diff, want, rtol=1e-15)
    assert not bottom[0].diff[1].any()              # never picked: zero


@pytest.mark.parametrize("idx,match", [
    (np.array([0, 4.]), r"index 4 \(entry 1 of bottom 1\) is out of range for the 4 items"),
    (np.array([-1, 0.]), r"index -1 \(entry 0"),
    (np.zeros((2, 1)), "must be 1-D"),
])
def test_batch_reindex_errors(idx, match):
    with pytest.raises(CaffeError, match=match):
        run_layer('type: "BatchReindex"', [rand(4, 3), idx])


def test_batch_reindex_refuses_gradient_to_the_indices():
    layer, bottom, top = run_layer('type: "BatchReindex"', [rand(3, 2), np.array([1.])])
    with pytest.raises(CaffeError, match="indices"):
        layer.backward(top, [True, True], bottom)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)


# ---------------------------------------------------------------- Parameter
PARAM = 'type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }'


def test_parameter_top_is_its_blob():
    layer, _, top = run_layer(PARAM, [])
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (2, 3)
    assert not layer.blobs[0].data.any()            # unfilled, as Caffe: zeros
    values = rand(2, 3)
    layer.blobs[0].data = values.copy()
    layer.forward([], top)
    assert top[0].data is layer.blobs[0].data       # shared, not copied
    np.testing.assert_array_equal(top[0].data, values)


def test_parameter_gradient():
    check_gradient(PARAM, [])


def test_parameter_backward_accumulates_into_the_blob():
    layer, _, top = run_layer(PARAM, [])
    dy = rand(2, 3, seed=2)
    top[0].diff = dy
    layer.backward(top, [], [])
    layer.backward(top, [], [])
    np.testing.assert_array_equal(layer.blobs[0].diff, 2 * dy)


def test_parameter_loaded_blob_shape_is_checked():
    from caffempi.blob import Blob
    layer = make_layer(PARAM)
    layer.blobs = [Blob((3, 2), np, np.float64)]
    with pytest.raises(CaffeError, match="do not match parameter_param.shape"):
        run_layer(layer, [])


PARAM_NET = """
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "w" type: "Parameter" top: "w" parameter_param { shape { dim: 2 dim: 3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "w" bottom: "target" top: "loss" }
"""


def test_parameter_in_a_net_gets_the_loss_gradient():
    from caffempi import Net
    net = Net(text_format.Parse(PARAM_NET, caffe_pb2.NetParameter()), dtype=np.float64)
    w, target = rand(2, 3), rand(2, 3, seed=1)
    net.params["w"][0].data[...] = w
    net.blobs["target"].data[...] = target
    net.forward()
    net.backward()
    np.testing.assert_allclose(net.blobs["loss"].data, ((w - target) ** 2).sum() / 4, rtol=1e-12)
    # EuclideanLoss: d/dw of sum((w - t)^2) / (2N) with N = 2
    np.testing.assert_allclose(net.params["w"][0].diff, (w - target) / 2, rtol=1e-12)
