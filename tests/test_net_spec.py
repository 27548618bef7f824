"""NetSpec (pycaffe's caffe.NetSpec with L = caffe.layers, P = caffe.params):
BVLC's LeNet written with it builds a Net whose structure is models/'s
LeNet; pycaffe's naming, ntop, in_place, kwargs routing, repeated fields,
enums, include rules; clear errors."""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi as caffe
from caffempi import layers as L, params as P
from caffempi.common import CaffeError
from caffempi.data import lmdb_io
from caffempi.data.datum import array_to_datum
from caffempi.io import proto_io
from caffempi.net import filter_net
from caffempi.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models" / "mnist"


def lenet(lmdb, batch_size):
    """BVLC's examples/01-learning-lenet.ipynb's lenet(), as
    examples/pycaffe/learning_lenet.py has it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("learning_lenet",
                                                  REPO / "examples" / "pycaffe" / "learning_lenet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lenet(lmdb, batch_size)


def structure(net_param):
    """Per layer: type, the index of the layer producing each bottom, top count."""
    producer, out = {}, []
    for i, lp in enumerate(net_param.layer):
        out.append((lp.type, tuple(producer[b] for b in lp.bottom), len(lp.top)))
        for t in lp.top:
            producer[t] = i
    return out


def hyper_params(lp):
    """What shapes a LeNet layer's output, by type."""
    if lp.type == "Convolution":
        c = lp.convolution_param
        return c.num_output, list(c.kernel_size), list(c.stride) or [1]
    if lp.type == "Pooling":
        return lp.pooling_param.pool, lp.pooling_param.kernel_size, lp.pooling_param.stride
    if lp.type == "InnerProduct":
        return lp.inner_product_param.num_output
    return lp.type


def tiny_lmdb(path, n=4):
    rs = np.random.RandomState(0)
    with lmdb_io.LMDBWriter(path) as w:
        for i in range(n):
            w.put("%08d" % i, array_to_datum(rs.randint(0, 256, (1, 28, 28)).astype(np.uint8), i % 10)
                  .SerializeToString())
    return str(path)


def test_lenet_from_the_notebook_matches_models_lenet(tmp_path):
    proto = lenet(tiny_lmdb(tmp_path / "train_lmdb"), 2)
    # the text pycaffe users write to disk parses back to the same net
    assert text_format.Parse(str(proto), caffe_pb2.NetParameter()) == proto
    assert [lp.name for lp in proto.layer] == ["data", "conv1", "pool1", "conv2", "pool2", "fc1", "relu1",
                                               "score", "loss"]
    relu = proto.layer[6]
    assert list(relu.bottom) == list(relu.top) == ["fc1"]
    assert proto.layer[0].data_param.backend == caffe_pb2.DataParameter.LMDB
    assert proto.layer[0].data_param.batch_size == 2
    assert proto.layer[0].transform_param.scale == pytest.approx(1 / 255.)
    assert proto.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert list(proto.layer[1].convolution_param.kernel_size) == [5]

    ref = proto_io.read_net_param(str(MODELS / "lenet_train_test.prototxt"))
    ref.state.phase = caffe.TRAIN
    ref = filter_net(ref)
    assert structure(proto) == structure(ref)
    assert [hyper_params(lp) for lp in proto.layer[1:]] == [hyper_params(lp) for lp in ref.layer[1:]]

    net = caffe.Net(proto, caffe.TRAIN)
    deploy = caffe.Net(str(MODELS / "lenet.prototxt"), caffe.TEST)
    assert len(net.layers) == 9
    assert [[b.shape for b in blobs] for blobs in net.params.values()] == \
           [[b.shape for b in blobs] for blobs in deploy.params.values()]
    assert net.blobs["data"].shape == (2, 1, 28, 28)
    loss = float(net.forward()["loss"])
    assert np.isfinite(loss) and loss > 0


def test_anonymous_tops_get_pycaffe_names():
    data, label = L.DummyData(shape=[dict(dim=[2, 1, 8, 8]), dict(dim=[2])], ntop=2)
    conv = L.Convolution(data, kernel_size=3, num_output=2)
    pool = L.Pooling(conv, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    ip = L.InnerProduct(L.Convolution(pool, kernel_size=1, num_output=2), num_output=3)
    relu = L.ReLU(ip, in_place=True)
    loss = L.SoftmaxWithLoss(relu, label)
    proto = loss.to_proto()
    assert [(lp.name, list(lp.bottom), list(lp.top)) for lp in proto.layer] == [
        ("DummyData1", [], ["DummyData1", "DummyData2"]),
        ("Convolution1", ["DummyData1"], ["Convolution1"]),
        ("Pooling1", ["Convolution1"], ["Pooling1"]),
        ("Convolution2", ["Pooling1"], ["Convolution2"]),
        ("InnerProduct1", ["Convolution2"], ["InnerProduct1"]),
        ("ReLU1", ["InnerProduct1"], ["InnerProduct1"]),
        ("SoftmaxWithLoss1", ["InnerProduct1", "DummyData2"], ["SoftmaxWithLoss1"]),
    ]
    assert caffe.to_proto(loss) == proto
    assert caffe.Net(proto, caffe.TEST).blobs["InnerProduct1"].shape == (2, 3)


def test_zero_tops_and_multiple_tops():
    n = caffe.NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=3), ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    n.silence_data2 = L.Silence(n.data2, ntop=0)
    proto = n.to_proto()
    assert [(lp.name, list(lp.bottom), list(lp.top)) for lp in proto.layer] == [
        ("data", [], ["data", "data2"]), ("silence_data", ["data"], []), ("silence_data2", ["data2"], [])]
    assert list(proto.layer[0].dummy_data_param.shape[0].dim) == [3]     # a single dict: a repeated field
    net = caffe.Net(proto, caffe.TEST)
    assert len(net.forward()) == 0
    # a top-less layer nobody names gets the type's counter
    anon = caffe.to_proto(L.Eltwise(n.data, n.data2, operation=P.Eltwise.SUM))
    assert anon.layer[-1].name == "Eltwise1"


def test_kwargs_routing_param_lists_include_and_enums():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.ip = L.InnerProduct(n.data, num_output=4, param=[dict(lr_mult=1), dict(lr_mult=2, decay_mult=0)],
                          weight_filler=caffe_pb2.FillerParameter(type="gaussian", std=0.1),
                          bias_filler=dict(type="constant", value=0.5), loss_weight=0,
                          include=dict(phase=caffe.TRAIN))
    n.pool = L.Pooling(L.Reshape(n.data, shape=dict(dim=[2, 1, 1, 3])), pool="AVE", kernel_h=1, kernel_w=3,
                       exclude=[dict(phase="TRAIN")], propagate_down=[False])
    n.py = L.Python(n.data, module="mod", layer="Cls", param_str="{'k': 1}", name="pylayer")
    n.deconv = L.Deconvolution(L.Reshape(n.data, shape=dict(dim=[2, 3, 1, 1])), num_output=2,
                               kernel_size=[1, 1], bias_term=False)
    proto = n.to_proto()
    ip, pool, py, deconv = (next(lp for lp in proto.layer if lp.type == t)
                            for t in ("InnerProduct", "Pooling", "Python", "Deconvolution"))
    assert [(p.lr_mult, p.decay_mult) for p in ip.param] == [(1, 1), (2, 0)]
    assert ip.inner_product_param.weight_filler.std == pytest.approx(0.1)
    assert ip.inner_product_param.bias_filler.value == 0.5
    assert list(ip.loss_weight) == [0] and ip.include[0].phase == caffe.TRAIN
    assert pool.pooling_param.pool == P.Pooling.AVE == caffe_pb2.PoolingParameter.AVE
    assert pool.exclude[0].phase == caffe.TRAIN and list(pool.propagate_down) == [False]
    assert (py.name, py.python_param.module, py.python_param.layer, py.python_param.param_str) == \
           ("pylayer", "mod", "Cls", "{'k': 1}")
    assert list(deconv.convolution_param.kernel_size) == [1, 1]
    assert deconv.convolution_param.bias_term is False
    assert (P.Data.LMDB, P.Eltwise.SUM, P.Eltwise.PROD) == (caffe_pb2.DataParameter.LMDB,
                                                          caffe_pb2.EltwiseParameter.SUM,
                                                          caffe_pb2.EltwiseParameter.PROD)

    # the explicit forms: python_param=dict(...), convolution_param=dict(...), as pycaffe scripts write them
    explicit = caffe.to_proto(
        L.Python(n.data, python_param=dict(module="mod", layer="Cls", param_str="p", share_in_parallel=True)),
        L.Convolution(L.Reshape(n.data, shape=dict(dim=[2, 3, 1, 1])), param=[dict(lr_mult=3)], loss_weight=0.5,
                      convolution_param=dict(num_output=5, kernel_size=1, weight_filler=dict(type="xavier"))))
    epy, econv = (next(lp for lp in explicit.layer if lp.type == t) for t in ("Python", "Convolution"))
    assert (epy.python_param.module, epy.python_param.layer, epy.python_param.param_str,
            epy.python_param.share_in_parallel) == ("mod", "Cls", "p", True)
    assert (econv.convolution_param.num_output, list(econv.convolution_param.kernel_size),
            econv.convolution_param.weight_filler.type) == (5, [1], "xavier")
    assert [p.lr_mult for p in econv.param] == [3] and list(econv.loss_weight) == [0.5]

    del n.tops["py"]                      # no such module: keep it out of the built nets
    train, test = caffe.Net(n.to_proto(), caffe.TRAIN), caffe.Net(n.to_proto(), caffe.TEST)
    assert "ip" in train.layer_dict and "ip" not in test.layer_dict
    assert "pool" in test.layer_dict and "pool" not in train.layer_dict
    assert [b.shape for b in train.params["ip"]] == [(4, 3), (4,)]
    assert train.param_lr_mults[:2] == [1, 2]


def test_netspec_item_access_and_in_place_chain():
    n = caffe.NetSpec()
    n["data"] = L.Input(shape=dict(dim=[1, 4]))
    n.relu = L.ReLU(n.data, in_place=True)
    n.drop = L.Dropout(n.relu, dropout_ratio=0.5, in_place=True)
    assert n["relu"] is n.relu
    proto = n.to_proto()
    assert [(lp.name, list(lp.top)) for lp in proto.layer] == [("data", ["data"]), ("relu", ["data"]),
                                                               ("drop", ["data"])]
    assert proto.layer[2].dropout_param.dropout_ratio == pytest.approx(0.5)
    with pytest.raises(AttributeError, match="no top 'nope'"):
        n.nope


def test_errors_are_clear():
    data = L.DummyData(ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    L.Silence(*data, ntop=0)
    with pytest.raises(CaffeError, match=r"NetSpec layer 'conv' \(Convolution\): no field 'kernal_size' "
                                         r"in convolution_param or LayerParameter"):
        n = caffe.NetSpec()
        n.conv = L.Convolution(data[0], kernal_size=3)
        n.to_proto()
    with pytest.raises(CaffeError, match=r"'pool'.*'MAXX' is no value of PoolMethod \(MAX, AVE, STOCHASTIC\)"):
        n = caffe.NetSpec()
        n.pool = L.Pooling(data[0], pool="MAXX")
        n.to_proto()
    with pytest.raises(CaffeError, match=r"ConvolutionParameter.num_output: cannot take 'ten'"):
        caffe.to_proto(L.Convolution(data[0], num_output="ten"))
    with pytest.raises(CaffeError, match="FillerParameter is given as a dict"):
        caffe.to_proto(L.Convolution(data[0], weight_filler="xavier"))
    with pytest.raises(CaffeError, match="'pair' is given 2 tops"):
        n = caffe.NetSpec()
        n.pair = L.DummyData(ntop=2)
    with pytest.raises(CaffeError, match="ntop must be a non-negative int"):
        L.ReLU(data[0], ntop=-1)
    with pytest.raises(AttributeError, match="PoolingParameter has no enum value 'MAXIMUM'"):
        P.Pooling.MAXIMUM
    with pytest.raises(AttributeError, match="no message NopeParameter"):
        P.Nope.X
