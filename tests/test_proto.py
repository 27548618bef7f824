"""Tests for proto/caffe.proto (wire numbers) and caffempi.io.proto_io."""
import os
from pathlib import Path

import numpy as np
import pytest

from caffempi.io import proto_io
from caffempi.io.proto_io import ProtoError
from caffempi.proto import caffe_pb2
from caffempi.proto.fields import is_required

ZOO = Path(__file__).resolve().parents[1].parent / "shared" / "caffe-zoo"


def _number(msg_cls, field):
    return msg_cls.DESCRIPTOR.fields_by_name[field].number


# --------------------------------------------------------------- schema facts

@pytest.mark.parametrize("msg_cls,field,number", [
    (caffe_pb2.LayerParameter, "name", 1),
    (caffe_pb2.LayerParameter, "type", 2),
    (caffe_pb2.LayerParameter, "blobs", 7),
    (caffe_pb2.LayerParameter, "propagate_down", 11),
    (caffe_pb2.LayerParameter, "transform_param", 100),
    (caffe_pb2.LayerParameter, "loss_param", 101),
    (caffe_pb2.LayerParameter, "convolution_param", 106),
    (caffe_pb2.LayerParameter, "inner_product_param", 117),
    (caffe_pb2.LayerParameter, "pooling_param", 121),
    (caffe_pb2.LayerParameter, "batch_norm_param", 139),
    (caffe_pb2.LayerParameter, "scale_param", 142),
    (caffe_pb2.LayerParameter, "input_param", 143),
    (caffe_pb2.LayerParameter, "recurrent_param", 146),
    (caffe_pb2.LayerParameter, "swish_param", 147),
    (caffe_pb2.LayerParameter, "clip_param", 148),
    (caffe_pb2.NetParameter, "layer", 100),
    (caffe_pb2.NetParameter, "layers", 2),
    (caffe_pb2.NetParameter, "input_shape", 8),
    (caffe_pb2.SolverParameter, "type", 40),
    (caffe_pb2.SolverParameter, "momentum2", 39),
    (caffe_pb2.SolverParameter, "rms_decay", 38),
    (caffe_pb2.SolverParameter, "solver_type", 30),
    (caffe_pb2.SolverParameter, "layer_wise_reduce", 41),
    (caffe_pb2.SolverParameter, "weights", 42),
    (caffe_pb2.SolverState, "current_step", 4),
    (caffe_pb2.BlobProto, "shape", 7),
    (caffe_pb2.BlobProto, "data", 5),
    (caffe_pb2.BlobProto, "double_data", 8),
    (caffe_pb2.Datum, "encoded", 7),
    (caffe_pb2.Datum, "float_data", 6),
    (caffe_pb2.ConvolutionParameter, "dilation", 18),
    (caffe_pb2.PoolingParameter, "round_mode", 13),
    (caffe_pb2.V1LayerParameter, "param", 1001),
    (caffe_pb2.V1LayerParameter, "blobs_lr", 7),
    (caffe_pb2.V0LayerParameter, "hdf5_output_param", 1001),
])
def test_field_numbers_match_bvlc(msg_cls, field, number):
    assert _number(msg_cls, field) == number


def test_enums_and_defaults_match_bvlc():
    S = caffe_pb2.SolverParameter
    assert (S.SGD, S.NESTEROV, S.ADAGRAD, S.RMSPROP, S.ADADELTA, S.ADAM) == (0, 1, 2, 3, 4, 5)
    assert (S.CPU, S.GPU, S.HDF5, S.BINARYPROTO) == (0, 1, 0, 1)
    s = S()
    assert s.type == "SGD" and s.solver_mode == S.GPU
    assert s.snapshot_format == S.BINARYPROTO
    assert abs(s.momentum2 - 0.999) < 1e-6 and abs(s.rms_decay - 0.99) < 1e-6
    assert abs(s.delta - 1e-8) < 1e-12 and s.random_seed == -1
    assert s.clip_gradients == -1 and s.average_loss == 1 and s.iter_size == 1
    assert caffe_pb2.TRAIN == 0 and caffe_pb2.TEST == 1
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.V1LayerParameter.CONVOLUTION == 4
    assert caffe_pb2.V1LayerParameter.SOFTMAX_LOSS == 21
    assert caffe_pb2.V1LayerParameter.ABSVAL == 35
    assert caffe_pb2.FillerParameter().type == "constant"
    assert caffe_pb2.ConvolutionParameter().bias_term is True
    assert abs(caffe_pb2.BatchNormParameter().moving_average_fraction - 0.999) < 1e-6
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.SwishParameter().beta == 1.0
    clip = caffe_pb2.ClipParameter.DESCRIPTOR.fields_by_name
    assert is_required(clip["min"]) and is_required(clip["max"])
    assert (clip["min"].number, clip["max"].number) == (1, 2)


# --------------------------------------------------------------- text parsing

def test_text_parse_error_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  type: "ReLU"\n    foo: 3\n}\n')
    with pytest.raises(ProtoError) as ei:
        proto_io.read_net_param(path)
    msg = str(ei.value)
    assert msg.startswith(str(path) + ":5:5: "), msg
    assert '"foo"' in msg and "caffe.LayerParameter" in msg
    assert "\n" not in msg


def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.prototxt"
    with pytest.raises(ProtoError) as ei:
        proto_io.read_net_param(missing)
    assert str(ei.value) == "cannot read net file %s: No such file or directory" % missing
    with pytest.raises(ProtoError, match="cannot read solver file"):
        proto_io.read_solver_param(missing)


def test_binary_net_param_is_read(tmp_path):
    net = caffe_pb2.NetParameter(name="bin")
    lp = net.layer.add(name="ip", type="InnerProduct")
    proto_io.array_to_blob_proto(np.arange(6, dtype=np.float32).reshape(2, 3), lp.blobs.add())
    path = tmp_path / "w.caffemodel"
    proto_io.write_binary_proto_atomic(path, net)
    back = proto_io.read_net_param(path)
    assert back.name == "bin" and back.layer[0].type == "InnerProduct"
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(back.layer[0].blobs[0]),
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


# --------------------------------------------------------------- upgrades

V1_NET = """
name: "v1net"
layers {
  name: "data" type: DATA top: "data" top: "label"
  data_param { source: "db" batch_size: 4 scale: 0.5 mirror: true }
  include { phase: TRAIN }
}
layers {
  name: "conv1" type: CONVOLUTION bottom: "data" top: "conv1"
  blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  param: "w_shared"
  convolution_param { num_output: 8 kernel_size: 3 }
}
layers { name: "relu1" type: RELU bottom: "conv1" top: "conv1" }
layers {
  name: "loss" type: SOFTMAX_LOSS bottom: "conv1" bottom: "label" top: "loss"
  loss_weight: 2
}
"""


def test_v1_layers_upgrade(tmp_path):
    path = tmp_path / "v1.prototxt"
    path.write_text(V1_NET)
    net = proto_io.read_net_param(path)
    assert len(net.layers) == 0
    assert [l.type for l in net.layer] == ["Data", "Convolution", "ReLU", "SoftmaxWithLoss"]
    data, conv, relu, loss = net.layer
    assert list(data.top) == ["data", "label"]
    assert data.include[0].phase == caffe_pb2.TRAIN
    # legacy transformation fields moved to transform_param
    assert data.transform_param.scale == 0.5 and data.transform_param.mirror
    assert not data.data_param.HasField("scale") and data.data_param.source == "db"
    assert conv.name == "conv1" and list(conv.bottom) == ["data"]
    assert conv.convolution_param.num_output == 8
    assert list(conv.convolution_param.kernel_size) == [3]
    assert len(conv.param) == 2
    assert conv.param[0].name == "w_shared" and not conv.param[1].HasField("name")
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert [p.decay_mult for p in conv.param] == [1, 0]
    assert list(loss.loss_weight) == [2]


def test_v1_and_v2_layers_mixed_is_rejected():
    net = caffe_pb2.NetParameter()
    net.layer.add(name="a", type="ReLU")
    net.layers.add(name="b", type=caffe_pb2.V1LayerParameter.RELU)
    with pytest.raises(ProtoError, match="both 'layer' and 'layers'"):
        proto_io.upgrade_net_param(net, "mixed.prototxt")


def test_v0_is_rejected():
    net = caffe_pb2.NetParameter()
    net.layers.add().layer.name = "old"
    with pytest.raises(ProtoError, match="V0 net format is not supported"):
        proto_io.upgrade_net_param(net, "v0.prototxt")


def test_input_dim_upgrades_to_input_layer(tmp_path):
    path = tmp_path / "deploy.prototxt"
    path.write_text('name: "d"\ninput: "data"\ninput_dim: 10\ninput_dim: 3\n'
                    'input_dim: 227\ninput_dim: 227\n'
                    'input: "aux"\ninput_dim: 10\ninput_dim: 1\ninput_dim: 1\ninput_dim: 5\n'
                    'layer { name: "r" type: "ReLU" bottom: "data" top: "r" }\n')
    net = proto_io.read_net_param(path)
    assert len(net.input) == 0 and len(net.input_dim) == 0
    assert [l.name for l in net.layer] == ["input", "r"]
    inp = net.layer[0]
    assert inp.type == "Input" and list(inp.top) == ["data", "aux"]
    assert [list(s.dim) for s in inp.input_param.shape] == [[10, 3, 227, 227], [10, 1, 1, 5]]


def test_input_shape_upgrades_to_input_layer():
    net = caffe_pb2.NetParameter()
    net.input.append("x")
    net.input_shape.add().dim.extend([2, 7])
    net.layer.add(name="ip", type="InnerProduct", bottom=["x"], top=["y"])
    proto_io.upgrade_net_param(net, "mem")
    assert [l.type for l in net.layer] == ["Input", "InnerProduct"]
    assert list(net.layer[0].input_param.shape[0].dim) == [2, 7]
    assert len(net.input_shape) == 0


def test_input_without_shape_is_dropped():
    net = caffe_pb2.NetParameter()
    net.input.append("data")
    net.layer.add(name="r", type="ReLU")
    proto_io.upgrade_net_param(net, "old.caffemodel")
    assert len(net.input) == 0 and [l.name for l in net.layer] == ["r"]


def test_batchnorm_param_specs_removed():
    net = caffe_pb2.NetParameter()
    bn = net.layer.add(name="bn", type="BatchNorm")
    for _ in range(3):
        bn.param.add(lr_mult=0)
    conv = net.layer.add(name="c", type="Convolution")
    for _ in range(3):
        conv.param.add(lr_mult=0)
    proto_io.upgrade_net_param(net, "bn")
    assert len(net.layer[0].param) == 0
    assert len(net.layer[1].param) == 3


def test_solver_type_upgrade(tmp_path):
    path = tmp_path / "solver.prototxt"
    path.write_text('base_lr: 0.01\nsolver_type: NESTEROV\n')
    s = proto_io.read_solver_param(path)
    assert s.type == "Nesterov" and not s.HasField("solver_type")
    for enum_name, name in [("SGD", "SGD"), ("ADAGRAD", "AdaGrad"), ("RMSPROP", "RMSProp"),
                            ("ADADELTA", "AdaDelta"), ("ADAM", "Adam")]:
        path.write_text("solver_type: %s\n" % enum_name)
        assert proto_io.read_solver_param(path).type == name
    path.write_text('type: "Adam"\n')
    assert proto_io.read_solver_param(path).type == "Adam"
    path.write_text('type: "Adam"\nsolver_type: ADAM\n')
    with pytest.raises(ProtoError, match="cannot both be specified"):
        proto_io.read_solver_param(path)


# --------------------------------------------------------------- zoo files

def _zoo_files():
    if not ZOO.is_dir():
        return []
    return sorted(ZOO.rglob("*.prototxt"))


def test_zoo_prototxts_parse():
    files = _zoo_files()
    if not files:
        pytest.skip("shared/caffe-zoo not present")
    for f in files:
        if "solver" in f.name:
            s = proto_io.read_solver_param(f)
            assert s.type
        else:
            net = proto_io.read_net_param(f)
            assert len(net.layer) > 0, f
            assert len(net.layers) == 0 and len(net.input) == 0, f


# --------------------------------------------------------------- binary I/O

def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "state.solverstate"
    path.write_bytes(b"old contents")
    state = caffe_pb2.SolverState(iter=42, learned_net="x.caffemodel", current_step=3)
    proto_io.write_binary_proto_atomic(path, state)
    assert sorted(os.listdir(tmp_path)) == ["state.solverstate"]
    back = proto_io.read_binary_proto(path, caffe_pb2.SolverState)
    assert back.iter == 42 and back.current_step == 3
    state.iter = 43
    proto_io.write_binary_proto_atomic(str(path), state)
    assert proto_io.read_binary_proto(path, caffe_pb2.SolverState).iter == 43
    assert sorted(os.listdir(tmp_path)) == ["state.solverstate"]


def test_atomic_write_error_names_path(tmp_path):
    target = tmp_path / "no_such_dir" / "w.caffemodel"
    with pytest.raises(ProtoError, match="no_such_dir"):
        proto_io.write_binary_proto_atomic(target, caffe_pb2.NetParameter())


def test_read_binary_proto_errors(tmp_path):
    with pytest.raises(ProtoError, match="missing.binaryproto"):
        proto_io.read_binary_proto(tmp_path / "missing.binaryproto", caffe_pb2.BlobProto)
    bad = tmp_path / "bad.binaryproto"
    bad.write_bytes(b"\xff\xff\xff\xff\xff")
    with pytest.raises(ProtoError, match="bad.binaryproto"):
        proto_io.read_binary_proto(bad, caffe_pb2.BlobProto)


# --------------------------------------------------------------- blobs

@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 3, 4, 5), (3, 0), (70, 80)])
def test_blob_round_trip_shape_form(shape):
    rng = np.random.default_rng(0)
    arr = rng.standard_normal(shape).astype(np.float32)
    diff = rng.standard_normal(shape).astype(np.float32)
    bp = proto_io.array_to_blob_proto(arr, caffe_pb2.BlobProto(), diff=diff)
    assert bp.HasField("shape") and tuple(bp.shape.dim) == shape
    assert not proto_io.is_legacy_blob(bp)
    # the fast path must agree with protobuf's own view of the fields
    np.testing.assert_array_equal(np.asarray(bp.data, np.float32), arr.ravel())
    back = proto_io.blob_proto_to_array(caffe_pb2.BlobProto.FromString(bp.SerializeToString()))
    assert back.dtype == np.float32 and back.shape == shape
    np.testing.assert_array_equal(back, arr)
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(bp, diff=True), diff)


def test_array_to_blob_proto_overwrites_existing():
    bp = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=2)
    bp.data.extend([9, 9, 9, 9])
    proto_io.array_to_blob_proto(np.ones((3,), np.float32), bp)
    assert not proto_io.is_legacy_blob(bp) and list(bp.data) == [1, 1, 1]
    assert len(bp.diff) == 0


@pytest.mark.parametrize("n", [6, 10000])
def test_blob_legacy_form(n):
    bp = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=n // 2)
    values = np.arange(n, dtype=np.float32)
    bp.data.extend(values.tolist())
    assert proto_io.blob_proto_shape(bp) == (1, 1, 2, n // 2)
    arr = proto_io.blob_proto_to_array(bp)
    assert arr.shape == (1, 1, 2, n // 2)
    np.testing.assert_array_equal(arr.ravel(), values)
    assert proto_io.legacy_shape_matches(bp, (2, n // 2))
    assert proto_io.legacy_shape_matches(bp, (1, 2, n // 2))
    assert not proto_io.legacy_shape_matches(bp, (n // 2, 2))
    assert not proto_io.legacy_shape_matches(bp, (1, 1, 1, 2, n // 2))


@pytest.mark.parametrize("n", [4, 9000])
def test_blob_double_data(n):
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.append(n)
    bp.double_data.extend(np.linspace(0, 1, n).tolist())
    arr = proto_io.blob_proto_to_array(bp)
    assert arr.dtype == np.float32
    np.testing.assert_allclose(arr, np.linspace(0, 1, n).astype(np.float32))


def test_blob_count_mismatch_is_error():
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.extend([2, 2])
    bp.data.extend([1, 2, 3])
    with pytest.raises(ProtoError, match="3 values"):
        proto_io.blob_proto_to_array(bp)


def test_non_legacy_shape_must_match_exactly():
    bp = proto_io.array_to_blob_proto(np.zeros((1, 4), np.float32))
    assert proto_io.legacy_shape_matches(bp, (1, 4))
    assert not proto_io.legacy_shape_matches(bp, (4,))


# ------------------------------------------------------------ upgrade tools
OLD_NET = """name: "old"
input: "data" input_dim: 2 input_dim: 3 input_dim: 5 input_dim: 5
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv" blobs_lr: 1 blobs_lr: 2
         convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
layers { name: "ip" type: INNER_PRODUCT bottom: "conv" top: "ip" weight_decay: 0
         inner_product_param { num_output: 2 } }
"""


def test_upgrade_net_text_and_binary_tools(tmp_path):
    from google.protobuf import text_format
    from caffempi import Net, TEST
    from caffempi.tools.upgrade_proto import upgrade_net_proto_binary, upgrade_net_proto_text
    old = tmp_path / "old.prototxt"
    old.write_text(OLD_NET)
    new = tmp_path / "new.prototxt"
    assert upgrade_net_proto_text([str(old), str(new)]) == 0
    # the output is current-format text as written: no V1 layers, no net-level input
    written = text_format.Parse(new.read_text(), caffe_pb2.NetParameter())
    assert len(written.layers) == 0 and len(written.input) == 0 and len(written.input_dim) == 0
    assert [(l.name, l.type) for l in written.layer] == [
        ("input", "Input"), ("conv", "Convolution"), ("relu", "ReLU"), ("ip", "InnerProduct")]
    assert list(written.layer[0].input_param.shape[0].dim) == [2, 3, 5, 5]
    assert [p.lr_mult for p in written.layer[1].param] == [1, 2]
    assert written.layer[3].param[0].decay_mult == 0
    assert written == proto_io.read_net_param(old)          # what caffempi reads from the old file
    # binary: a V1 .caffemodel keeps its weights
    net = Net(str(old), phase=TEST)
    net.params["conv"][0].data[...] = np.arange(108, dtype=np.float32).reshape(4, 3, 3, 3)
    v1 = caffe_pb2.NetParameter()
    for lp in net.to_proto().layer:
        if lp.blobs:
            v = v1.layers.add(name=lp.name, type=caffe_pb2.V1LayerParameter.CONVOLUTION
                              if lp.type == "Convolution" else caffe_pb2.V1LayerParameter.INNER_PRODUCT)
            v.blobs.extend(lp.blobs)
    old_model, new_model = tmp_path / "old.caffemodel", tmp_path / "new.caffemodel"
    old_model.write_bytes(v1.SerializeToString())
    assert upgrade_net_proto_binary([str(old_model), str(new_model)]) == 0
    up = proto_io.read_binary_proto(new_model, caffe_pb2.NetParameter)
    assert len(up.layers) == 0 and [l.type for l in up.layer] == ["Convolution", "InnerProduct"]
    fresh = Net(str(new), phase=TEST, weights=str(new_model))
    for name in ("conv", "ip"):
        for a, b in zip(fresh.params[name], net.params[name]):
            np.testing.assert_array_equal(a.data, b.data)


def test_upgrade_solver_tool_and_current_files(tmp_path, capsys):
    from caffempi.tools.upgrade_proto import upgrade_net_proto_text, upgrade_solver_proto_text
    old = tmp_path / "solver.prototxt"
    old.write_text('net: "n.prototxt" base_lr: 0.1 solver_type: NESTEROV momentum: 0.9\n')
    new = tmp_path / "solver_new.prototxt"
    assert upgrade_solver_proto_text([str(old), str(new)]) == 0
    s = proto_io.read_text_proto(new, caffe_pb2.SolverParameter, "solver")
    assert s.type == "Nesterov" and not s.HasField("solver_type") and s.momentum == pytest.approx(0.9)
    assert "already in latest" not in capsys.readouterr().err
    # a current file is copied unchanged, and said to be current
    again = tmp_path / "again.prototxt"
    assert upgrade_solver_proto_text([str(new), str(again)]) == 0
    assert "File already in latest proto format: %s" % new in capsys.readouterr().err
    assert again.read_text() == new.read_text()
    # bad input: one line naming file and line, status 1, nothing written
    bad = tmp_path / "bad.prototxt"
    bad.write_text('layer { name: "x" type: "ReLU" bogus: 1 }\n')
    assert upgrade_net_proto_text([str(bad), str(tmp_path / "out.prototxt")]) == 1
    err = capsys.readouterr().err
    assert "bad.prototxt:1" in err and "bogus" in err
    assert not (tmp_path / "out.prototxt").exists()
