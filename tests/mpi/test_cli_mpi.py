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


def _signal_training_job(tmp_path, solver, sig, after, flags=()):
    """Start `mpiexec -n 2 ... train --solver=solver flags`, send ``sig`` to
    mpiexec once the log shows ``after``; returns (exit status, the whole log)."""
    import subprocess
    from .mpirun import env, launcher
    p = subprocess.Popen(launcher(2) + [sys.executable] + CLI + ["train", "--solver=%s" % solver]
                         + list(flags), env=env(), stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
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


#: --compress on a 1 Mbit/s link as the plan sees it: every weight low rank
LOW_RANK_FLAGS = ["--compress=powersgd:2", "--link_gbps=0.001", "--gemm_gflops=50"]


@needs_mpi
@needs_cli
@pytest.mark.parametrize("flags", [[], LOW_RANK_FLAGS], ids=["exact", "powersgd"])
def test_sigterm_to_mpiexec_leaves_one_snapshot_that_resumes_bitwise(tmp_path, flags):
    """What a scheduler does before killing a job: SIGTERM to mpiexec.  The
    ranks agree, write one snapshot after the current iteration and exit 0;
    resuming from it reaches the same weights, to the bit, as a run that was
    never stopped (with --compress too: the snapshot has each rank's Q and
    error).  Shares held equal and the gradient plan's costs given: under
    --balance=auto a loaded host may move the shares in one run and not in
    the other, and measured costs may send a layer's gradient as
    sufficient factors in one run and summed whole in the other, which
    round differently (test_balance covers resuming with uneven shares)."""
    import re
    import signal
    from .test_solver_mpi import caffemodel_weights
    run_flags = flags + ["--balance=off"] + ([] if flags else ["--link_gbps=10", "--gemm_gflops=50"])
    s = write_solver(tmp_path, 12, 2, max_iter=100000, prefix="term")
    s.write_text(s.read_text().replace("snapshot: 2 ", "snapshot: 0 "))
    rc, out = _signal_training_job(tmp_path, s, signal.SIGTERM, "Iteration 6 (", run_flags)
    assert rc == 0, out
    assert "Optimization stopped early" in out
    assert out.count(": low rank\n") == (3 if flags else 0), out
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
        mpirun(2, CLI + ["train", "--solver=%s" % solver] + extra + run_flags, timeout=60)
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


# ---------------------------------------- one command, many ranks (--ranks)
def caffempi(args, cwd, timeout=60):
    """``python -m caffempi args`` without a launcher."""
    import subprocess
    from .mpirun import env
    try:
        return subprocess.run([sys.executable, "-m", "caffempi"] + [str(a) for a in args], cwd=str(cwd), env=env(),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("caffempi %s hung:\n%s" % (" ".join(map(str, args)), e.stderr))


def log_lines(stderr, directory):
    """The messages of a log with what differs between two runs of one job
    masked: time stamps, thread ids, timings, the run's directory."""
    import re
    out = []
    for line in stderr.replace(str(directory), "DIR").splitlines():
        line = re.sub(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ ", r"\1 ", line)
        line = re.sub(r"[\d.]+(e[+-]?\d+)?( ?ms|%| iter/s|s/| s\b)", r"T\2", line)
        out.append(line)
    return out


@needs_mpi
@needs_cli
def test_ranks_flag_runs_what_mpiexec_runs(tmp_path):
    """`caffempi train --ranks=2 --solver=S` re-executes itself under the
    venv's mpiexec: the same final weights, to the bit, and the same log
    lines as `mpiexec -n 2 python -m caffempi train --solver=S`, but the
    plan's (its memory rate is measured, and the estimates with it; the link
    and GEMM rates are given so that the choices agree)."""
    from .test_solver_mpi import caffemodel_weights
    runs = {}
    for name in ("mpiexec", "ranks"):
        d = tmp_path / name
        d.mkdir()
        args = ["train", "--solver=%s" % write_solver(d, 12, 2, prefix="job"), "--link_gbps=10", "--gemm_gflops=50"]
        if name == "mpiexec":
            p = mpirun(2, ["-m", "caffempi"] + args, cwd=d)
        else:
            p = caffempi(args + ["--ranks=2"], d)
            assert p.returncode == 0, p.stderr
        runs[name] = (caffemodel_weights(d / "job_iter_4.caffemodel"), log_lines(p.stderr, d))
    np.testing.assert_array_equal(runs["ranks"][0], runs["mpiexec"][0])
    unplanned = {name: [line for line in lines if "Plan: " not in line] for name, (_, lines) in runs.items()}
    assert unplanned["ranks"] == unplanned["mpiexec"]
    assert len(unplanned["ranks"]) < len(runs["ranks"][1])
    assert any("MPI: 2 ranks" in line for line in runs["ranks"][1])
    assert sum("Optimization Done" in line for line in runs["ranks"][1]) == 1


@needs_mpi
@needs_cli
def test_ranks_flag_forwards_signals_and_exit_status(tmp_path):
    """SIGHUP to the command reaches the ranks (a snapshot, training goes
    on), SIGTERM reaches them through mpiexec (a snapshot, then a stop,
    status 0); a failing job's status comes back as mpiexec's."""
    import re
    import signal
    import subprocess
    from .mpirun import env
    s = write_solver(tmp_path, 12, 2, max_iter=100000, prefix="sig")
    s.write_text(s.read_text().replace("snapshot: 2 ", "snapshot: 0 "))
    p = subprocess.Popen([sys.executable, "-m", "caffempi", "train", "--ranks=2", "--solver=%s" % s],
                         env=env(), stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    lines = []
    try:
        t = time.time()
        # SIGHUP once training runs; SIGTERM at an iteration after SIGHUP's snapshot
        for sig, waits in ((signal.SIGHUP, ["Iteration 6 ("]),
                           (signal.SIGTERM, ["Snapshotting solver state", " iters), "])):
            for after in waits:
                for line in p.stderr:
                    lines.append(line)
                    if after in line:
                        break
                    assert time.time() - t < 60, "".join(lines)
            p.send_signal(sig)
        _, rest = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(lines) + rest
    assert p.returncode == 0, out
    assert "Optimization stopped early" in out
    iters = sorted(int(re.search(r"_iter_(\d+)\.", f.name).group(1)) for f in tmp_path.glob("sig_iter_*.caffemodel"))
    assert len(iters) == 2 and iters[0] < iters[1], out
    # a job that fails: the same status as under mpiexec, rank 0's one line
    bad = write_solver(tmp_path, 12, 2, prefix="bad")
    bad.write_text(bad.read_text().replace(str(tmp_path / "bad"), "/nonexistent/dir/bad"))
    direct = mpirun(2, ["-m", "caffempi", "train", "--solver=%s" % bad], cwd=tmp_path, check=False)
    relaunched = caffempi(["train", "--ranks=2", "--solver=%s" % bad], tmp_path)
    assert relaunched.returncode == direct.returncode != 0
    assert "cannot write to snapshot prefix" in relaunched.stderr


@needs_mpi
@needs_cli
def test_ranks_flag_under_mpiexec_must_match_the_job(tmp_path):
    s = write_solver(tmp_path, 12, 2, prefix="match")
    p = mpirun(2, ["-m", "caffempi", "train", "--ranks=3", "--solver=%s" % s], cwd=tmp_path, check=False)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert errors == ["caffempi: error: --ranks=3, but this job has 2 ranks"], p.stderr
    assert mpirun(2, ["-m", "caffempi", "train", "--ranks=2", "--solver=%s" % s], cwd=tmp_path).returncode == 0
