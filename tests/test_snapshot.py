"""Snapshots and resume: bitwise-exact resume, Caffe's .caffemodel /
.solverstate wire format both ways (legacy 4-D and N-d blob shapes), HDF5
snapshots, signal actions and never snapshotting bad weights."""
import json
import os

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, message_factory, text_format
from google.protobuf import descriptor_pool

from caffempi import common
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2
from caffempi.solvers import SolverAction, get_solver

from test_solvers import BATCHES, tiny_net  # noqa: F401  (registers TestSeqData)

NOISY_NET = """name: "noisy"
layer { name: "data" type: "TestSeqData" top: "x" top: "y" }
layer { name: "noise" type: "DummyData" top: "n"
  dummy_data_param { shape { dim: 4 dim: 3 } data_filler { type: "gaussian" std: 0.1 } } }
layer { name: "sum" type: "Eltwise" bottom: "x" bottom: "n" top: "xn" }
layer { name: "ip" type: "InnerProduct" bottom: "xn" top: "p"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "drop" type: "Dropout" bottom: "p" top: "pd" dropout_param { dropout_ratio: 0.3 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "pd" bottom: "y" top: "loss" }
"""


def solver_param(tmp_path, text, net=NOISY_NET):
    sp = text_format.Merge(text, caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(text_format.Parse(net, caffe_pb2.NetParameter()))
    sp.random_seed = 11
    sp.snapshot_prefix = str(tmp_path / "snap")
    return sp


RESUME = ('base_lr: 0.05 lr_policy: "step" gamma: 0.7 stepsize: 3 max_iter: 10 display: 1 '
          'average_loss: 3 test_iter: 2 test_interval: 3 weight_decay: 0.001 ')


@pytest.mark.parametrize("kind,fmt", [('type: "SGD" momentum: 0.9', "BINARYPROTO"),
                                      ('type: "Adam" momentum: 0.9', "BINARYPROTO"),
                                      ('type: "Nesterov" momentum: 0.9', "HDF5")])
def test_resume_is_bitwise_exact(tmp_path, kind, fmt):
    sp = solver_param(tmp_path, RESUME + kind + " snapshot_format: " + fmt)
    straight = get_solver(sp)
    straight.step(10)

    first = get_solver(sp)
    first.step(5)
    model = first.snapshot()
    ext = ".solverstate.h5" if fmt == "HDF5" else ".solverstate"
    state = str(tmp_path / ("snap_iter_5" + ext))
    assert os.path.exists(model) and os.path.exists(state)

    common.set_random_seed(999)            # a fresh process would have another state
    resumed = get_solver(sp)
    common.set_random_seed(12345)
    resumed.restore(state)
    assert resumed.iter == 5
    resumed.step(5)
    assert np.array_equal(resumed.net.param_data, straight.net.param_data)
    for a, b in zip(resumed.history, straight.history):
        assert np.array_equal(a, b)
    assert resumed.smoothed_loss == straight.smoothed_loss


def test_caffemodel_and_solverstate_in_caffe_format(tmp_path):
    """Our files parse with the plain schema: Caffe's fields, Caffe's layout
    (history: one blob per param; Adam: all m's then all v's)."""
    sp = solver_param(tmp_path, RESUME + 'type: "Adam" max_iter: 4 snapshot: 4')
    s = get_solver(sp)
    s.solve()
    state = caffe_pb2.SolverState()
    state.ParseFromString((tmp_path / "snap_iter_4.solverstate").read_bytes())
    assert state.iter == 4
    assert state.learned_net == str(tmp_path / "snap_iter_4.caffemodel")
    assert state.current_step == 1
    W, b = s.net.params["ip"]
    assert len(state.history) == 4
    shapes = [tuple(h.shape.dim) for h in state.history]
    assert shapes == [W.shape, b.shape, W.shape, b.shape]
    np.testing.assert_array_equal(np.array(state.history[2].data, np.float32).reshape(W.shape),
                                  s.history[1][:W.count].reshape(W.shape))
    extra = json.loads(state.caffempi_state)
    assert extra["ranks"][0]["train_data"]["data"]["i"] == 4   # batches consumed by 4 iterations

    model = caffe_pb2.NetParameter()
    model.ParseFromString((tmp_path / "snap_iter_4.caffemodel").read_bytes())
    ip = [lp for lp in model.layer if lp.name == "ip"][0]
    np.testing.assert_array_equal(np.array(ip.blobs[0].data, np.float32).reshape(W.shape), W.data)


def _schema_without_extension():
    """caffe.SolverState as BVLC declares it (no field 1000), in its own pool."""
    fdp = descriptor_pb2.FileDescriptorProto()
    caffe_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "bvlc_only.proto"
    fdp.package = "bvlc"
    keep = [m for m in fdp.message_type if m.name in ("SolverState", "BlobProto", "BlobShape")]
    del fdp.message_type[:]
    fdp.message_type.extend(keep)
    del fdp.enum_type[:]
    del fdp.dependency[:]
    for m in fdp.message_type:      # NVCaffe's raw_data fields are not BVLC's
        bvlc_fields = [f for f in m.field if not f.name.startswith("raw_")]
        del m.field[:]
        m.field.extend(bvlc_fields)
    for m in fdp.message_type:
        for f in m.field:
            if f.type_name.startswith(".caffe."):
                f.type_name = ".bvlc." + f.type_name[len(".caffe."):]
    st = [m for m in fdp.message_type if m.name == "SolverState"][0]
    fields = [f for f in st.field if f.number != 1000]
    del st.field[:]
    st.field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bvlc.SolverState"))


def test_bvlc_schema_skips_our_extra_field(tmp_path):
    sp = solver_param(tmp_path, RESUME + 'type: "SGD" max_iter: 2')
    s = get_solver(sp)
    s.step(2)
    s.snapshot()
    cls = _schema_without_extension()
    msg = cls()
    msg.ParseFromString((tmp_path / "snap_iter_2.solverstate").read_bytes())
    assert msg.iter == 2 and len(msg.history) == 2


def _blob(arr, legacy):
    bp = caffe_pb2.BlobProto()
    arr = np.asarray(arr, np.float32)
    if legacy:
        dims = (1,) * (4 - arr.ndim) + arr.shape
        bp.num, bp.channels, bp.height, bp.width = dims
    else:
        bp.shape.dim.extend(arr.shape)
    bp.data.extend(arr.ravel().tolist())
    return bp


@pytest.mark.parametrize("legacy", [True, False])
def test_caffe_written_snapshot_loads(tmp_path, legacy):
    """A .caffemodel/.solverstate pair as Caffe writes it (built with the
    protobuf schema directly) restores weights, iteration, step and history."""
    sp = solver_param(tmp_path, RESUME + 'type: "SGD" momentum: 0.9')
    s = get_solver(sp)
    W, b = s.net.params["ip"]
    rs = np.random.RandomState(5)
    w_new = rs.randn(*W.shape).astype(np.float32)
    b_new = rs.randn(*b.shape).astype(np.float32)
    hw = rs.randn(*W.shape).astype(np.float32)
    hb = rs.randn(*b.shape).astype(np.float32)
    model = caffe_pb2.NetParameter(name="noisy")
    lp = model.layer.add(name="ip", type="InnerProduct")
    lp.blobs.extend([_blob(w_new, legacy), _blob(b_new, legacy)])
    (tmp_path / "caffe_iter_7.caffemodel").write_bytes(model.SerializeToString())
    state = caffe_pb2.SolverState(iter=7, learned_net=str(tmp_path / "caffe_iter_7.caffemodel"),
                                  current_step=2)
    state.history.extend([_blob(hw, legacy), _blob(hb, legacy)])
    (tmp_path / "caffe_iter_7.solverstate").write_bytes(state.SerializeToString())

    s.restore(str(tmp_path / "caffe_iter_7.solverstate"))
    assert s.iter == 7 and s.current_step == 2
    np.testing.assert_array_equal(W.data, w_new)
    np.testing.assert_array_equal(b.data, b_new)
    np.testing.assert_array_equal(s.history[0], np.concatenate([hw.ravel(), hb.ravel()]))
    s.step(1)  # trains on from there
    assert s.iter == 8


def test_restore_errors(tmp_path):
    sp = solver_param(tmp_path, RESUME + 'type: "SGD"')
    s = get_solver(sp)
    state = caffe_pb2.SolverState(iter=3, learned_net=str(tmp_path / "gone.caffemodel"))
    (tmp_path / "a.solverstate").write_bytes(state.SerializeToString())
    with pytest.raises(CaffeError, match="learned_net .*gone.caffemodel does not exist"):
        s.restore(str(tmp_path / "a.solverstate"))
    state = caffe_pb2.SolverState(iter=3)
    state.history.add().CopyFrom(_blob(np.zeros(6), False))
    (tmp_path / "b.solverstate").write_bytes(state.SerializeToString())
    with pytest.raises(CaffeError, match="1 history blobs"):
        s.restore(str(tmp_path / "b.solverstate"))
    with pytest.raises(CaffeError, match="does not exist"):
        s.restore(str(tmp_path / "missing.solverstate"))


def test_never_snapshots_non_finite_weights(tmp_path):
    sp = solver_param(tmp_path, RESUME + 'type: "SGD"')
    s = get_solver(sp)
    s.step(1)
    s.snapshot()
    good = (tmp_path / "snap_iter_1.caffemodel").read_bytes()
    s.iter = 1
    s.net.param_data[0] = np.nan
    with pytest.raises(CaffeError, match="not finite"):
        s.snapshot()
    assert (tmp_path / "snap_iter_1.caffemodel").read_bytes() == good


def test_signal_actions_snapshot_and_stop(tmp_path):
    sp = solver_param(tmp_path, RESUME + 'type: "SGD" max_iter: 100')
    s = get_solver(sp)
    # polled once an iteration, before its sums, and acted on after its
    # update: a signal seen in the iteration from 2 to 3 snapshots at 3
    actions = {2: SolverAction.SNAPSHOT, 4: SolverAction.STOP}
    s.set_action_function(lambda: actions.pop(s.iter, SolverAction.NONE))  # one-shot, as a signal
    s.solve()
    assert s.iter == 5 and s.requested_early_exit
    names = sorted(p.name for p in tmp_path.iterdir())
    # SNAPSHOT at 3; the stop snapshot at 5 (snapshot_after_train, as Caffe)
    assert names == ["snap_iter_3.caffemodel", "snap_iter_3.solverstate",
                     "snap_iter_5.caffemodel", "snap_iter_5.solverstate"]


def test_hdf5_snapshot_layout(tmp_path):
    h5py = pytest.importorskip("h5py")
    sp = solver_param(tmp_path, RESUME + 'type: "AdaDelta" momentum: 0.9 snapshot_format: HDF5 max_iter: 2')
    s = get_solver(sp)
    s.solve()
    with h5py.File(tmp_path / "snap_iter_2.solverstate.h5", "r") as f:
        assert int(np.asarray(f["iter"]).reshape(-1)[0]) == 2
        assert len(f["history"]) == 4
        assert f["learned_net"][()].decode().endswith("snap_iter_2.caffemodel.h5")
    with h5py.File(tmp_path / "snap_iter_2.caffemodel.h5", "r") as f:
        np.testing.assert_array_equal(f["data"]["ip"]["0"][()], s.net.params["ip"][0].data)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_python_api_paths_and_default_prefix(tmp_path, monkeypatch):
    import caffempi
    d = tmp_path / "exp"
    d.mkdir()
    (d / "net.prototxt").write_text(NOISY_NET)
    (d / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" '
                                       'max_iter: 2 random_seed: 1 momentum: 0.9')
    monkeypatch.chdir(tmp_path)          # the net path resolves next to the solver file
    s = caffempi.get_solver(str(d / "solver.prototxt"))
    assert s.param.snapshot_prefix == str(d / "solver")   # Caffe's default prefix
    s.solve()
    assert s.iter == 2 and (d / "solver_iter_2.caffemodel").exists()
    s2 = caffempi.SGDSolver(str(d / "solver.prototxt"))
    s2.restore(str(d / "solver_iter_2.solverstate"))
    assert s2.iter == 2
    assert np.array_equal(s2.net.param_data, s.net.param_data)
    assert np.array_equal(s2.history[0], s.history[0])
