"""The rest of pycaffe's surface, in one process: the module's Timer,
init_log/log, solver_count/rank and their setters, set_multiprocess,
has_nccl and NCCL (refused); the Solver's add_callback (when each callback
runs, checked against a NumPy momentum-SGD reference), share_weights,
param, lr, iter; the Net's per-layer callbacks and _caffe.cpp's index-based
names.  The same script under mpiexec: tests/mpi/test_pycaffe_mpi.py."""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi as caffe
from caffempi.backend import cupy_or_none
from caffempi.common import CaffeError, captured_log
from caffempi.proto import caffe_pb2

N, D, K = 4, 3, 2              # batch, input width, outputs
LR, MOMENTUM = 0.1, 0.9

NET = """
name: "reg"
layer { name: "data" type: "Input" top: "x" top: "t"
        input_param { shape { dim: %d dim: %d } shape { dim: %d dim: %d } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
        inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.2 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "t" top: "loss" loss_weight: 2 }
""" % (N, D, N, K, K)


def net_param():
    return text_format.Parse(NET, caffe_pb2.NetParameter())


def make_solver(extra=""):
    sp = text_format.Merge('base_lr: %g momentum: %g lr_policy: "fixed" max_iter: 10 display: 0 '
                           'random_seed: 5 %s' % (LR, MOMENTUM, extra), caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(net_param())
    return caffe.get_solver(sp)


def batch(it):
    r = np.random.RandomState(10 + it)
    return r.randn(N, D).astype(np.float32), r.randn(N, K).astype(np.float32)


def reference_grads(w, b, x, t):
    """EuclideanLoss with loss_weight 2 of x W^T + b: (loss, dW, db) in float64."""
    x, t = x.astype(np.float64), t.astype(np.float64)
    r = x @ w.T + b - t
    return 2 * (r * r).sum() / (2 * N), 2 * r.T @ x / N, 2 * r.sum(0) / N


# ------------------------------------------------------------------ module
def test_module_has_pycaffe_names():
    # BVLC's python/caffe/__init__.py, name for name
    names = ("Net SGDSolver NesterovSolver AdaGradSolver RMSPropSolver AdaDeltaSolver AdamSolver NCCL Timer "
             "init_log log set_mode_cpu set_mode_gpu set_device Layer get_solver layer_type_list set_random_seed "
             "solver_count set_solver_count solver_rank set_solver_rank set_multiprocess has_nccl __version__ "
             "TRAIN TEST Classifier Detector layers params NetSpec to_proto").split()
    assert [n for n in names if not hasattr(caffe, n)] == []


def test_timer_as_caffes():
    t = caffe.Timer()
    with captured_log() as messages:
        assert t.ms == 0.0                              # never started
    assert messages == ["Timer has never been run before reading time."]
    t.start()
    time.sleep(0.03)
    t.start()                                           # running: no restart
    t.stop()
    first = t.ms
    assert 30 <= first < 3000
    time.sleep(0.01)
    assert t.ms == first                                # stopped: the time stays
    assert t.seconds == pytest.approx(first / 1e3) and t.microseconds == pytest.approx(first * 1e3)
    t.start()
    time.sleep(0.02)
    running = t.ms                                      # reading a running timer stops it
    assert not t.running and 20 <= running < 3000
    time.sleep(0.01)
    assert t.ms == running


def test_timer_in_gpu_mode_times_the_queued_kernels():
    """Events on the stream: the kernels queued between start and stop
    count, though stop returns before they run (a host clock would see
    only the queueing); the wait for them when reading ``ms`` is part of
    that time.  Needs a GPU."""
    try:
        caffe.set_mode_gpu()
    except CaffeError as e:
        pytest.skip(str(e))
    try:
        cp = cupy_or_none()
        a = cp.full((4096, 4096), 1e-3, cp.float32)
        (a @ a).sum().get()                             # warm up
        t = caffe.Timer()
        t.start()
        for _ in range(20):
            a = a @ a
        t.stop()
        wait = time.perf_counter()
        gpu_ms = t.ms
        wait_ms = (time.perf_counter() - wait) * 1e3
        assert gpu_ms >= wait_ms * 0.9 and gpu_ms > 0
    finally:
        caffe.set_mode_cpu()


def test_solver_count_and_rank_in_one_process():
    assert caffe.solver_count() == 1 and caffe.solver_rank() == 0
    caffe.set_solver_count(1)
    caffe.set_solver_rank(0)
    caffe.set_multiprocess(True)
    caffe.set_multiprocess(False)
    with pytest.raises(CaffeError, match=r"set_solver_count\(2\): this process is one of 1 solver.*"
                                         r"mpiexec -n N python script.py"):
        caffe.set_solver_count(2)
    with pytest.raises(CaffeError, match=r"set_solver_rank\(1\): this process is rank 0 of 1;.*mpiexec"):
        caffe.set_solver_rank(1)


def test_nccl_is_refused_with_the_command_to_run():
    solver = make_solver()
    with pytest.raises(CaffeError, match=r"^caffe.NCCL: .*'mpiexec -n N python script.py'.*caffempi train"):
        caffe.NCCL(solver, b"uid")
    with pytest.raises(CaffeError, match=r"^caffe.NCCL.new_uid: .*mpiexec"):
        caffe.NCCL.new_uid()


def test_init_log_level_and_log():
    code = ("import caffempi as caffe\n"
            "caffe.init_log(1); caffe.log('hidden at WARNING')\n"
            "caffe.init_log(); caffe.log('shown at INFO')\n"
            "try:\n    caffe.init_log(4)\nexcept caffe.CaffeError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1], env={"CAFFEMPI_MPI": "0", "OPENBLAS_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert "hidden" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if "shown at INFO" in line]
    assert len(lines) == 1 and lines[0].startswith("I") and "] shown at INFO" in lines[0]
    assert p.stdout.strip() == "init_log(4): expected a level 0 (INFO), 1 (WARNING), 2 (ERROR) or 3 (FATAL)"


# ------------------------------------------------------------------ solver
def test_callbacks_run_around_forward_backward_and_before_the_update():
    """on_start feeds the iteration's batch (so it must run before forward);
    on_gradients_ready sees the gradients of the current weights (after
    backward, before the update); the weights follow momentum SGD."""
    solver = make_solver('test_iter: 1 test_interval: 2 test_initialization: true')
    net = solver.net
    assert solver.collectives.size == 1               # no launcher: one process
    events = []
    w = net.params["ip"][0].data.astype(np.float64).copy()
    b = net.params["ip"][1].data.astype(np.float64).copy()
    hist_w, hist_b = np.zeros_like(w), np.zeros_like(b)

    def on_start():
        events.append(("start", solver.iter))
        x, t = batch(solver.iter)
        net.blobs["x"].data[...] = x
        net.blobs["t"].data[...] = t

    def on_gradients_ready():
        nonlocal w, b, hist_w, hist_b
        events.append(("ready", solver.iter))
        np.testing.assert_allclose(net.params["ip"][0].data, w, rtol=1e-5, atol=1e-6)   # not yet updated
        _, dw, db = reference_grads(w, b, *batch(solver.iter))
        np.testing.assert_allclose(net.params["ip"][0].diff, dw, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(net.params["ip"][1].diff, db, rtol=1e-4, atol=1e-6)
        hist_w, hist_b = MOMENTUM * hist_w + LR * dw, MOMENTUM * hist_b + LR * db
        w, b = w - hist_w, b - hist_b

    solver.add_callback(on_start, on_gradients_ready)
    solver.add_callback(lambda: events.append(("start2", solver.iter)), lambda: events.append(("ready2", solver.iter)))
    net.before_forward(lambda i: i == 1 and events.append(("forward ip", solver.iter)))
    net.after_backward(lambda i: i == 1 and events.append(("backward ip", solver.iter)))
    solver.test_nets[0].before_forward(lambda i: i == 0 and events.append(("test", solver.iter)))
    solver.step(3)
    assert events == [("test", 0), ("start", 0), ("start2", 0), ("forward ip", 0), ("backward ip", 0),
                      ("ready", 0), ("ready2", 0),
                      ("start", 1), ("start2", 1), ("forward ip", 1), ("backward ip", 1), ("ready", 1), ("ready2", 1),
                      ("test", 2), ("start", 2), ("start2", 2), ("forward ip", 2), ("backward ip", 2),
                      ("ready", 2), ("ready2", 2)]
    np.testing.assert_allclose(net.params["ip"][0].data, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][1].data, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(CaffeError, match="add_callback: on_gradients_ready must be callable, got 3"):
        solver.add_callback(on_start, 3)


def test_share_weights_param_lr_and_iter():
    solver = make_solver('lr_policy: "multistep" gamma: 0.5 stepvalue: 1 stepvalue: 2')
    deploy = caffe.Net(net_param(), caffe.TEST)
    solver.share_weights(deploy)
    x, t = batch(0)
    solver.net.blobs["x"].data[...] = x
    solver.net.blobs["t"].data[...] = t
    assert solver.lr == pytest.approx(LR)
    solver.step(1)
    assert deploy.params["ip"][0] is solver.net.params["ip"][0]
    w, bias = (p.data.astype(np.float64) for p in solver.net.params["ip"])
    np.testing.assert_allclose(deploy.forward(x=x, blobs=["ip"])["ip"], x @ w.T + bias, rtol=1e-5, atol=1e-6)
    # lr: the next update's rate; reading it twice advances nothing
    assert solver.iter == 1 and solver.current_step == 0
    assert solver.lr == pytest.approx(LR * 0.5) and solver.lr == pytest.approx(LR * 0.5)
    assert solver.current_step == 0
    solver.iter = 2                                    # writable here (read-only in BVLC's)
    assert solver.lr == pytest.approx(LR * 0.5)        # multistep moves one step per update, as Caffe
    # param is the SolverParameter the loop reads: a zero rate stops the updates
    assert isinstance(solver.param, caffe_pb2.SolverParameter) and solver.param.max_iter == 10
    solver.param.base_lr = 0.0
    solver.param.momentum = 0.0
    before = solver.net.param_data.copy()
    solver.step(1)
    np.testing.assert_array_equal(solver.net.param_data, before)


# --------------------------------------------------------------------- net
def test_net_layer_callbacks_in_caffes_order():
    net = caffe.Net(net_param(), caffe.TRAIN)
    x, t = batch(0)
    events, tops = [], {}
    net.before_forward(lambda i: events.append(("bf", i)))
    net.after_forward(lambda i: events.append(("af", i)))
    net.after_forward(lambda i: tops.setdefault(i, [net.blobs[n].data.copy() for n in net.top_names[i]]))
    net.before_backward(lambda i: events.append(("bb", i)))
    net.after_backward(lambda i: events.append(("ab", i)))
    net.forward(x=x, t=t)
    assert events == [("bf", 0), ("af", 0), ("bf", 1), ("af", 1), ("bf", 2), ("af", 2)]
    w, b = (p.data.astype(np.float64) for p in net.params["ip"])
    np.testing.assert_allclose(tops[1][0], x @ w.T + b, rtol=1e-5, atol=1e-6)   # after_forward sees the top
    events.clear()
    net.backward()
    # every layer, also the Input layer that needs no backward (as Caffe)
    assert events == [("bb", 2), ("ab", 2), ("bb", 1), ("ab", 1), ("bb", 0), ("ab", 0)]
    events.clear()
    net.forward(start="ip", end="ip")
    assert events == [("bf", 1), ("af", 1)]
    # the gradient sync's hook is an after_backward callback and can be removed
    seen = []
    net.add_backward_hook(seen.append)
    net.backward()
    net.remove_backward_hook(seen.append)
    net.backward()
    assert seen == [2, 1, 0]
    with pytest.raises(CaffeError, match="net 'reg': before_backward needs a callable taking the layer index"):
        net.before_backward(None)


def test_timers_on_layer_callbacks_as_train_py():
    net = caffe.Net(net_param(), caffe.TRAIN)
    fprop = [caffe.Timer() for _ in net.layers]
    net.before_forward(lambda i: fprop[i].start())
    net.after_forward(lambda i: fprop[i].stop())
    net.before_forward(lambda i: i == 1 and time.sleep(0.02))
    net.forward(x=batch(0)[0], t=batch(0)[1])
    assert fprop[1].ms >= 20 and fprop[0].ms < fprop[1].ms and fprop[2].ms < fprop[1].ms


def test_net_index_names_of_caffe_cpp():
    net = caffe.Net(net_param(), caffe.TRAIN)
    assert net._blob_names == ["x", "t", "ip", "loss"]
    assert [b is net.blobs[n] for b, n in zip(net._blobs, net._blob_names)] == [True] * 4
    assert net._blob_loss_weights == [0.0, 0.0, 0.0, 2.0]
    assert net._inputs == [0, 1] and net._outputs == [3]
    assert net._top_ids(1) == [2] and net._bottom_ids(2) == [2, 1] and net._bottom_ids(0) == []
    x, t = batch(1)
    net.blobs["x"].data[...] = x
    net.blobs["t"].data[...] = t
    w, b = (p.data.astype(np.float64) for p in net.params["ip"])
    loss, dw, _ = reference_grads(w, b, x, t)
    assert net._forward(0, 2) == pytest.approx(loss, rel=1e-5)
    net._backward(2, 0)
    np.testing.assert_allclose(net.params["ip"][0].diff, dw, rtol=1e-4, atol=1e-6)
    mem = caffe.Net(text_format.Parse("""
      layer { name: "mem" type: "MemoryData" top: "data" top: "label"
              memory_data_param { batch_size: 2 channels: 1 height: 1 width: 3 } }
      layer { name: "sil" type: "Silence" bottom: "label" }""", caffe_pb2.NetParameter()), caffe.TEST)
    data = np.arange(12, dtype=np.float32).reshape(4, 1, 1, 3)
    mem._set_input_arrays(data, np.arange(4, dtype=np.float32).reshape(4, 1, 1, 1))   # pycaffe's label shape
    mem.forward()
    mem.forward()
    np.testing.assert_array_equal(mem.blobs["data"].data, data[2:])
    np.testing.assert_array_equal(mem.blobs["label"].data, [2, 3])
