"""Start-up of a rank: the process settings its MPI needs, per-rank logging,
abort on any rank's error (a normal exit on an error all ranks agreed on),
its share of the host's cores, and its gradient strategy (for the CLI,
:func:`setup_parallel`; for a Python script's solver under mpiexec,
:func:`default_gradient_sync`); and the start of a whole job from one
command without a launcher (``--ranks``, ``--gpu`` lists:
:func:`ranks_to_launch`, :func:`run_under_mpiexec`)."""
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import traceback

from .. import config
from ..common import AgreedError, CaffeError, init_logging, log
from .buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
from .comm import SingleWorld, get_world, launched_by_mpi
from .easgd import ElasticAveraging
from .sfb import SFB_MODES, SufficientFactorBroadcast
from .sync import BucketedAllreduce
from .transports import COMM_DTYPES, check_comm_mode
from .watchdog import DEFAULT_TIMEOUT


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
            msg = "%scaffempi: error: %s" % (prefix, " ".join(str(exc).split()))
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


def abort_job(world=None, code=1):
    """End every rank now (MPI_Abort); never returns."""
    world = world or get_world()
    world.abort(code)


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


# ------------------------------------------------------------ CLI entry seam
def add_parallel_flags(define_flag):
    """The data-parallel flags, defined through a flag set's ``define``."""
    define_flag("ranks", 0, "Optional; for 'train' without a launcher: run on this many ranks of this host, "
                "under the mpiexec beside this Python (else the one on PATH), with the same flags; 0: one rank "
                "per --gpu id (one without --gpu). Under mpiexec: must be the job's size.")
    define_flag("comm", "auto", "Optional; gradient averaging: auto (CPU nets: shm when every rank is "
                "on one host, hierarchical when the ranks span hosts and some host has several, else "
                "thread; GPU nets: nccl when NCCL can join the ranks, else overlap), "
                "shm (ranks of one host sum in shared memory, whichever waits doing the sums), "
                "hierarchical (sum on each host, then across hosts by one rank a host, then share), "
                "overlap (MPI Iallreduce per bucket during backward, polled between layers), thread "
                "(a communication thread), async (MPICH progress thread), nopoll, blocking (one "
                "allreduce after backward), or nccl (GPU: NCCL per bucket on a side stream).")
    define_flag("bucket_mb", DEFAULT_BUCKET_MB, "Optional; allreduce bucket size in MB (whole layers, "
                "reverse layer order; the first bucket is at most 1 MB).")
    define_flag("sync", "sgd", "Optional; sgd (average gradients every iteration) or easgd "
                "(elastic averaging every --tau steps).")
    define_flag("tau", 10, "Optional; EASGD communication period in iterations.")
    define_flag("alpha", 0.2, "Optional; EASGD moving rate.")
    define_flag("sfb", "auto", "Optional; sufficient-factor broadcast for InnerProduct weights (Poseidon): "
                "auto (a cost model chooses per layer at start-up), on (every eligible layer) or off.")
    define_flag("link_gbps", 0.0, "Optional; the link bandwidth the --sfb cost model assumes, in Gbit/s "
                "(0: measured at start-up).")
    define_flag("gemm_gflops", 0.0, "Optional; the GEMM rate the --sfb cost model assumes, in GFLOP/s "
                "(0: measured at start-up).")
    define_flag("comm_dtype", "fp32", "Optional; fp16 sends gradient buckets and sufficient factors as "
                "float16, summed in float32 (half the bytes; CPU nets), or fp32.")
    define_flag("comm_timeout", DEFAULT_TIMEOUT, "Optional; seconds a rank may wait in one collective "
                "(gradient bucket, agreement, broadcast) before it names what it waited for and ends the "
                "job; 0: wait forever.")


def init_process(comm):
    """What this process's environment must say before MPI starts, for
    ``--comm=comm``: ``async`` asks MPICH for its progress thread
    (MPIR_CVAR_ASYNC_PROGRESS, read only at MPI_Init).  An explicit start-up
    step of the command (setup_parallel), not a side effect of get_world."""
    if comm == "async":
        os.environ["MPIR_CVAR_ASYNC_PROGRESS"] = "1"


def make_gradient_sync(world, sync="sgd", comm="auto", bucket_mb=None, tau=10, alpha=0.2, sfb="off",
                       link_gbps=0.0, gemm_gflops=0.0, comm_dtype="fp32"):
    """The strategy for ``--sync`` (sgd: :class:`BucketedAllreduce` over
    ``--comm``, with sufficient factors unless ``sfb`` is off; easgd:
    :class:`ElasticAveraging`, which sends no gradients)."""
    check_comm_mode(comm)
    if comm_dtype not in COMM_DTYPES:
        raise CaffeError("unknown --comm_dtype '%s' (fp32 or fp16)" % comm_dtype)
    if sfb not in SFB_MODES:
        raise CaffeError("unknown --sfb '%s' (auto, on or off)" % sfb)
    if sync == "sgd":
        bucket = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
        first = min(bucket, DEFAULT_FIRST_BUCKET_MB)
        if sfb != "off":
            return SufficientFactorBroadcast(world, comm, bucket, first, sfb, link_gbps, gemm_gflops,
                                             comm_dtype=comm_dtype)
        return BucketedAllreduce(world, comm, bucket, first, comm_dtype=comm_dtype)
    if sync == "easgd":
        return ElasticAveraging(world, tau, alpha)
    raise CaffeError("unknown --sync '%s' (sgd or easgd)" % sync)


_started_world = None       # the world start_rank set up in this process


def start_rank(comm="auto", debug=False, comm_timeout=DEFAULT_TIMEOUT, ranks=0):
    """The process part of :func:`setup_parallel`: the process settings for
    ``comm``, the world (MPI only under a launcher), per-rank logging, abort
    on errors, the collective watchdog (``comm_timeout`` seconds), its share
    of the cores.  ``ranks`` (--ranks), when not 0, must be the world's
    size.  Returns the world."""
    global _started_world
    check_comm_mode(comm)
    init_process(comm)
    world = get_world(comm)
    world.set_comm_timeout(comm_timeout)
    init_rank_logging(world)
    install_abort_handlers(world, debug)
    if ranks and ranks != world.size:
        raise AgreedError("--ranks=%d, but this job has %d rank%s" % (ranks, world.size, "s"[world.size == 1:]))
    if world.size > 1 and world.rank == 0:
        log.info("MPI: %d ranks (%s), rank 0 on %s", world.size, world.library_version(),
                 world.processor_name())
    share_cores(world)
    _started_world = world
    return world


def setup_parallel(comm="auto", bucket_mb=None, sync="sgd", tau=10, alpha=0.2, debug=False,
                   comm_timeout=DEFAULT_TIMEOUT, sfb="off", link_gbps=0.0, gemm_gflops=0.0,
                   comm_dtype="fp32", ranks=0):
    """Everything a rank does before building its solver: :func:`start_rank`,
    then the gradient strategy.  Returns (world, sync); pass ``sync=`` to
    the solver."""
    world = start_rank(comm, debug, comm_timeout, ranks)
    return world, make_gradient_sync(world, sync, comm, bucket_mb, tau, alpha, sfb, link_gbps, gemm_gflops,
                                     comm_dtype)


# ---------------------------------------------------- Python script seam
def parallel_flag_defaults():
    """{flag: default} of the data-parallel flags, read from
    :func:`add_parallel_flags` (the one place they are written)."""
    defaults = {}
    add_parallel_flags(lambda name, default, help: defaults.setdefault(name, default))
    return defaults


def script_world():
    """The world of a Python script that no ``caffempi train`` started
    (pycaffe's ``caffe.SGDSolver(path)`` or ``caffe.solver_count()`` under
    ``mpiexec -n N python script.py``): the first call starts the rank as
    train does with its default flags (:func:`start_rank`), so errors abort
    the job instead of hanging it; later calls, and a process that
    setup_parallel started, get the world already made."""
    if _started_world is None:
        defaults = parallel_flag_defaults()
        start_rank(defaults["comm"], comm_timeout=defaults["comm_timeout"])
    return _started_world


def default_gradient_sync():
    """The gradient strategy of a solver made without ``sync=``: under a
    launcher (any number of ranks), train's with its default flags
    (--sync=sgd --comm=auto --sfb=auto ...) over :func:`script_world`, so a
    script's solver shards the data and averages the gradients as train's
    does instead of each rank training alone on all of it; otherwise one
    process (no MPI import)."""
    if not launched_by_mpi():
        return BucketedAllreduce(SingleWorld())
    d = parallel_flag_defaults()
    return make_gradient_sync(script_world(), d["sync"], d["comm"], d["bucket_mb"], d["tau"], d["alpha"],
                              d["sfb"], d["link_gbps"], d["gemm_gflops"], d["comm_dtype"])


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


# ----------------------------------------------- one command, many ranks
def ranks_to_launch(ranks, gpu):
    """How many ranks a ``caffempi train`` started without a launcher runs
    under mpiexec: ``ranks`` (--ranks), or when it is 0 one per --gpu id
    (--gpu=all: every device of this host; each rank then takes its id,
    cli.select_backend).  0: run in this process (one rank, or started by a
    launcher already)."""
    if ranks < 0:
        raise CaffeError("--ranks=%d: expected a number of ranks (0: one per --gpu id)" % ranks)
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
    """The mpiexec beside this Python (the mpich wheel's, in a virtual
    environment), else the one on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def run_under_mpiexec(ranks, command):
    """Run ``mpiexec -n ranks command...`` and return its exit status (128 +
    the signal's number when a signal ended it).  SIGINT and SIGTERM sent to
    this process go to mpiexec, which passes them to every rank; SIGHUP goes
    to the ranks themselves (MPICH's mpiexec dies of SIGHUP instead of passing
    it on), so the --sig*_effect flags work as under mpiexec.  mpiexec runs in
    its own process group, so a Ctrl-C at the terminal reaches the ranks once,
    through this process; its stdin is empty."""
    launcher = mpiexec_path()
    if launcher is None:
        raise CaffeError("%d ranks need mpiexec: none beside %s or on PATH (pip install mpich)"
                         % (ranks, sys.executable))
    if importlib.util.find_spec("mpi4py") is None:
        raise CaffeError("%d ranks need mpi4py (pip install mpi4py)" % ranks)
    proc = subprocess.Popen([launcher, "-n", str(ranks)] + list(command), stdin=subprocess.DEVNULL,
                            process_group=0)

    def forward(signum, frame):
        pids = _processes_of_this_python(proc.pid) if signum == getattr(signal, "SIGHUP", None) else []
        for pid in pids or [proc.pid]:
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
