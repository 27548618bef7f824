"""The real solver under mpiexec: equivalence to one process (weights and
distributed test scores), resume on 2 ranks, and no hangs on failures."""
import time

import numpy as np
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi, single

W = WORKERS / "solver_worker.py"
pytest.importorskip("h5py")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mpidata")


@pytest.fixture(scope="module")
def reference(data_dir):
    out = data_dir / "one.npz"
    single([W, data_dir, 12, 6, "out=%s" % out, "prefix=one"])
    return np.load(out)


@needs_mpi
@pytest.mark.parametrize("n,comm", [(2, "overlap"), (2, "blocking"), (3, "thread")])
def test_solver_ranks_match_single_process(data_dir, reference, n, comm):
    out = data_dir / ("n%d_%s.npz" % (n, comm))
    mpirun(n, [W, data_dir, 12, 6, "out=%s" % out, "comm=%s" % comm, "prefix=n%d%s" % (n, comm)])
    got = np.load(out)
    assert int(got["iter"]) == 6
    np.testing.assert_allclose(got["w"], reference["w"], rtol=0, atol=1e-6)
    if 4 % n == 0:   # test_iter 4 split evenly: the same test records as one process
        np.testing.assert_allclose(got["test"], reference["test"], rtol=0, atol=1e-6)


@needs_mpi
def test_resume_on_two_ranks(data_dir):
    full = data_dir / "full.npz"
    mpirun(2, [W, data_dir, 12, 6, "snapshot=3", "prefix=rs", "out=%s" % full])
    state = data_dir / "rs_iter_3.solverstate"
    assert state.exists()
    resumed = data_dir / "resumed.npz"
    mpirun(2, [W, data_dir, 12, 6, "prefix=rs2", "resume=%s" % state, "out=%s" % resumed])
    a, b = np.load(full), np.load(resumed)
    assert int(b["iter"]) == 6
    np.testing.assert_allclose(b["w"], a["w"], rtol=0, atol=1e-6)


@needs_mpi
@pytest.mark.parametrize("kind", ["raise", "nan", "kill", "snapshot"])
def test_failure_on_one_rank_ends_the_job(data_dir, kind):
    args = [W, data_dir, 12, 50, "prefix=f%s" % kind, "fail_rank=%d" % (0 if kind == "snapshot" else 1),
            "fail_iter=2", "fail_kind=%s" % kind]
    if kind == "snapshot":
        args.append("snapshot=2")
    t = time.time()
    p = mpirun(2, args, timeout=60, check=False)
    assert p.returncode != 0, p.stderr
    assert time.time() - t < 60
    if kind in ("raise", "nan"):
        assert "[rank 1]" in p.stderr
        assert ("injected failure" if kind == "raise" else "diverged") in p.stderr


@needs_mpi
def test_stop_request_on_one_rank_stops_all_at_same_iteration(data_dir):
    out = data_dir / "stop.npz"
    # rank 1 alone asks to stop (as a SIGINT reaching it first would) at iter 2
    mpirun(2, [W, data_dir, 12, 50, "prefix=stop", "sigint_at=2", "out=%s" % out])
    assert int(np.load(out)["iter"]) == 2
    assert (data_dir / "stop_iter_2.caffemodel").exists()


@needs_mpi
def test_easgd_solver_runs(data_dir):
    out = data_dir / "ea.npz"
    mpirun(2, [W, data_dir, 12, 6, "prefix=ea", "sync=easgd", "tau=2", "out=%s" % out])
    assert np.isfinite(np.load(out)["w"]).all()
