"""pycaffe's Blob and Net surface against NumPy references: Blob.reshape forms
and legacy accessors; Net forward/backward with start, end, blobs= and
diffs=, forward_all and forward_backward_all over a batch that does not
divide the input, top_names/bottom_names, blob_loss_weights, reshape,
share_with, HDF5 and .caffemodel round trips, set_input_arrays, errors."""
from collections import OrderedDict

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi as caffe
from caffempi.blob import Blob, BlobVec
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2

B, D, H, K = 3, 4, 5, 2          # batch, input width, hidden width, classes

DEPLOY = """
name: "mlp" force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: %d dim: %d } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.7 }
                              bias_filler { type: "uniform" min: -0.3 max: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.7 }
                              bias_filler { type: "uniform" min: -0.3 max: 0.3 } } }
layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }
""" % (B, D, H, K)

LOSS = """
name: "reg"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: %d dim: %d } shape { dim: %d dim: %d } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.7 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" loss_weight: 2 }
""" % (B, D, B, K, K)


def parse(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def deploy_net(seed=0):
    caffe.set_random_seed(seed)
    return caffe.Net(parse(DEPLOY), caffe.TEST, dtype=np.float64)


def reference(net, x):
    """The deploy net's forward in NumPy: (ip1 before ReLU, prob)."""
    (w1, b1), (w2, b2) = [[p.data for p in net.params[n]] for n in ("ip1", "ip2")]
    pre = x @ w1.T + b1
    z = np.maximum(pre, 0) @ w2.T + b2
    e = np.exp(z - z.max(1, keepdims=True))
    return pre, e / e.sum(1, keepdims=True)


def reference_input_grad(net, x, dprob):
    (w1, b1), (w2, _) = [[p.data for p in net.params[n]] for n in ("ip1", "ip2")]
    pre, prob = reference(net, x)
    dz = prob * (dprob - (dprob * prob).sum(1, keepdims=True))
    return ((dz @ w2) * (pre > 0)) @ w1


def rows(n, seed=1):
    return np.random.RandomState(seed).randn(n, D)


# ---------------------------------------------------------------------- Blob
def test_blob_reshape_forms_and_legacy_accessors():
    b = Blob()
    b.reshape(2, 3, 4, 5)
    assert b.shape == (2, 3, 4, 5) and b.data.shape == (2, 3, 4, 5) and b.count == 120
    assert (b.num, b.channels, b.height, b.width) == (2, 3, 4, 5)
    b.reshape((6, 7))
    assert b.shape == (6, 7) and (b.num, b.channels, b.height, b.width) == (6, 7, 1, 1)
    b.reshape([np.int64(3)])
    assert b.shape == (3,)
    b.reshape(np.int64(4))
    assert b.shape == (4,)
    b.reshape()
    assert b.shape == () and b.count == 1
    b.reshape(2, 2)
    b.data[...] = 5
    b.diff[...] = 7
    b.reshape(2, 2)                                  # same shape: values stay
    assert np.all(b.data == 5) and np.all(b.diff == 7)
    b.data[0, 1] = 3                                 # written in place, as pycaffe
    assert b.data.sum() == 18
    b.reshape(1, 2, 3, 4, 5)
    with pytest.raises(CaffeError, match="legacy accessors.*5 axes"):
        b.num
    with pytest.raises(ValueError, match="negative"):
        b.reshape(2, -1)


def test_blobvec_add_blob():
    blobs = BlobVec(np, np.float64)
    blobs.add_blob(2, 3)
    blobs.add_blob(1)
    assert [b.shape for b in blobs] == [(2, 3), (1,)]
    assert blobs[0].data.dtype == np.float64 and not blobs[1].data.any()


# ------------------------------------------------------------ Net structure
def test_net_structure_dicts():
    net = deploy_net()
    assert net._layer_names == ["data", "ip1", "relu1", "ip2", "prob"]
    assert isinstance(net.top_names, OrderedDict) and list(net.top_names) == net._layer_names
    assert net.top_names["relu1"] == ["ip1"] and net.bottom_names["relu1"] == ["ip1"]
    assert net.bottom_names["prob"] == ["ip2"] and net.bottom_names["data"] == []
    assert net.top_names[3] == ["ip2"]                # a layer index still works
    assert list(net.layer_dict) == net._layer_names
    assert net.layer_dict["ip2"] is net.layers[3] and net.layers[3].type == "InnerProduct"
    assert list(net.params) == ["ip1", "ip2"] and net.params["ip1"][0].data.shape == (H, D)
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert list(net.blobs) == ["data", "ip1", "ip2", "prob"]
    assert set(net.blob_loss_weights.values()) == {0.0}
    reg = caffe.Net(parse(LOSS), caffe.TRAIN)
    assert reg.blob_loss_weights == OrderedDict([("data", 0.0), ("target", 0.0), ("ip", 0.0), ("loss", 2.0)])


# ----------------------------------------------------------------- forward
def test_forward_inputs_blobs_start_end():
    net = deploy_net()
    x = rows(B)
    pre, prob = reference(net, x)
    out = net.forward(data=x)
    assert set(out) == {"prob"}
    np.testing.assert_allclose(out["prob"], prob, rtol=1e-10)
    out = net.forward(blobs=["ip2", "data"], data=x)
    assert set(out) == {"prob", "ip2", "data"}
    np.testing.assert_array_equal(out["data"], x)
    # end: the tops of that layer (ip1 before the in-place ReLU ran)
    net.blobs["prob"].data[...] = -1
    out = net.forward(end="ip1", data=x)
    assert set(out) == {"ip1"}
    np.testing.assert_allclose(out["ip1"], pre, rtol=1e-10)
    assert np.all(net.blobs["prob"].data == -1)       # the layers after end did not run
    # start: only the layers from there on run, from the blobs as they are
    net.blobs["ip1"].data[...] = np.maximum(pre, 0) * 2
    w2, b2 = [p.data for p in net.params["ip2"]]
    z = np.maximum(pre, 0) * 2 @ w2.T + b2
    out = net.forward(start="ip2")
    np.testing.assert_allclose(out["prob"], np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-10)
    # an input with broadcasting trailing dims, as pycaffe's data[...] = x
    out = net.forward(data=np.ones((B, 1)))
    np.testing.assert_allclose(out["prob"], reference(net, np.ones((B, D)))[1], rtol=1e-10)


def test_forward_errors():
    net = deploy_net()
    with pytest.raises(CaffeError, match=r"forward: 'ip1' is not an input of net 'mlp' \(inputs: data\)"):
        net.forward(ip1=np.zeros((B, H)))
    with pytest.raises(CaffeError, match=r"input 'data' has shape \(5, 4\), the blob has shape \(3, 4\) "
                                         r"\(batch size 3; .*reshape"):
        net.forward(data=np.zeros((5, D)))
    with pytest.raises(CaffeError, match=r"input 'data' has shape \(3, 2\)"):
        net.forward(data=np.zeros((B, 2)))
    with pytest.raises(CaffeError, match="no layer 'conv9'"):
        net.forward(start="conv9")
    with pytest.raises(CaffeError, match="no blob 'nope'"):
        net.forward(blobs=["nope"])


def test_reshape_after_input_reshape():
    net = deploy_net()
    net.blobs["data"].reshape(5, D)
    net.reshape()
    assert net.blobs["ip1"].shape == (5, H) and net.blobs["prob"].shape == (5, K)
    x = rows(5)
    np.testing.assert_allclose(net.forward(data=x)["prob"], reference(net, x)[1], rtol=1e-10)


def test_forward_all_pads_and_trims():
    net = deploy_net()
    x = rows(7)                                       # 3 batches of 3, the last padded by 2
    pre, prob = reference(net, x)
    out = net.forward_all(data=x, blobs=["ip2"])
    assert set(out) == {"prob", "ip2"}
    assert out["prob"].shape == (7, K) and out["ip2"].shape == (7, K)
    np.testing.assert_allclose(out["prob"], prob, rtol=1e-10)
    assert net.blobs["data"].shape == (B, D)
    # the padding was zeros: the last batch's last rows are the net at x = 0
    np.testing.assert_allclose(net.blobs["prob"].data[1:], reference(net, np.zeros((2, D)))[1], rtol=1e-10)
    # an output without the batch axis (a scalar loss) gets one value per batch
    reg = caffe.Net(parse(LOSS), caffe.TRAIN, dtype=np.float64)
    t = np.random.RandomState(2).randn(7, K)
    w = reg.params["ip"][0].data
    out = reg.forward_all(data=x, target=t)
    assert out["loss"].shape == (3,)
    padded_x, padded_t = np.concatenate([x, np.zeros((2, D))]), np.concatenate([t, np.zeros((2, K))])
    per_batch = [((padded_x[i:i + 3] @ w.T - padded_t[i:i + 3]) ** 2).sum() / (2 * 3) for i in (0, 3, 6)]
    np.testing.assert_allclose(out["loss"], per_batch, rtol=1e-6)
    with pytest.raises(CaffeError, match="different lengths"):
        reg.forward_all(data=x, target=t[:5])


def test_backward_diffs_start_end():
    net = deploy_net()
    x = rows(B)
    g = np.random.RandomState(3).randn(B, K)
    net.forward(data=x)
    grads = net.backward(prob=g)
    assert set(grads) == {"data"}
    np.testing.assert_allclose(grads["data"], reference_input_grad(net, x, g), rtol=1e-8)
    grads = net.backward(diffs=["ip2"], prob=g)
    assert set(grads) == {"data", "ip2"}
    pre, prob = reference(net, x)
    np.testing.assert_allclose(grads["ip2"], prob * (g - (g * prob).sum(1, keepdims=True)), rtol=1e-8)
    # end: the bottoms of that layer; start: from there down, with the diffs as they are
    grads = net.backward(end="ip2", prob=g)
    assert set(grads) == {"ip1"}
    w2 = net.params["ip2"][0].data
    np.testing.assert_allclose(grads["ip1"], net.blobs["ip2"].diff @ w2, rtol=1e-8)
    net.blobs["ip1"].diff[...] = 1
    grads = net.backward(start="ip1")
    np.testing.assert_allclose(grads["data"], np.ones((B, H)) @ net.params["ip1"][0].data, rtol=1e-8)


def test_backward_errors():
    net = deploy_net()
    net.forward(data=rows(B))
    with pytest.raises(CaffeError, match=r"backward: 'data' is not an output of net 'mlp' \(outputs: prob\)"):
        net.backward(data=np.zeros((B, D)))
    reg = caffe.Net(parse(LOSS), caffe.TRAIN)
    reg.forward()
    with pytest.raises(CaffeError, match="'loss' is a loss output"):
        reg.backward(loss=np.ones(()))


def test_forward_backward_all():
    net = deploy_net()
    x, g = rows(5), np.random.RandomState(4).randn(5, K)
    outs, grads = net.forward_backward_all(data=x, prob=g)
    np.testing.assert_allclose(outs["prob"], reference(net, x)[1], rtol=1e-10)
    np.testing.assert_allclose(grads["data"], reference_input_grad(net, x, g), rtol=1e-8)
    assert grads["data"].shape == (5, D)
    # a loss net: no output diffs given, its loss drives backward
    reg = caffe.Net(parse("force_backward: true\n" + LOSS), caffe.TRAIN, dtype=np.float64)
    w = reg.params["ip"][0].data
    t = np.random.RandomState(5).randn(5, K)
    outs, grads = reg.forward_backward_all(data=x, target=t)
    assert grads["data"].shape == (5, D) and outs["loss"].shape == (2,)
    # EuclideanLoss over a batch of 3, loss weight 2: d/dx = 2 * (xW' - t) W / 3
    np.testing.assert_allclose(grads["data"], 2 * (x @ w.T - t) @ w / 3, rtol=1e-8)
    with pytest.raises(CaffeError, match="'ip' is neither an input nor an output"):
        reg.forward_backward_all(ip=np.zeros((5, K)))


# ----------------------------------------------------- weights and sharing
def test_share_with():
    net, other = deploy_net(0), deploy_net(1)
    x = rows(B)
    assert not np.allclose(other.forward(data=x)["prob"], net.forward(data=x)["prob"])
    other.share_with(net)
    assert other.params["ip1"][0] is net.params["ip1"][0]
    np.testing.assert_array_equal(other.forward(data=x)["prob"], net.forward(data=x)["prob"])
    net.params["ip2"][1].data[...] += 1                  # one storage: the other net sees it
    np.testing.assert_array_equal(other.params["ip2"][1].data, net.params["ip2"][1].data)


def test_hdf5_and_caffemodel_round_trips(tmp_path):
    net, other = deploy_net(0), deploy_net(1)
    h5 = str(tmp_path / "w.caffemodel.h5")
    net.save_hdf5(h5)
    other.load_hdf5(h5)
    np.testing.assert_array_equal(other.param_data, net.param_data)
    third = deploy_net(2)
    model = str(tmp_path / "w.caffemodel")
    net.save(model)
    third.copy_from(model)                              # a .caffemodel holds float32
    np.testing.assert_array_equal(third.param_data, net.param_data.astype(np.float32))
    # the pycaffe constructor forms load the weights
    path = tmp_path / "deploy.prototxt"
    path.write_text(DEPLOY)
    for loaded in (caffe.Net(str(path), model, caffe.TEST), caffe.Net(str(path), caffe.TEST, weights=model),
                   caffe.Net(str(path), weights=h5, phase=caffe.TEST)):
        np.testing.assert_allclose(loaded.params["ip1"][0].data, net.params["ip1"][0].data, rtol=1e-6)
        assert loaded.phase == caffe.TEST
    # a file whose layer has another number of blobs
    nobias = parse(DEPLOY)
    nobias.layer[3].inner_product_param.bias_term = False
    caffe.set_random_seed(0)
    nobias = caffe.Net(nobias, caffe.TEST)
    with pytest.raises(CaffeError, match=r"layer 'ip2' has 2 parameter blobs, the net expects 1"):
        nobias.load_hdf5(h5)
    with pytest.raises(CaffeError, match="cannot read weights from"):
        net.load_hdf5(str(tmp_path / "missing.h5"))


# ---------------------------------------------------------------- MemoryData
def test_set_input_arrays():
    net = caffe.Net(parse("""
      layer { name: "mem" type: "MemoryData" top: "data" top: "label"
              memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } }
      layer { name: "sil" type: "Silence" bottom: "label" }"""), caffe.TEST)
    data = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2)
    net.set_input_arrays(data, np.array([0, 1, 2, 3], dtype=np.float32))
    first = net.forward()["data"].copy()
    np.testing.assert_array_equal(first, data[:2])
    np.testing.assert_array_equal(net.forward()["data"], data[2:])
    with pytest.raises(CaffeError, match="first layer of net 'mlp' must be MemoryData, it is Input"):
        deploy_net().set_input_arrays(data, np.zeros(4))
