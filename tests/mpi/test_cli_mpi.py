"""`mpiexec -n 2 python -m caffempi train --solver=S` end to end."""
import sys
import time

import numpy as np
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi, single

sys.path.insert(0, str(WORKERS))
pytest.importorskip("h5py")


def _cli_has_parallel_flags():
    from caffempi import cli
    return "comm" in cli.FLAGS


needs_cli = pytest.mark.skipif(not _cli_has_parallel_flags(), reason="cli has no --comm flag yet")


CLI = [str(WORKERS / "cli_main.py")]   # `python -m caffempi`, data layers registered


def write_solver(d, global_b, ranks, max_iter=4, prefix="cli", extra=""):
    from solver_worker import SOLVER, make_data, net_text
    make_data(str(d))
    text = SOLVER % {"net": net_text(str(d), global_b // ranks), "max_iter": max_iter,
                     "test_interval": 2, "snapshot": 2, "prefix": str(d / prefix)}
    path = d / ("solver_%s.prototxt" % prefix)
    path.write_text(text + extra)
    return path


@needs_mpi
@needs_cli
def test_cli_train_two_ranks(tmp_path):
    s = write_solver(tmp_path, 12, 2)
    p = mpirun(2, CLI + ["train", "--solver=%s" % s], timeout=60)
    import re
    if "Logging error" not in p.stderr:                       # (a broken log formatter repeats lines)
        assert len(re.findall(r"^I.*Optimization Done", p.stderr, re.M)) == 1   # rank 0 alone logs info
    assert "Data parallel over" in p.stderr
    assert (tmp_path / "cli_iter_4.caffemodel").exists()
    assert (tmp_path / "cli_iter_4.solverstate").exists()
    # resume on 2 ranks from the iteration-2 snapshot
    p = mpirun(2, CLI + ["train", "--solver=%s" % s,
                   "--snapshot=%s" % (tmp_path / "cli_iter_2.solverstate")], timeout=60)
    assert "Optimization Done" in p.stderr


@needs_mpi
@needs_cli
def test_cli_error_on_rank0_aborts_job(tmp_path):
    s = write_solver(tmp_path, 12, 2, prefix="bad")
    s.write_text(s.read_text().replace(str(tmp_path / "bad"), "/nonexistent/dir/bad"))
    t = time.time()
    p = mpirun(2, CLI + ["train", "--solver=%s" % s], timeout=60, check=False)
    assert p.returncode != 0
    assert time.time() - t < 60
    assert "cannot write to snapshot prefix" in p.stderr


@needs_mpi
@needs_cli
def test_cli_divergence_stops_every_rank_with_one_error_line(tmp_path):
    import re
    s = write_solver(tmp_path, 12, 2, max_iter=50, prefix="div")
    s.write_text(s.read_text().replace("base_lr: 0.05", "base_lr: 1e30"))
    p = mpirun(2, CLI + ["train", "--solver=%s" % s], timeout=60, check=False)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, p.stderr                          # rank 0's line only, no MPI_Abort
    m = re.match(r"caffempi: error: Iteration (\d+): training diverged on ranks? [\d, ]+ \(rank \d: loss = ",
                 errors[0])
    assert m, errors[0]
    assert "Abort" not in p.stderr
    snapshots = [int(re.search(r"_iter_(\d+)", f.name).group(1)) for f in tmp_path.glob("div_iter_*")]
    assert all(i <= int(m.group(1)) for i in snapshots), snapshots


@needs_cli
def test_cli_single_process_without_mpi(tmp_path):
    s = write_solver(tmp_path, 12, 1, max_iter=2, prefix="one")
    p = single(CLI + ["train", "--solver=%s" % s], timeout=60)
    assert "Optimization Done" in p.stderr


def _signal_training_job(tmp_path, solver, sig, after):
    """Start `mpiexec -n 2 ... train --solver=solver`, send ``sig`` to mpiexec
    once the log shows ``after``; returns (exit status, the whole log)."""
    import subprocess
    from .mpirun import env, mpiexec_path
    p = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable] + CLI + ["train", "--solver=%s" % solver],
                         env=env(), stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    lines = []
    try:
        t = time.time()
        for line in p.stderr:
            lines.append(line)
            if after in line:              # training is under way
                break
            assert time.time() - t < 60, "".join(lines)
        p.send_signal(sig)
        _, rest = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, "".join(lines) + rest


@needs_mpi
@needs_cli
def test_cli_sigint_to_mpiexec_snapshots_once_and_stops(tmp_path):
    import signal
    s = write_solver(tmp_path, 12, 2, max_iter=100000, prefix="int")
    s.write_text(s.read_text().replace("snapshot: 2 ", "snapshot: 0 "))
    rc, out = _signal_training_job(tmp_path, s, signal.SIGINT, "Iteration 6 (")
    assert rc == 0, out
    assert "Optimization stopped early" in out
    snaps = list(tmp_path.glob("int_iter_*.caffemodel"))
    assert len(snaps) == 1, out


@needs_mpi
@needs_cli
def test_sigterm_to_mpiexec_leaves_one_snapshot_that_resumes_bitwise(tmp_path):
    """What a scheduler does before killing a job: SIGTERM to mpiexec.  The
    ranks agree, write one snapshot after the current iteration and exit 0;
    resuming from it reaches the same weights, to the bit, as a run that was
    never stopped."""
    import re
    import signal
    from .test_solver_mpi import caffemodel_weights
    s = write_solver(tmp_path, 12, 2, max_iter=100000, prefix="term")
    s.write_text(s.read_text().replace("snapshot: 2 ", "snapshot: 0 "))
    rc, out = _signal_training_job(tmp_path, s, signal.SIGTERM, "Iteration 6 (")
    assert rc == 0, out
    assert "Optimization stopped early" in out
    models = list(tmp_path.glob("term_iter_*.caffemodel"))
    states = list(tmp_path.glob("term_iter_*.solverstate"))
    assert len(models) == 1 and len(states) == 1, out
    k = int(re.search(r"_iter_(\d+)\.", models[0].name).group(1))
    # the uninterrupted run to k + 3, and the resumed one
    s.write_text(s.read_text().replace("max_iter: 100000", "max_iter: %d" % (k + 3)))
    for prefix, extra in (("full", []), ("resumed", ["--snapshot=%s" % states[0]])):
        text = s.read_text().replace(str(tmp_path / "term"), str(tmp_path / prefix))
        solver = tmp_path / ("solver_%s.prototxt" % prefix)
        solver.write_text(text)
        mpirun(2, CLI + ["train", "--solver=%s" % solver] + extra, timeout=60)
    full = caffemodel_weights(tmp_path / ("full_iter_%d.caffemodel" % (k + 3)))
    resumed = caffemodel_weights(tmp_path / ("resumed_iter_%d.caffemodel" % (k + 3)))
    np.testing.assert_array_equal(resumed, full)


@needs_mpi
@needs_cli
def test_ranks_that_built_different_nets_stop_at_start_up(tmp_path):
    """A stale prototxt on one host: rank 1 reads a solver whose ip2 has
    another width.  Every rank stops before training, with one line from
    rank 0 naming the layer, and a non-zero exit (no hang, no traceback)."""
    import subprocess
    from .mpirun import REPO, env, mpiexec_path
    good = write_solver(tmp_path, 12, 2, prefix="good")
    stale = write_solver(tmp_path, 12, 2, prefix="stale")
    stale.write_text(stale.read_text().replace("num_output: 16", "num_output: 12"))
    rank = [sys.executable] + CLI + ["train"]
    cmd = [mpiexec_path(), "-n", "1"] + rank + ["--solver=%s" % good, ":", "-n", "1"] + rank + ["--solver=%s" % stale]
    t = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0, p.stderr
    assert time.time() - t < 60
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, p.stderr
    assert "rank 1 built a different train net than rank 0" in errors[0]
    assert "'ip2' (InnerProduct, param 16x20, param 16)" in errors[0], errors[0]
    assert "'ip2' (InnerProduct, param 12x20, param 12)" in errors[0], errors[0]
    assert "Traceback" not in p.stderr
    assert "Iteration 0" not in p.stderr          # stopped before training
