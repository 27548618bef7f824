"""Start-up of a rank: the process settings its MPI needs, per-rank logging,
abort on any rank's error (a normal exit on an error all ranks agreed on),
its share of the host's cores, and its gradient strategy."""
import logging
import os
import sys
import threading
import traceback

from ..common import AgreedError, CaffeError, init_logging, log
from .buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
from .comm import get_world
from .easgd import ElasticAveraging
from .sfb import SFB_MODES, SufficientFactorBroadcast
from .sync import BucketedAllreduce
from .transports import COMM_DTYPES, check_comm_mode
from .watchdog import DEFAULT_TIMEOUT


def init_rank_logging(world=None, level=logging.INFO, stream=None):
    """Rank 0 logs at ``level``; the other ranks log warnings and errors only,
    prefixed with ``[rank r] ``."""
    world = world or get_world()
    if world.size == 1:
        init_logging(level, stream=stream)
    elif world.rank == 0:
        init_logging(level, prefix="", stream=stream)
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
    """The data-parallel flags, defined through the CLI's define_flag."""
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


def setup_parallel(comm="auto", bucket_mb=None, sync="sgd", tau=10, alpha=0.2, debug=False,
                   level=logging.INFO, comm_timeout=DEFAULT_TIMEOUT, sfb="off", link_gbps=0.0, gemm_gflops=0.0,
                   comm_dtype="fp32"):
    """Everything a rank does before building its solver: the process
    settings for ``comm``, the world (MPI only under a launcher), per-rank
    logging, abort on errors, the collective watchdog (``comm_timeout``
    seconds), its share of the cores, the gradient strategy.
    Returns (world, sync); pass ``sync=`` to the solver."""
    check_comm_mode(comm)
    init_process(comm)
    world = get_world(comm)
    world.set_comm_timeout(comm_timeout)
    init_rank_logging(world, level)
    install_abort_handlers(world, debug)
    if world.size > 1 and world.rank == 0:
        log.info("MPI: %d ranks (%s), rank 0 on %s", world.size, world.library_version(),
                 world.processor_name())
    share_cores(world)
    return world, make_gradient_sync(world, sync, comm, bucket_mb, tau, alpha, sfb, link_gbps, gemm_gflops,
                                     comm_dtype)


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
