"""Start-up of a rank: the process settings its MPI needs, per-rank logging,
abort on any rank's error (a normal exit on an error all ranks agreed on),
its share of the host's cores, and its gradient strategy: for the CLI,
:func:`setup_parallel` with the run's :class:`ParallelConfig`; for a
Python script's solver under mpiexec, :func:`default_gradient_sync` with
the defaults.  (Starting a whole job from one command: :mod:`.launch`.)"""
import logging
import os
import sys
import threading
import traceback

from ..common import AgreedError, CaffeError, init_logging, log, printable
from .comm import SingleWorld, current_world, get_world, launched_by_mpi
from .config import ParallelConfig
from .sync import BucketedAllreduce


def init_rank_logging(world=None, stream=None, level=logging.NOTSET):
    """Rank 0 logs to stderr at the level glog's flags chose (and at least
    ``level``); the other ranks write warnings and errors only there,
    prefixed with ``[rank r] `` (their --log_dir files get all of their own
    lines)."""
    world = world or get_world()
    if world.size == 1 or world.rank == 0:
        init_logging(level, stream=stream)
    else:
        init_logging(max(level, logging.WARNING), prefix="[rank %d] " % world.rank, stream=stream)


def _report(world, exc_type, exc, tb, debug=False):
    """Print this rank's error to stderr (directly, not through logging, so
    it is out before MPI_Abort tears the job down).  An AgreedError is the
    job's, not this rank's: no rank prefix."""
    prefix = "[rank %d] " % world.rank if world.size > 1 and not issubclass(exc_type, AgreedError) else ""
    try:
        if issubclass(exc_type, CaffeError) and not debug:
            msg = "%scaffempi: error: %s" % (prefix, printable(" ".join(str(exc).split())))
        else:
            msg = prefix + "".join(traceback.format_exception(exc_type, exc, tb)).rstrip()
    except Exception:
        msg = "%s%s: %s" % (prefix, exc_type.__name__, exc)
    try:
        sys.stdout.flush()
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except Exception:
        os.write(2, (msg + "\n").encode("utf-8", "replace"))


def _fail(world, exc_type, exc, tb, debug=False):
    """Report an exception and abort the job, unless every rank raised it
    together (AgreedError): then rank 0 alone reports it and this returns, so
    the rank exits with status 1 like all the others and MPI finalizes."""
    agreed = issubclass(exc_type, AgreedError)
    if world.rank == 0 or not agreed:
        _report(world, exc_type, exc, tb, debug)
    if not agreed:
        world.abort(1)
    leave_together(1, world)


def leave_together(rc, world=None):
    """End this rank with status ``rc`` where every rank stops together (an
    AgreedError): once all ranks are here, without MPI_Finalize.  Open MPI's
    mpirun ends the job as soon as one rank exits non-zero, and a rank it
    kills inside MPI_Finalize makes its PMIx server print a "PMIX ERROR:
    PMIX_ERR_UNREACH" line; with no rank finalizing there is none (MPICH
    does not mind either way).  With one rank, returns ``rc``."""
    world = world or current_world()
    if world is None or world.size == 1:
        return rc
    world.barrier("the other ranks, to stop together")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def install_abort_handlers(world=None, debug=False):
    """Any uncaught exception, in any thread of any rank, prints that rank's
    error and aborts the whole job with a non-zero exit (no hang in a
    collective the failed rank will never reach); an AgreedError ends every
    rank normally instead (see _fail)."""
    world = world or get_world()
    if world.size == 1:
        return

    def excepthook(exc_type, exc, tb):
        if exc_type is SystemExit and not exc.code:
            return
        _fail(world, exc_type, exc, tb, debug)

    def thread_hook(args):
        excepthook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_hook


def run_guarded(fn, *args, world=None, debug=False, **kwargs):
    """Call fn; under MPI with several ranks an exception, or a non-zero
    SystemExit, on this rank aborts the job; an AgreedError (raised on every
    rank) exits every rank with status 1 instead.  Returns fn's result."""
    world = world or get_world()
    if world.size == 1:
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            sys.stderr.write("[rank %d] %s\n" % (world.rank, e.code))
        sys.stderr.flush()
        world.abort(code)
    except BaseException:
        _fail(world, *sys.exc_info(), debug=debug)
        raise SystemExit(1)


def share_cores(world=None):
    """With several ranks on a host and no thread count given
    (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS), each rank would run a thread
    per core and the ranks' threads would fight over the cores: give each
    rank its share instead, the cores it may run on divided by the ranks on
    the host (or all of them where the launcher bound the rank to fewer
    than the host's cores).  Returns the thread count set, or None."""
    world = world or get_world()
    if world.size == 1:
        return None
    _, on_host = world.local_rank()      # collective: before any rank may return
    if "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    from ..backend import threads
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bound = allowed < (os.cpu_count() or allowed)
    count = allowed if bound else max(1, allowed // on_host)
    threads.set_thread_count(count)
    if world.rank == 0:
        log.info("%d ranks on this host: %d kernel thread%s each (OPENBLAS_NUM_THREADS sets it)",
                 on_host, count, "" if count == 1 else "s")
    return count


def init_process(comm):
    """What this process's environment must say before MPI starts, for
    ``--comm=comm``: ``async`` asks MPICH for its progress thread
    (MPIR_CVAR_ASYNC_PROGRESS, read only at MPI_Init).  An explicit start-up
    step of the command (setup_parallel), not a side effect of get_world."""
    if comm == "async":
        os.environ["MPIR_CVAR_ASYNC_PROGRESS"] = "1"


def start_rank(config, debug=False):
    """The process part of :func:`setup_parallel`: the process settings for
    ``config.comm``, the world (MPI only under a launcher), per-rank
    logging, abort on errors, the collective watchdog
    (``config.comm_timeout`` seconds), its share of the cores.
    ``config.ranks``, when not 0, must be the world's size.  Returns the
    world, marked started."""
    init_process(config.comm)
    world = get_world(config.comm)
    world.set_comm_timeout(config.comm_timeout)
    init_rank_logging(world)
    install_abort_handlers(world, debug)
    if config.ranks and config.ranks != world.size:
        raise AgreedError("--ranks=%d, but this job has %d rank%s"
                          % (config.ranks, world.size, "s"[world.size == 1:]))
    if world.size > 1 and world.rank == 0:
        log.info("MPI: %d ranks (%s), rank 0 on %s", world.size, printable(world.library_version()),
                 printable(world.processor_name()))
    share_cores(world)
    world.started = True
    return world


def setup_parallel(config=None, debug=False):
    """Everything a rank does before building its solver: :func:`start_rank`,
    then the gradient strategy of ``config`` (default: train's defaults).
    Returns (world, sync); pass ``sync=`` to the solver."""
    config = config or ParallelConfig()
    world = start_rank(config, debug)
    return world, config.make_sync(world)


# ---------------------------------------------------- Python script seam
def script_world():
    """The world of a Python script that no ``caffempi train`` started
    (pycaffe's ``caffe.SGDSolver(path)`` or ``caffe.solver_count()`` under
    ``mpiexec -n N python script.py``): the first call starts the rank as
    train does with its default flags (:func:`start_rank`), so errors abort
    the job instead of hanging it; later calls, and a process that
    setup_parallel started, get the world already made."""
    world = current_world()
    if world is None or not world.started:
        world = start_rank(ParallelConfig())
    return world


def default_gradient_sync():
    """The gradient strategy of a pycaffe solver made without ``sync=``:
    under a launcher (any number of ranks), train's with its default flags
    (--sync=sgd --comm=auto --sfb=auto ...) over :func:`script_world`, so a
    script's solver shards the data and averages the gradients as train's
    does instead of each rank training alone on all of it; otherwise one
    process (no MPI import)."""
    if not launched_by_mpi():
        return BucketedAllreduce(SingleWorld())
    return ParallelConfig().make_sync(script_world())


def exit_code(rc, world=None):
    """Under MPI a rank that fails must not just exit (the others would wait
    in a collective, and mpi4py's MPI_Finalize at exit would hang): abort the
    whole job with rc instead.  Returns rc when it is 0 or there is one rank."""
    if world is None:
        try:
            world = get_world()
        except CaffeError:      # no world could be made (the error being reported): nothing to abort
            return rc
    if rc and world.size > 1:
        world.abort(int(rc))
    return rc
