"""pycaffe's module-level functions and classes that are neither nets nor
layers (BVLC's ``_caffe.cpp``): the solvers as pycaffe makes them, Timer,
init_log/log, the multi-GPU settings (solver_count, solver_rank,
set_multiprocess, has_nccl) and NCCL.  ``caffempi/__init__.py`` exports
them as ``caffe.<name>``.

caffempi's solvers train together as the ranks of an MPI job, one process
and one solver each; a pycaffe solver (``caffe.SGDSolver(path)``,
``caffe.get_solver(path)``) made under ``mpiexec -n N python script.py``
shards the data and averages the gradients by itself, with train's default
strategy (:func:`caffempi.parallel.rank.default_gradient_sync`), where
caffempi.solvers' own classes take one process unless given ``sync=``.  So the settings
that BVLC's ``python/train.py`` makes in each process it starts report the
job (solver_count, solver_rank) and accept only values that agree with it;
NCCL, with which that script joins its processes, is refused with the
command to run instead, and has_nccl() says so (False, as pycaffe built
without NCCL answers).
"""
import time

import numpy as np

from .backend import default_array_module, usable_cupy
from .common import SEVERITY_LEVELS, CaffeError, log as caffe_log
from . import solvers
from .parallel.comm import SingleWorld, launched_by_mpi
from .parallel.rank import default_gradient_sync, init_rank_logging, script_world

RUN_UNDER_MPIEXEC = ("caffempi's solvers are the ranks of an MPI job, not processes a script starts: run the "
                     "script under 'mpiexec -n N python script.py' (each rank builds one solver, which shards "
                     "the data and averages its gradients with the other ranks' by itself, over NCCL on GPUs "
                     "where it can), or train with 'caffempi train --solver=... --gpu=0,1,...'")


def pycaffe_solver(cls):
    """``cls`` as pycaffe's ``caffe.<Type>Solver``: made without ``sync=``,
    it takes the job's default strategy (data parallel under a launcher)."""
    def __init__(self, param, xp=None, sync=None, *args, **kwargs):
        cls.__init__(self, param, xp, default_gradient_sync() if sync is None else sync, *args, **kwargs)
    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__, "__module__": __name__,
                                       "__qualname__": cls.__qualname__})


SOLVER_TYPES = {name: pycaffe_solver(cls) for name, cls in solvers.SOLVER_TYPES.items()}
SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver, AdaDeltaSolver, AdamSolver = (
    SOLVER_TYPES[cls.type] for cls in (solvers.SGDSolver, solvers.NesterovSolver, solvers.AdaGradSolver,
                                       solvers.RMSPropSolver, solvers.AdaDeltaSolver, solvers.AdamSolver))


def get_solver(param, **kwargs):
    """pycaffe's ``caffe.get_solver(path)``: the solver of the parameter's
    type, with the job's default strategy unless given ``sync=``."""
    return solvers.get_solver(param, SOLVER_TYPES, **kwargs)


class Timer:
    """pycaffe's ``caffe.Timer`` (Caffe's Timer): ``start()``, ``stop()``
    and the time between them as ``ms``, ``microseconds`` or ``seconds``.
    As Caffe's: start and stop do nothing when already running / stopped,
    reading a running timer stops it, and a timer never started reads 0
    with a warning.  A timer made in GPU mode (``set_mode_gpu``) times the
    current CUDA stream with events, as Caffe's times the GPU's, so the
    kernels queued between start and stop count; otherwise the host clock."""

    def __init__(self):
        xp = default_array_module()
        self.cuda = None if xp is np else xp.cuda
        self.running = False
        self.has_run_at_least_once = False
        self._start = self._stop = None

    def _mark(self):
        if self.cuda is None:
            return time.perf_counter()
        event = self.cuda.Event()
        event.record()
        return event

    def start(self):
        if not self.running:
            self._start = self._mark()
            self.running = True
            self.has_run_at_least_once = True

    def stop(self):
        if self.running:
            self._stop = self._mark()
            self.running = False

    @property
    def ms(self):
        """Milliseconds from the last start to the last stop."""
        if not self.has_run_at_least_once:
            caffe_log.warning("Timer has never been run before reading time.")
            return 0.0
        self.stop()
        if self.cuda is None:
            return (self._stop - self._start) * 1e3
        self._stop.synchronize()
        return float(self.cuda.get_elapsed_time(self._start, self._stop))

    @property
    def microseconds(self):
        return self.ms * 1e3

    @property
    def seconds(self):
        return self.ms / 1e3


def init_log(level=0, stderr=True):
    """pycaffe's ``caffe.init_log([level[, stderr]])``: caffempi's log to
    stderr in glog's format from severity ``level`` up (glog's
    --minloglevel: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL); under a launcher
    ranks other than 0 keep to warnings, as under ``caffempi train``.
    ``stderr`` (glog's --logtostderr) is accepted and changes nothing:
    caffempi always logs to stderr and writes a file only for the CLI's
    --log_dir."""
    if not 0 <= int(level) < len(SEVERITY_LEVELS):
        raise CaffeError("init_log(%r): expected a level 0 (INFO), 1 (WARNING), 2 (ERROR) or 3 (FATAL)"
                         % (level,))
    init_rank_logging(job_world(), level=SEVERITY_LEVELS[int(level)])


def log(message):
    """pycaffe's ``caffe.log(message)``: one INFO line in caffempi's log."""
    caffe_log.info("%s", message)


def job_world():
    """The MPI job's world under a launcher (made and started there as a
    solver would: rank.script_world), else a one-process world."""
    return script_world() if launched_by_mpi() else SingleWorld()


def solver_count():
    """pycaffe's ``caffe.solver_count()``: the solvers training together,
    here the ranks of the MPI job (1 without a launcher)."""
    return job_world().size


def solver_rank():
    """pycaffe's ``caffe.solver_rank()``: this process's MPI rank (0 without a launcher)."""
    return job_world().rank


def set_solver_count(count):
    """pycaffe's ``caffe.set_solver_count(n)``: accepted when ``n`` is the
    number of ranks (nothing to set); otherwise a CaffeError saying to run
    the script under mpiexec, since a script cannot make more solvers join."""
    if int(count) != solver_count():
        raise CaffeError("set_solver_count(%d): this process is one of %d solver(s); %s"
                         % (int(count), solver_count(), RUN_UNDER_MPIEXEC))


def set_solver_rank(rank):
    """pycaffe's ``caffe.set_solver_rank(r)``: accepted when ``r`` is this
    process's rank; otherwise a CaffeError saying to run under mpiexec."""
    if int(rank) != solver_rank():
        raise CaffeError("set_solver_rank(%d): this process is rank %d of %d; %s"
                         % (int(rank), solver_rank(), solver_count(), RUN_UNDER_MPIEXEC))


def set_multiprocess(multiprocess):
    """pycaffe's ``caffe.set_multiprocess(flag)``: several solvers are
    always several processes here, so True is accepted, and False where
    there is one solver; False under a job of several ranks is a CaffeError."""
    if not multiprocess and solver_count() > 1:
        raise CaffeError("set_multiprocess(False): the %d solvers of this job are %d processes (MPI ranks); "
                         "caffempi has no solvers sharing a process" % (solver_count(), solver_count()))


def has_nccl():
    """pycaffe's ``caffe.has_nccl()``: whether :class:`NCCL` (``NCCL.new_uid()``,
    ``NCCL(solver, uid)``) works in this process, as BVLC's test_nccl.py and
    python/train.py read it.  caffempi refuses pycaffe's NCCL recipe (its
    ranks are MPI processes: see the module's docstring), so this is False
    everywhere, on GPUs with NCCL too.  Whether caffempi's own NCCL gradient
    transport can run here, which a job's GPU solvers use by themselves
    (--comm=auto), is :func:`nccl_transport_available`."""
    return NCCL.works


def nccl_transport_available():
    """Whether caffempi's NCCL gradient transport can run in this process:
    CuPy sees a GPU and loads NCCL."""
    try:
        usable_cupy("nccl_transport_available")
    except CaffeError:
        return False
    from .parallel.transports.nccl import nccl_loaded
    return nccl_loaded()


class NCCL:
    """pycaffe's ``caffe.NCCL(solver, uid)`` and ``NCCL.new_uid()``, with
    which BVLC's python/train.py joins the processes it starts: refused with
    a CaffeError naming what to run instead (see the module's docstring);
    ``works`` (False) is what :func:`has_nccl` reports."""

    works = False

    def __init__(self, solver=None, uid=None):
        raise CaffeError("caffe.NCCL: " + RUN_UNDER_MPIEXEC)

    @staticmethod
    def new_uid():
        raise CaffeError("caffe.NCCL.new_uid: " + RUN_UNDER_MPIEXEC)
