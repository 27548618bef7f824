"""Start-up of an MPI job: per-rank logging, abort on any rank's error (a
normal exit on an error all ranks agreed on), and the broadcast of the
initial weights and solver state from rank 0."""
import logging
import os
import signal
import sys
import threading
import traceback


from ..common import AgreedError, CaffeError, init_logging, log
from .comm import get_world


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


# ------------------------------------------------------------------ state sync
def broadcast_weights(net, world=None, root=0):
    """Make every rank's weights rank 0's (fillers, --weights, --snapshot)."""
    world = world or get_world()
    if world.size > 1:
        world.bcast_array(net.param_data, root)


def check_same_net(net, world=None):
    """Every rank must have built the same parameter layout."""
    world = world or get_world()
    if world.size == 1:
        return
    sig = (len(net.layers), int(net.param_data.size), tuple(net.layer_names))
    sigs = world.allgather(sig)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if bad:
        raise CaffeError("ranks %s built a different net than rank 0 (layers/params %s vs %s)"
                         % (bad, sigs[bad[0]][:2], sigs[0][:2]))


def per_rank_seed(seed, world=None):
    """A seed for this rank's own random draws (dropout, shuffling)."""
    world = world or get_world()
    return (int(seed) + 7919 * world.rank) % (2 ** 32)


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


class StopFlag:
    """SIGINT/SIGHUP arrive at ranks at different moments; a rank only records
    them, and the ranks agree each iteration (reducer.any) so all stop at the
    same one."""

    def __init__(self):
        self.sigint = False
        self.sighup = False

    def install(self):
        def on_int(signum, frame):
            self.sigint = True

        def on_hup(signum, frame):
            self.sighup = True
        signal.signal(signal.SIGINT, on_int)
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, on_hup)
        return self


# ------------------------------------------------------------ CLI entry seam
def add_parallel_flags(define_flag):
    """The data-parallel flags, defined through the CLI's define_flag."""
    from .reducer import DEFAULT_BUCKET_MB
    define_flag("comm", "auto", "Optional; gradient averaging: auto (CPU nets: shm when every rank is "
                "on one host, else overlap; GPU nets: nccl when NCCL can join the ranks, else overlap), "
                "shm (ranks of one host sum in shared memory, whichever waits doing the sums), "
                "overlap (MPI Iallreduce per bucket during backward, polled between layers), thread "
                "(a communication thread), async (MPICH progress thread), nopoll, blocking (one "
                "allreduce after backward), or nccl (GPU: NCCL per bucket on a side stream).")
    define_flag("bucket_mb", DEFAULT_BUCKET_MB, "Optional; allreduce bucket size in MB (whole layers, "
                "reverse layer order; the first bucket is at most 1 MB).")
    define_flag("sync", "sgd", "Optional; sgd (average gradients every iteration) or easgd "
                "(elastic averaging every --tau steps).")
    define_flag("tau", 10, "Optional; EASGD communication period in iterations.")
    define_flag("alpha", 0.2, "Optional; EASGD moving rate.")


def setup_parallel(comm="auto", bucket_mb=None, sync="sgd", tau=10, alpha=0.2, debug=False,
                   level=logging.INFO):
    """Everything a rank does before building its solver: the world (MPI only
    under a launcher), per-rank logging, abort on errors, the reducer.
    Returns (world, reducer); pass ``reducer=`` to the solver."""
    from .reducer import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, COMM_MODES, Reducer
    if comm not in COMM_MODES:
        raise CaffeError("unknown --comm '%s' (one of %s)" % (comm, ", ".join(COMM_MODES)))
    world = get_world(comm)
    init_rank_logging(world, level)
    install_abort_handlers(world, debug)
    if world.size > 1 and world.rank == 0:
        log.info("MPI: %d ranks (%s), rank 0 on %s", world.size, world.library_version(),
                 world.processor_name())
    share_cores(world)
    if sync == "easgd":
        from .easgd import EASGDReducer
        reducer = EASGDReducer(world, tau, alpha)
    elif sync == "sgd":
        bucket = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
        reducer = Reducer(world, comm, bucket, min(bucket, DEFAULT_FIRST_BUCKET_MB))
    else:
        raise CaffeError("unknown --sync '%s' (sgd or easgd)" % sync)
    return world, reducer


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
