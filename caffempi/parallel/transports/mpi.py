"""Sums of host (NumPy) buffers through MPI: one small class per way of
making them progress (``--comm`` blocking, nopoll, async, overlap, thread).

Gradient traffic gets its own communicator (a Dup of the world's): the
solver's blocking collectives on COMM_WORLD (displayed losses, actions) may
then run while buckets are in flight, from another thread too.
"""
import queue
import threading

from ...backend import denormals
from ...common import CaffeError
from .base import Transport, scale_in_place, yield_core


class MPITransport(Transport):
    """The communicator and the blocking sum the others share."""
    mode = None          # the --comm name

    def __init__(self, world):
        self.MPI = world.MPI
        self.comm = world.comm.Dup()
        self.name = "mpi-host-" + self.mode

    def _allreduce_now(self, buf):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def close(self):
        if self.comm is not None:
            try:
                self.comm.Free()
            except Exception:
                pass
            self.comm = None


class BlockingTransport(MPITransport):
    """``--comm=blocking``: one Allreduce of the whole gradient after
    backward (the baseline the overlapped modes are measured against)."""
    mode = "blocking"
    overlaps_backward = False

    def allreduce_start(self, buf, scale=1.0):
        self._allreduce_now(buf)
        scale_in_place(buf, scale)

    def wait(self, handle):
        pass


class IallreduceTransport(MPITransport):
    """``--comm=nopoll``: an Iallreduce per bucket and nothing driving it
    until ``wait`` (shows what the MPI does on its own)."""
    mode = "nopoll"

    def allreduce_start(self, buf, scale=1.0):
        """The handle: (request, buf, scale)."""
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM), buf, scale

    def wait(self, handle):
        request, buf, scale = handle
        # yielding between tests: see base.yield_core
        while not request.Test():
            yield_core()
        scale_in_place(buf, scale)


class AsyncProgressTransport(IallreduceTransport):
    """``--comm=async``: as nopoll, with MPICH's own progress thread moving
    the sums (MPIR_CVAR_ASYNC_PROGRESS=1, which rank.init_process sets
    before MPI starts)."""
    mode = "async"


class OverlapTransport(IallreduceTransport):
    """``--comm=overlap``: Iallreduce per bucket, tested (MPI_Testall) at
    every :meth:`poll`: the reducer polls after every layer's backward and,
    on the CPU, between the chunks of a layer's kernels, since MPICH
    progresses a pending sum only inside MPI calls."""
    mode = "overlap"

    def __init__(self, world):
        super().__init__(world)
        self._pending = []

    def allreduce_start(self, buf, scale=1.0):
        handle = super().allreduce_start(buf, scale)
        self._pending.append(handle[0])
        self.MPI.Request.Testall(self._pending)
        return handle

    def poll(self):
        if self._pending and self.MPI.Request.Testall(self._pending):
            self._pending = []
        return not self._pending

    def wait(self, handle):
        super().wait(handle)
        self._pending = [r for r in self._pending if r != self.MPI.REQUEST_NULL]


class CommThread:
    """A communication thread running the jobs handed to it one after
    another, in the order given (so collectives keep the same order on every
    rank), and, given ``progress``, calling it between jobs for as long as
    it returns False (work pending), as backward's kernels call a polled
    transport's ``poll``.  It calls MPI beside the main thread, hence needs
    MPI_THREAD_MULTIPLE; the GIL is released inside MPI and NumPy's large
    array operations.  Across hosts it keeps the link busy while backward
    computes, which polled sums do not over TCP (docs/design/parallel.md)."""

    def __init__(self, world, what, progress=None):
        if world.thread_level < world.MPI.THREAD_MULTIPLE:
            raise CaffeError("%s needs MPI_THREAD_MULTIPLE; this MPI gives level %d" % (what, world.thread_level))
        self._queue = queue.Queue()
        self._progress = progress
        self._error = None
        self._thread = threading.Thread(target=self._run, name="caffempi-comm", daemon=True)
        self._thread.start()

    def submit(self, job):
        """Run ``job()`` on the thread after the jobs before it; returns an
        event set once it has run (for :meth:`wait`)."""
        done = threading.Event()
        self._queue.put((job, done))
        return done

    def wait(self, event):
        """Return once ``event`` is set (a job's, or one a job or
        ``progress`` sets); raises what a job or ``progress`` raised."""
        while not event.wait(0.05):
            if self._error is not None:
                break
        if self._error is not None:
            raise self._error

    def _run(self):
        denormals.apply_here()      # the jobs compute on this thread
        pending = False
        while True:
            try:
                item = self._queue.get(block=not pending)
            except queue.Empty:
                item = ()
            if item is None:
                return
            try:
                if item:
                    job, done = item
                    job()
                    done.set()
                pending = self._progress is not None and not self._progress()
            except BaseException as e:  # reported to the waiting thread
                self._error, pending = e, False
            if pending:
                yield_core()

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None


class ThreadTransport(MPITransport):
    """``--comm=thread``: a communication thread (:class:`CommThread`) runs
    a blocking Allreduce per bucket."""
    mode = "thread"

    def __init__(self, world):
        self._thread = CommThread(world, "--comm=thread")
        super().__init__(world)

    def allreduce_start(self, buf, scale=1.0):
        def job():
            self._allreduce_now(buf)
            scale_in_place(buf, scale)
        return self._thread.submit(job)

    def wait(self, handle):
        self._thread.wait(handle)

    def close(self):
        self._thread.close()
        super().close()


#: --comm name -> host transport class
HOST_TRANSPORTS = {cls.mode: cls for cls in (BlockingTransport, IallreduceTransport, AsyncProgressTransport,
                                             OverlapTransport, ThreadTransport)}
