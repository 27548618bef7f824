"""The start of a whole job from one command without a launcher
(``caffempi train --ranks=N`` or a ``--gpu`` list): how many ranks
(:func:`ranks_to_launch`), the mpiexec to run them under
(:func:`mpiexec_path`) and the run itself (:func:`run_under_mpiexec`).
A rank's own start-up is :mod:`.rank`."""
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys

from .. import config
from ..common import CaffeError
from .comm import launched_by_mpi


def check_ranks(ranks):
    if ranks < 0:
        raise CaffeError("--ranks=%d: expected a number of ranks (0: one per --gpu id)" % ranks)


def ranks_to_launch(ranks, gpu):
    """How many ranks a ``caffempi train`` started without a launcher runs
    under mpiexec: ``ranks`` (--ranks), or when it is 0 one per --gpu id
    (--gpu=all: every device of this host; each rank then takes its id,
    cli.select_backend).  0: run in this process (one rank, or started by a
    launcher already)."""
    check_ranks(ranks)
    if launched_by_mpi():
        return 0
    if not ranks and gpu:
        from ..backend import parse_gpu_ids, usable_cupy
        count = usable_cupy("--gpu=all").cuda.runtime.getDeviceCount() if gpu == "all" else 0
        ranks = len(parse_gpu_ids(gpu, count))
    if ranks < 2:
        return 0
    if config.settings.mpi is False:
        raise CaffeError("%d ranks were asked for (--ranks or a --gpu list), but CAFFEMPI_MPI=0 forbids MPI; "
                         "give --ranks=1 to train in one process" % ranks)
    return ranks


def mpiexec_path():
    """CAFFEMPI_MPIEXEC where set (a machine whose Python has another MPI's
    mpiexec beside it); else the mpiexec beside this Python (the mpich
    wheel's, in a virtual environment), else the one on PATH, else None."""
    if config.settings.mpiexec:
        return shutil.which(config.settings.mpiexec) or config.settings.mpiexec
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


#: Open MPI's mpirun (PRRTE) ends the job itself on SIGINT and SIGTERM: the
#: ranks get SIGTERM and, 0.25 s later, SIGKILL, too soon for a snapshot.
#: Given by number in --forward-signals, it passes them to the ranks instead
#: and waits for them to exit (PRRTE 3.0, Open MPI 5.0; by name it refuses
#: them, and PRRTE's master branch refuses the numbers too since July 2026).
#: The list replaces Open MPI's default one (SIGUSR1, SIGUSR2, SIGTSTP ...).
OPEN_MPI_FORWARD_SIGNALS = ["--forward-signals", "2,15"]


@functools.lru_cache(maxsize=None)
def is_open_mpi(mpiexec):
    """Whether ``mpiexec`` is Open MPI's launcher (its --version says so);
    MPICH's Hydra otherwise."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out


def run_under_mpiexec(ranks, command):
    """Run ``mpiexec -n ranks command...`` and return its exit status (128 +
    the signal's number when a signal ended it).  SIGINT, SIGTERM and SIGHUP
    sent to this process go to the ranks themselves (to mpiexec while none
    has started), so the --sig*_effect flags work as under MPICH's mpiexec:
    MPICH's dies of SIGHUP, Open MPI's ends the job on all three.  mpiexec
    runs in its own process group, so a Ctrl-C at the terminal reaches the
    ranks once, through this process; its stdin is empty."""
    launcher = mpiexec_path()
    if launcher is None:
        raise CaffeError("%d ranks need mpiexec: none beside %s or on PATH (pip install mpich)"
                         % (ranks, sys.executable))
    if importlib.util.find_spec("mpi4py") is None:
        raise CaffeError("%d ranks need mpi4py (pip install mpi4py)" % ranks)
    proc = subprocess.Popen([launcher, "-n", str(ranks)] + list(command), stdin=subprocess.DEVNULL,
                            process_group=0)

    def forward(signum, frame):
        for pid in _processes_of_this_python(proc.pid) or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    forwarded = [s for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s)]
    old = {sig: signal.signal(sig, forward) for sig in (getattr(signal, s) for s in forwarded)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


def _processes_of_this_python(ancestor):
    """The pids of the processes below ``ancestor`` that run this Python
    (the ranks mpiexec started; not their own children), from /proc; [] where
    there is no /proc."""
    children = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open("/proc/%s/stat" % entry) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    exe = os.path.realpath(sys.executable)
    found, todo = [], list(children.get(ancestor, []))
    while todo:
        pid = todo.pop()
        if os.path.realpath("/proc/%d/exe" % pid) == exe:
            found.append(pid)
        else:
            todo.extend(children.get(pid, []))
    return found
