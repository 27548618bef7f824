"""LeNet trained for 20 iterations on CuPy follows the NumPy trajectory: the
loss of every iteration agrees to 1e-4 relative, the final weights to 2e-4 of
their largest magnitude (float32 rounding in different summation orders
compounds over the updates: 1.1e-4 measured on an H100).

The losses also get an absolute floor of 1e-5: the loss is read from logits
of magnitude ~10, whose float32 rounding alone moves it by a few 1e-6, so
once the loss has fallen to ~0.02 a purely relative 1e-4 would test the
logits' last bits (measured on an H100: at most 6.9e-6 absolute over the
run, 1.5e-4 relative at a loss of 0.026)."""
import numpy as np
import pytest

from caffempi.backend import to_numpy
from caffempi.common import set_random_seed
from caffempi.data.datum import array_to_datum
from caffempi.data import lmdb_io
from caffempi.io import proto_io
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver

pytestmark = pytest.mark.gpu

LENET = "models/mnist/lenet_train_test.prototxt"


def digits_lmdb(path, n=256, seed=0):
    """Images whose bright block depends on the label, so the loss falls."""
    rs = np.random.RandomState(seed)
    with lmdb_io.LMDBWriter(str(path)) as w:
        for i in range(n):
            label = int(rs.randint(10))
            im = rs.randint(0, 60, (1, 28, 28)).astype(np.uint8)
            im[0, 2 * label:2 * label + 8, 4:24] = 255
            w.put("%08d" % i, array_to_datum(im, label).SerializeToString())
    return str(path)


def lenet_solver(source, xp, tmp_path):
    net = proto_io.read_net_param(LENET)
    for lp in net.layer:
        if lp.type == "Data":
            lp.data_param.source = source
    sp = caffe_pb2.SolverParameter(
        net_param=net, base_lr=0.01, momentum=0.9, weight_decay=5e-4, lr_policy="inv",
        gamma=1e-4, power=0.75, max_iter=20, random_seed=7, display=0,
        snapshot_prefix=str(tmp_path / "lenet"))
    return get_solver(sp, xp=xp)


def trajectory(solver, iters):
    losses = []
    for _ in range(iters):
        solver.step(1)
        losses.append(solver.smoothed_loss)
    return np.array(losses), to_numpy(solver.net.param_data).copy()


def test_lenet_20_iterations_match_cpu(cupy, tmp_path):
    source = digits_lmdb(tmp_path / "digits")
    runs = []
    for xp in (np, cupy):
        set_random_seed(7)
        runs.append(trajectory(lenet_solver(source, xp, tmp_path), 20))
    (cpu_loss, cpu_w), (gpu_loss, gpu_w) = runs
    assert cpu_loss[-1] < 0.8 * cpu_loss[0]          # it learned something
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=1e-4, atol=1e-5)
    assert np.abs(gpu_w - cpu_w).max() <= 2e-4 * np.abs(cpu_w).max()


def test_a_bad_label_stops_the_gpu_step_before_the_update(cupy, tmp_path):
    """The label check waits for the loss's read (after backward is
    issued) on the GPU; it still stops the step before the update, with
    the layer's error."""
    from caffempi.common import CaffeError
    path = tmp_path / "bad"
    with lmdb_io.LMDBWriter(str(path)) as w:
        for i in range(64):
            im = np.full((1, 28, 28), i, np.uint8)
            w.put("%08d" % i, array_to_datum(im, 12 if i == 5 else i % 10).SerializeToString())
    solver = lenet_solver(str(path), cupy, tmp_path)
    before = to_numpy(solver.net.param_data).copy()
    with pytest.raises(CaffeError, match=r"label value 12 is outside \[0, 10\)"):
        solver.step(1)
    assert np.array_equal(to_numpy(solver.net.param_data), before)


def test_lenet_replayed_as_cuda_graphs_follows_the_eager_run(cupy, tmp_path):
    """CAFFEMPI_CUDA_GRAPH: after the warm-up, each iteration's pass and
    update replay captured graphs; the trajectory is the eager one (the
    same kernels, up to cuDNN algorithms that sum in a varying order)."""
    from caffempi import config
    from caffempi.solvers.captured import WARMUP
    source = digits_lmdb(tmp_path / "digits")
    runs = []
    for graphs in (False, True):
        set_random_seed(7)
        with config.using_config(cuda_graph=graphs):
            solver = lenet_solver(source, cupy, tmp_path)
            runs.append(trajectory(solver, 20))
    assert solver.captured.reason is None, solver.captured.reason
    assert solver.captured.replays == 20 - WARMUP
    (eager_loss, eager_w), (graph_loss, graph_w) = runs
    assert graph_loss[-1] < 0.8 * graph_loss[0]
    np.testing.assert_allclose(graph_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert np.abs(graph_w - eager_w).max() <= 1e-5 * np.abs(eager_w).max()
