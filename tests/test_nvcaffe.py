"""NVCaffe (Caffe-MPI 2.0) files: BlobProto raw_data in caffemodels, means and
solverstates; a prototxt and solver with NVCaffe's fields (parsed, trained a
step, ignored fields reported); the learning-rate warm-up and floor; Data
shuffle/cache/threads; NVCaffe's clashing field numbers in binary files; and
docs/nvcaffe.md against caffempi.io.nvcaffe."""
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import CaffeError, Net, TEST, TRAIN
from caffempi.common import log
from caffempi.data import db
from caffempi.data.datum import array_to_datum
from caffempi.data.transformer import load_mean_file
from caffempi.io import nvcaffe, proto_io
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver, lr_policy

DOCS = Path(__file__).resolve().parents[1] / "docs" / "nvcaffe.md"
NP_TYPES = {caffe_pb2.FLOAT16: "<f2", caffe_pb2.FLOAT: "<f4", caffe_pb2.DOUBLE: "<f8"}


@pytest.fixture
def logged_warnings():
    """The messages caffempi logs at WARNING inside the test."""
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    log.addHandler(handler)
    yield messages
    log.removeHandler(handler)


def raw_blob(values, raw_type, shape, raw=None):
    """A BlobProto as NVCaffe writes it: N-d shape, values as raw bytes."""
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.extend(shape)
    bp.raw_data_type = raw_type
    bp.raw_data = raw if raw is not None else np.asarray(values, NP_TYPES[raw_type]).tobytes()
    return bp


IP_NET = '''layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }'''


def caffemodel(tmp_path, weight, bias):
    model = caffe_pb2.NetParameter(name="nv")
    layer = model.layer.add(name="ip", type="InnerProduct")
    layer.blobs.extend([weight, bias])
    path = tmp_path / "nv.caffemodel"
    path.write_bytes(model.SerializeToString())
    return str(path)


def ip_net():
    return Net(text_format.Parse(IP_NET, caffe_pb2.NetParameter()), TEST)


def test_caffemodel_with_float16_and_float_raw_data(tmp_path):
    exact = [0.5, -1.25, 3.0, 1024.0, 2.0 ** -14]           # float16 numbers
    weight = raw_blob(exact + [0.1], caffe_pb2.FLOAT16, (2, 3))
    bias = raw_blob([0.1, -7.5], caffe_pb2.FLOAT, (2,))
    net = ip_net()
    net.copy_from(caffemodel(tmp_path, weight, bias))
    w, b = (p.data for p in net.params["ip"])
    np.testing.assert_array_equal(w.reshape(-1)[:5], np.float32(exact))
    rounded = np.float32(np.float16(0.1))                     # 0.0999755859375, as numpy rounds
    assert w.reshape(-1)[5] == rounded and rounded != np.float32(0.1)
    np.testing.assert_array_equal(b, np.float32([0.1, -7.5]))
    # the forward pass uses them
    net.blobs["x"].data[...] = [[1, 2, 3]]
    net.forward()
    np.testing.assert_allclose(net.blobs["y"].data, [[0.5 - 2.5 + 9 + 0.1, 1024 + 2 * 2.0 ** -14 + 3 * rounded - 7.5]],
                               rtol=1e-6)


def test_double_raw_data_and_raw_diff():
    bp = raw_blob([1 / 3, -2.5, 1e-3, 7.0], caffe_pb2.DOUBLE, (2, 2))
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(bp), np.float32([[1 / 3, -2.5], [1e-3, 7.0]]))
    bp.raw_diff_type = caffe_pb2.FLOAT16
    bp.raw_diff = np.float16([1, 2, 3, 0.1]).tobytes()
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(bp, diff=True),
                                  np.float16([[1, 2], [3, 0.1]]).astype(np.float32))
    bp.data.extend([9, 9, 9, 9])              # float data comes first, as in NVCaffe's Blob::FromProto
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(bp), np.full((2, 2), 9, np.float32))


def test_raw_data_errors(tmp_path):
    bias = raw_blob([0, 0], caffe_pb2.FLOAT, (2,))
    short = raw_blob(None, caffe_pb2.FLOAT16, (2, 3), raw=np.float16([1, 2, 3, 4, 5]).tobytes())
    with pytest.raises(CaffeError) as e:
        ip_net().copy_from(caffemodel(tmp_path, short, bias))
    msg = str(e.value)
    assert "nv.caffemodel: layer 'ip' param 0: blob raw_data holds 10 bytes but shape (2, 3) needs 6 " \
           "FLOAT16 values (12 bytes)" in msg and "\n" not in msg
    ints = raw_blob([1, 2, 3, 4, 5, 6], caffe_pb2.FLOAT, (2, 3))
    ints.raw_data_type = caffe_pb2.INT
    with pytest.raises(CaffeError, match="param 0: blob raw_data has type INT; only FLOAT16, FLOAT and DOUBLE"):
        ip_net().copy_from(caffemodel(tmp_path, ints, bias))
    untyped = raw_blob([1, 2, 3, 4, 5, 6], caffe_pb2.FLOAT, (2, 3))
    untyped.ClearField("raw_data_type")
    with pytest.raises(CaffeError, match="param 0: blob has raw_data but no raw_data_type"):
        ip_net().copy_from(caffemodel(tmp_path, untyped, bias))


def test_mean_file_with_float16_raw_data(tmp_path):
    mean = np.float16([[[1.5, 2.0], [100.0, 0.1]]])
    bp = raw_blob(mean, caffe_pb2.FLOAT16, (1, 1, 2, 2))
    path = tmp_path / "mean.binaryproto"
    path.write_bytes(bp.SerializeToString())
    np.testing.assert_array_equal(load_mean_file(str(path)), mean.astype(np.float32))
    # a bad raw blob: one line naming the mean file
    bp.raw_data = bp.raw_data[:-2]
    path.write_bytes(bp.SerializeToString())
    with pytest.raises(CaffeError) as e:
        load_mean_file(str(path))
    assert str(e.value).startswith("mean file %s: " % path) and "\n" not in str(e.value), str(e.value)


SOLVER_NET = '''name: "tiny"
layer { name: "d" type: "DummyData" top: "x" top: "t"
        dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
                           data_filler { type: "gaussian" } data_filler { type: "gaussian" } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }'''


def test_solverstate_history_in_raw_data(tmp_path):
    sp = text_format.Parse('base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 max_iter: 3 random_seed: 2 '
                           'solver_mode: CPU snapshot_prefix: "%s"' % (tmp_path / "snap"), caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(text_format.Parse(SOLVER_NET, caffe_pb2.NetParameter()))
    solver = get_solver(sp)
    solver.step(3)
    solver.snapshot()
    state_path = tmp_path / "snap_iter_3.solverstate"
    state = caffe_pb2.SolverState()
    state.ParseFromString(state_path.read_bytes())
    for h, raw_type in zip(state.history, (caffe_pb2.FLOAT, caffe_pb2.DOUBLE)):   # as NVCaffe stores them
        values = np.asarray(h.data, np.float32)
        h.ClearField("data")
        h.raw_data_type = raw_type
        h.raw_data = values.astype(NP_TYPES[raw_type]).tobytes()
    state_path.write_bytes(state.SerializeToString())
    resumed = get_solver(sp)
    resumed.restore(str(state_path))
    assert np.any(solver.history[0] != 0)
    np.testing.assert_array_equal(resumed.history[0], solver.history[0])


def test_nvcaffe_fields_numbers_in_binary_files():
    """BVLC's numbers win: NVCaffe's forward_type (LayerParameter 145, a
    varint) meets BVLC's parameter_param (a message) and is skipped;
    NVCaffe's rampup_interval (SolverParameter 41) reads as BVLC's
    layer_wise_reduce; rampup_lr (42, a float) meets weights (strings) and is
    skipped.  Ours are written under numbers NVCaffe does not use."""
    nv_layer = caffe_pb2.LayerParameter(name="conv").SerializeToString() + bytes([(145 << 3) & 0x7F | 0x80, 145 >> 4, 2])
    layer = caffe_pb2.LayerParameter()
    layer.ParseFromString(nv_layer)
    assert layer.name == "conv" and not layer.HasField("parameter_param") and not layer.HasField("forward_type")
    nv_solver = bytes([(41 << 3) & 0x7F | 0x80, 41 >> 4, 100, (42 << 3 | 5) & 0x7F | 0x80, 42 >> 4]) + \
        np.float32(0.5).tobytes()
    solver = caffe_pb2.SolverParameter()
    solver.ParseFromString(nv_solver)
    assert solver.HasField("layer_wise_reduce") and solver.layer_wise_reduce
    assert not solver.HasField("rampup_interval") and not solver.HasField("rampup_lr") and not solver.weights
    numbers = {f.name: f.number for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields}
    assert [numbers[n] for n in ("forward_type", "backward_type", "forward_math", "backward_math")] == \
        [5145, 5146, 5147, 5148]
    numbers = {f.name: f.number for f in caffe_pb2.SolverParameter.DESCRIPTOR.fields}
    assert (numbers["rampup_interval"], numbers["rampup_lr"], numbers["min_lr"]) == (5041, 5042, 43)


def lr(text, it, current_step=0):
    return lr_policy.learning_rate(text_format.Parse(text, caffe_pb2.SolverParameter()), it, current_step,
                                   info=lambda *a: None)[0]


def test_rampup_and_min_lr():
    ramp = 'base_lr: 0.5 rampup_interval: 8 rampup_lr: 0.1 '
    for it in range(8):          # NVCaffe: rampup_lr + (base_lr - rampup_lr) * (it / interval)^2, any policy
        want = np.float32(np.float32(0.1) + (np.float32(0.5) - np.float32(0.1)) * (it / 8) ** 2)
        for policy in ('lr_policy: "fixed"', 'lr_policy: "step" gamma: 0.1 stepsize: 2'):
            assert lr(ramp + policy, it) == pytest.approx(want, rel=1e-6)
    assert lr(ramp + 'lr_policy: "step" gamma: 0.1 stepsize: 4', 8) == pytest.approx(0.5 * 0.1 ** 2, rel=1e-6)
    assert lr('base_lr: 0.5 rampup_interval: 8 lr_policy: "fixed"', 2) == pytest.approx(0.5 / 16)
    floor = 'base_lr: 1 lr_policy: "step" gamma: 0.1 stepsize: 1 min_lr: 0.005 '
    assert [lr(floor, it) for it in range(4)] == pytest.approx([1, 0.1, 0.01, 0.005])
    poly = 'base_lr: 1 lr_policy: "poly" power: 2 max_iter: 10 min_lr: 0.2 '
    for it in (0, 3, 10):
        assert lr(poly, it) == pytest.approx((1 - 0.2) * (1 - it / 10) ** 2 + 0.2, rel=1e-6)
    for bad in ('base_lr: 1 lr_policy: "fixed" min_lr: -1', 'base_lr: 0.1 lr_policy: "poly" max_iter: 5 min_lr: 1'):
        with pytest.raises(CaffeError, match="min_lr"):
            lr_policy.check_policy(text_format.Parse(bad, caffe_pb2.SolverParameter()))


NV_NET = '''name: "nv"
default_forward_type: FLOAT16
default_backward_type: FLOAT16
global_grad_scale: 8
eltwise_mem_sharing: true
layer { name: "d" type: "Data" top: "data" top: "label"
        transform_param { scale: 0.00390625 }
        data_param { source: "%s" batch_size: 4 backend: LMDB threads: 3 parser_threads: 2 cache: true
                     shuffle: true } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" forward_type: FLOAT16 backward_type: FLOAT16
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "bn"
        batch_norm_param { moving_average_fraction: 0.9 eps: 0.0001 scale_bias: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "bn" bottom: "label" top: "loss" }
'''

NV_SOLVER = '''net: "train_val.prototxt"
base_lr: 0.5
lr_policy: "poly"
power: 2
max_iter: 10
rampup_interval: 4
rampup_lr: 0.1
min_lr: 0.01
momentum: 0.9
larc: true
larc_policy: "clip"
larc_eta: 0.002
solver_data_type: FLOAT16
random_seed: 1
solver_mode: CPU
'''


def small_lmdb(path, n=10, labels=None):
    rs = np.random.RandomState(3)
    with db.open_writer(str(path), "lmdb") as w:
        for i in range(n):
            label = i if labels is None else labels[i]
            w.put("%08d" % i, array_to_datum(rs.randint(0, 256, (1, 2, 2)).astype(np.uint8), label)
                  .SerializeToString())
    return str(path)


def close(net):
    for layer in net.layers:
        if hasattr(layer, "close"):
            layer.close()


def test_nvcaffe_prototxt_parses_and_trains_a_step(tmp_path, logged_warnings):
    source = small_lmdb(tmp_path / "train_lmdb", labels=[i % 4 for i in range(10)])
    (tmp_path / "train_val.prototxt").write_text(NV_NET % source)
    (tmp_path / "solver.prototxt").write_text(NV_SOLVER)
    solver = get_solver(str(tmp_path / "solver.prototxt"))
    net = solver.net
    before = {name: [p.data.copy() for p in params] for name, params in net.params.items()}
    assert solver.get_learning_rate() == pytest.approx(0.1)      # rampup_lr at iteration 0
    solver.step(1)
    assert solver.iter == 1 and np.isfinite(float(net.blobs["loss"].data))
    bn = net.params["bn"]
    assert len(bn) == 5 and bn[2].data[0] == 1                   # statistics gathered once
    for k in (0, 3, 4):                                           # mean, scale, bias moved
        assert not np.array_equal(bn[k].data, before["bn"][k]), k
    assert not np.array_equal(net.params["ip"][0].data, before["ip"][0])
    assert solver.get_learning_rate() == pytest.approx(0.1 + 0.4 / 16, rel=1e-6)
    assert net.layer("d")._prefetcher.workers == 3               # threads: the layer's decode threads
    text = "\n".join(logged_warnings)
    for field in ("NetParameter.default_forward_type", "NetParameter.global_grad_scale",
                  "LayerParameter.forward_type", "LayerParameter.backward_type", "DataParameter.parser_threads",
                  "SolverParameter.larc", "SolverParameter.larc_policy", "SolverParameter.solver_data_type"):
        assert field in text, field
    for field in ("min_lr", "rampup", "DataParameter.threads", "cache", "scale_bias",
                  "eltwise_mem_sharing"):    # honoured, or set to the default
        assert field not in text, field
    close(net)
    for tn in solver.test_nets:
        close(tn)


def test_refused_nvcaffe_fields_name_the_field(tmp_path):
    for text, field in (('layer { name: "bn" type: "BatchNorm" batch_norm_param { engine: CUDNN } }', "engine"),
                        ('layer { name: "t" type: "TRT" trt_param { top_k: 1 } }', "trt_param"),
                        ('layer { name: "c" type: "ReLU" debug: true }', "debug")):
        path = tmp_path / "refused.prototxt"
        path.write_text(text)
        with pytest.raises(CaffeError, match=r"refused.prototxt:1:\d+: .*%s" % field) as e:
            Net(str(path), TRAIN)
        assert "\n" not in str(e.value)


def shuffle_net(source, batch, shard=(0, 1), extra="cache: true shuffle: true"):
    p = text_format.Parse('''layer { name: "d" type: "Data" top: "data" top: "label"
        data_param { source: "%s" batch_size: %d backend: LMDB %s } }''' % (source, batch, extra),
                          caffe_pb2.NetParameter())
    return Net(p, TRAIN, data_shard=shard)


def labels_of(net, n):
    out = []
    for _ in range(n):
        net.forward()
        out.append(net.blobs["label"].data.astype(int).copy())
    return out


def test_shuffle_with_cache_every_epoch_after_the_first(tmp_path, logged_warnings):
    source = small_lmdb(tmp_path / "s_lmdb")
    net = shuffle_net(source, 5)
    epochs = [np.concatenate(labels_of(net, 2)) for _ in range(3)]
    close(net)
    np.testing.assert_array_equal(epochs[0], np.arange(10))          # read in key order while caching
    for e in (1, 2):
        assert sorted(epochs[e]) == list(range(10)) and not np.array_equal(epochs[e], np.arange(10))
    assert not np.array_equal(epochs[1], epochs[2])
    # two ranks: each global batch is the single process's, split disjointly
    nets = [shuffle_net(source, 4)] + [shuffle_net(source, 2, shard=(r, 2)) for r in range(2)]
    single = np.concatenate(labels_of(nets[0], 10))
    ranks = [np.stack(labels_of(net, 10)) for net in nets[1:]]
    for net in nets:
        close(net)
    for k in range(10):
        np.testing.assert_array_equal(ranks[0][k], single[4 * k:4 * k + 4][0::2])
        np.testing.assert_array_equal(ranks[1][k], single[4 * k:4 * k + 4][1::2])
    assert not logged_warnings
    # without cache NVCaffe ignores shuffle; so do we, saying so
    plain = shuffle_net(source, 5, extra="shuffle: true")
    assert np.array_equal(np.concatenate(labels_of(plain, 4)), np.arange(20) % 10)
    close(plain)
    assert any("shuffle is ignored without cache" in w for w in logged_warnings)


def doc_table():
    """{"Message.field": status} from the rows of docs/nvcaffe.md's tables."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`(\w+)\.(\w+)`\s*\|\s*(honoured|ignored|refused|skipped)\b", line)
        if m:
            rows["%s.%s" % m.group(1, 2)] = m.group(3)
    return rows


def test_docs_table_matches_the_code():
    rows = doc_table()
    for status, table in (("honoured", nvcaffe.HONOURED), ("ignored", nvcaffe.IGNORED)):
        for message, fields in table.items():
            descriptor = getattr(caffe_pb2, message).DESCRIPTOR
            for field in fields:
                assert field in descriptor.fields_by_name, (message, field)
                assert rows.pop("%s.%s" % (message, field), None) == status, (message, field)
    assert rows and set(rows.values()) == {"refused", "skipped"}, rows   # the rest: not in ...
    for name in rows:                                                       # ... the schema
        message, field = name.split(".")
        cls = getattr(caffe_pb2, message, None)
        assert cls is None or field not in cls.DESCRIPTOR.fields_by_name, name
