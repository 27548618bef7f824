"""A pycaffe script (caffe.SGDSolver(path), add_callback, step) under
``mpiexec -n 2`` is data parallel by itself, as ``caffempi train`` is:
each rank reads its own half of every batch, the gradients its callback
sees are the ranks' mean, and the weights equal one process's with twice
the batch, to float32 rounding; solver_count/solver_rank report the job,
and the multi-GPU calls that cannot hold are refused."""
import sys

import numpy as np
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi, single

SCRIPT = WORKERS / "pycaffe_script.py"
pytest.importorskip("h5py")

SOLVER = """net: "%(net)s"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "step" gamma: 0.5 stepsize: 4
max_iter: 6 display: 1 test_iter: 4 test_interval: 3 test_initialization: true
snapshot_prefix: "%(prefix)s" random_seed: 3
"""


def write_solver(d, batch):
    sys.path.insert(0, str(WORKERS))
    from solver_worker import make_data, net_text
    make_data(str(d))
    net = d / ("net%d.prototxt" % batch)
    net.write_text(net_text(str(d), batch))
    path = d / ("solver%d.prototxt" % batch)
    path.write_text(SOLVER % {"net": net, "prefix": d / ("b%d" % batch)})
    return path


def _close(got, want, what):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale, err_msg=what)


@needs_mpi
def test_pycaffe_script_under_mpiexec_trains_as_one_process_with_twice_the_batch(tmp_path):
    out = str(tmp_path / "r%d.npz")
    p = mpirun(2, [SCRIPT, write_solver(tmp_path, 6), 6, out], timeout=120)
    ranks = [np.load(out % r) for r in range(2)]
    single([SCRIPT, write_solver(tmp_path, 12), 6, str(tmp_path / "one%d.npz")])
    one = np.load(str(tmp_path / "one%d.npz") % 0)

    assert [(int(r["count"]), int(r["rank"])) for r in ranks] == [(2, 0), (2, 1)]
    assert (int(one["count"]), int(one["rank"])) == (1, 0)
    for r in ranks:
        set_count, nccl = [str(m) for m in r["refused"]]
        assert set_count.startswith("set_solver_count(3): this process is one of 2 solver(s); ")
        assert "'mpiexec -n N python script.py'" in set_count and nccl.startswith("caffe.NCCL: ")
    # the data is sharded: the ranks' first batches are the two halves of one process's
    halves = [r["first_batch"] for r in ranks]
    assert halves[0].shape[0] == halves[1].shape[0] == 6 and not np.array_equal(halves[0], halves[1])
    whole = one["first_batch"]
    assert sorted(np.concatenate(halves)[:, 0, 0, 0].tolist()) == sorted(whole[:, 0, 0, 0].tolist())
    # the gradients on_gradients_ready saw are the same on both ranks and equal one process's
    assert ranks[0]["grads"].shape == one["grads"].shape == (6, one["w"].size)
    np.testing.assert_array_equal(ranks[0]["grads"], ranks[1]["grads"])
    _close(ranks[0]["grads"], one["grads"], "gradients")
    np.testing.assert_array_equal(ranks[0]["w"], ranks[1]["w"])
    _close(ranks[0]["w"], one["w"], "weights")
    assert int(ranks[0]["iter"]) == 6
    # test_iter 4 split over 2 ranks: the same test records as one process
    _close(ranks[0]["test"], one["test"], "test scores")
    # rank 0 logged the job and its gradient averaging (train's defaults); rank 1 no INFO lines
    assert "MPI: 2 ranks" in p.stderr and "Data parallel over 2 ranks" in p.stderr, p.stderr
    assert not [line for line in p.stderr.splitlines() if line.startswith("I") and "[rank 1]" in line]
