"""Launch worker scripts under the venv's mpiexec (caffempi.parallel.launch's
mpiexec_path: beside sys.executable, else on PATH) with a timeout, so a hang
fails the test instead of the suite."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from caffempi.parallel.launch import OPEN_MPI_FORWARD_SIGNALS, is_open_mpi, mpiexec_path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKERS = HERE / "workers"


def have_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec_path() is not None


needs_mpi = pytest.mark.skipif(not have_mpi(), reason="mpi4py or mpiexec not available")


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["OPENBLAS_NUM_THREADS"] = "1"
    e["OMP_NUM_THREADS"] = "1"
    e.pop("CAFFEMPI_MPI", None)
    # Open MPI (make test-openmpi; MPICH ignores these): its mpiexec refuses
    # root and more ranks than cores, and its UCX one-sided component, with
    # no UCX device here, prints an "Error:" line at every window
    for k, v in (("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
                 ("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe"), ("OMPI_MCA_osc", "^ucx")):
        e.setdefault(k, v)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def launcher(n):
    """``mpiexec -n n`` as docs/parallel.md gives it: for Open MPI with
    SIGINT and SIGTERM passed on to the ranks (OPEN_MPI_FORWARD_SIGNALS)."""
    mpiexec = mpiexec_path()
    return [mpiexec] + (OPEN_MPI_FORWARD_SIGNALS if is_open_mpi(mpiexec) else []) + ["-n", str(n)]


def mpirun(n, args, timeout=60, cwd=None, check=True, **extra_env):
    """Run ``mpiexec -n n python args...``; returns CompletedProcess."""
    cmd = launcher(n) + [sys.executable] + [str(a) for a in args]
    try:
        p = subprocess.run(cmd, cwd=cwd or REPO, env=env(**extra_env), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("mpiexec -n %d %s hung for %ds\nstdout:%s\nstderr:%s" % (
            n, " ".join(map(str, args)), timeout, e.stdout, e.stderr))
    if check and p.returncode != 0:
        raise AssertionError("mpiexec -n %d %s exited %d\nstdout:%s\nstderr:%s" % (
            n, " ".join(map(str, args)), p.returncode, p.stdout, p.stderr))
    return p


def single(args, timeout=60, cwd=None, check=True, **extra_env):
    """The same worker as one process without MPI."""
    cmd = [sys.executable] + [str(a) for a in args]
    p = subprocess.run(cmd, cwd=cwd or REPO, env=env(CAFFEMPI_MPI=0, **extra_env),
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:%s\nstderr:%s" % (cmd, p.returncode, p.stdout, p.stderr))
    return p
