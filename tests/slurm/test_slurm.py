"""examples/slurm/train.sbatch, submitted with sbatch to a one-node Slurm
cluster (caffempi.testing.slurm, started by conftest's fixture): a 2-rank
job trains, and `scancel --signal=TERM` on a running job leaves exactly
one snapshot from which a resubmitted job resumes, to the bit, as a job
that was never stopped.  Both launchers the script offers: srun with the
pmi2 plug-in (MPICH speaks PMI-2) and MPICH's mpiexec inside the
allocation (Hydra starts its proxies through srun)."""
import re
import sys
import time

import numpy as np
import pytest

from mpi.mpirun import REPO, WORKERS, env, needs_mpi
from caffempi.parallel.launch import mpiexec_path

pytest.importorskip("h5py")
sys.path.insert(0, str(WORKERS))

SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
LAUNCHERS = ["srun", "mpiexec"]


def write_solver(d, prefix, max_iter, snapshot, ranks=2, global_batch=12):
    """tests/mpi's small HDF5Data MLP and solver (test_cli_mpi's), in ``d``."""
    from solver_worker import SOLVER, make_data, net_text
    make_data(str(d))
    path = d / ("solver_%s.prototxt" % prefix)
    path.write_text(SOLVER % {"net": net_text(str(d), global_batch // ranks), "max_iter": max_iter,
                              "test_interval": 2, "snapshot": snapshot, "prefix": str(d / prefix)})
    return path


def submit(slurm, d, launcher, name, flags):
    """sbatch the example script for 2 ranks on the node, ``flags`` for
    `caffempi train`; returns (job id, its output file)."""
    out = d / ("%s.out" % name)
    job_env = slurm.env(**env(PYTHON=sys.executable, LAUNCHER=launcher, MPIEXEC=mpiexec_path()))
    job = slurm.sbatch(["--job-name=%s" % name, "--nodes=1", "--ntasks-per-node=2", "--output=%s" % out,
                        "--chdir=%s" % d, "--time=5", str(SCRIPT)] + list(flags), env=job_env)
    return job, out


def finish(slurm, job, out, timeout=120):
    """Wait for the job; its state, exit code and output."""
    state = slurm.wait(job, timeout=timeout)
    info = slurm.job(job)
    return state, info.get("ExitCode"), out.read_text() if out.exists() else ""


def train_ok(slurm, d, launcher, name, flags):
    job, out = submit(slurm, d, launcher, name, flags)
    state, code, log = finish(slurm, job, out)
    assert (state, code) == ("COMPLETED", "0:0"), "%s %s\n%s\n%s" % (state, code, log, slurm.log())
    return log


@needs_mpi
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sbatch_trains_on_two_ranks(slurm, tmp_path, launcher):
    s = write_solver(tmp_path, "sb", max_iter=4, snapshot=2)
    log = train_ok(slurm, tmp_path, launcher, "sb-" + launcher, ["--solver=%s" % s])
    assert "launcher %s" % launcher in log
    assert re.search(r"Data parallel over 2 ranks", log), log        # one job of 2 ranks, not 2 of 1
    assert len(re.findall(r"^I.*Optimization Done", log, re.M)) == 1, log
    for k in (2, 4):
        assert (tmp_path / ("sb_iter_%d.caffemodel" % k)).exists(), log
        assert (tmp_path / ("sb_iter_%d.solverstate" % k)).exists(), log


def wait_for_line(path, text, slurm, job, timeout=90):
    t = time.time()
    while True:
        log = path.read_text() if path.exists() else ""
        if text in log:
            return log
        state = slurm.state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), "job %s before %r:\n%s" % (state, text, log)
        assert time.time() - t < timeout, "no %r after %ds:\n%s" % (text, timeout, log)
        time.sleep(0.1)


@needs_mpi
@pytest.mark.parametrize("launcher,scancel", [("srun", []), ("mpiexec", []), ("mpiexec", ["--full"])],
                         ids=["srun-steps", "mpiexec-steps", "mpiexec-full"])
def test_scancel_term_leaves_one_snapshot_that_a_resubmitted_job_resumes_bitwise(slurm, tmp_path, launcher, scancel):
    """What Slurm does before it ends a job: SIGTERM, to the job's steps
    (`scancel --signal=TERM`, `--signal=TERM@SECONDS` before the time limit)
    or to every process of the job, the batch shell included (`--full`: the
    time limit, preemption; srun would answer it with SIGKILL to the ranks,
    so only mpiexec).  The ranks write one snapshot after the current
    iteration and the job completes with status 0; a job resubmitted with
    --snapshot= reaches the same weights, to the bit, as a job that was
    never stopped."""
    from mpi.test_solver_mpi import caffemodel_weights
    s = write_solver(tmp_path, "term", max_iter=100000, snapshot=0)
    # equal shares: under --balance=auto the shares after the snapshot follow
    # each job's measured speeds (resuming with uneven shares: mpi/test_balance)
    job, out = submit(slurm, tmp_path, launcher, "term-" + launcher, ["--solver=%s" % s, "--balance=off"])
    wait_for_line(out, "Iteration 6 (", slurm, job)
    slurm.scancel(job, "--signal=TERM", *scancel)
    state, code, log = finish(slurm, job, out)
    assert (state, code) == ("COMPLETED", "0:0"), "%s %s\n%s" % (state, code, log)
    assert "Optimization stopped early" in log, log
    models = sorted(tmp_path.glob("term_iter_*.caffemodel"))
    states = sorted(tmp_path.glob("term_iter_*.solverstate"))
    assert len(models) == 1 and len(states) == 1, (models, states, log)
    k = int(re.search(r"_iter_(\d+)\.", models[0].name).group(1))
    assert k >= 6, log
    # resubmitted: resumed from the snapshot, and from scratch without a stop, to k + 3
    full = write_solver(tmp_path, "full", max_iter=k + 3, snapshot=0)
    resumed = write_solver(tmp_path, "resumed", max_iter=k + 3, snapshot=0)
    logs = {}
    for name, flags in (("resumed", ["--solver=%s" % resumed, "--snapshot=%s" % states[0]]),
                        ("full", ["--solver=%s" % full])):
        logs[name] = train_ok(slurm, tmp_path, launcher, name, flags + ["--balance=off"])
    assert "Resuming from %s" % states[0] in logs["resumed"], logs["resumed"]
    assert "Resuming" not in logs["full"], logs["full"]
    a = caffemodel_weights(tmp_path / ("full_iter_%d.caffemodel" % (k + 3)))
    b = caffemodel_weights(tmp_path / ("resumed_iter_%d.caffemodel" % (k + 3)))
    np.testing.assert_array_equal(b, a)
    assert a.size > 0
