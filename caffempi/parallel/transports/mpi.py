"""Sums of host (NumPy) buffers through MPI: one small class per way of
making them progress (``--comm`` blocking, nopoll, async, overlap, thread).

Gradient traffic gets its own communicator (a Dup of the world's): the
solver's blocking collectives on COMM_WORLD (displayed losses, actions) may
then run while buckets are in flight, from another thread too.
"""
import queue
import threading

from ...backend import denormals, threads
from ...common import CaffeError
from .base import Transport, yield_core


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

    def allreduce_start(self, buf):
        self._allreduce_now(buf)

    def wait(self, handle):
        pass


class IallreduceTransport(MPITransport):
    """``--comm=nopoll``: an Iallreduce per bucket and nothing driving it
    until ``wait`` (shows what the MPI does on its own)."""
    mode = "nopoll"

    def allreduce_start(self, buf):
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def wait(self, handle):
        # yielding between tests: see base.yield_core
        while not handle.Test():
            yield_core()


class AsyncProgressTransport(IallreduceTransport):
    """``--comm=async``: as nopoll, with MPICH's own progress thread moving
    the sums (MPIR_CVAR_ASYNC_PROGRESS=1, which launch.init_process sets
    before MPI starts)."""
    mode = "async"


class OverlapTransport(IallreduceTransport):
    """``--comm=overlap``: Iallreduce per bucket, MPI_Testall after every
    layer's backward and, on the CPU, between the chunks of a layer's
    kernels (threads.set_progress), since MPICH progresses a pending sum
    only inside MPI calls."""
    mode = "overlap"

    def __init__(self, world):
        super().__init__(world)
        self._pending = []

    def allreduce_start(self, buf):
        req = super().allreduce_start(buf)
        self._pending.append(req)
        self.MPI.Request.Testall(self._pending)
        # a long layer would otherwise leave the sum idle until its end
        threads.set_progress(self.poll)
        return req

    def poll(self):
        if self._pending and self.MPI.Request.Testall(self._pending):
            self._pending = []
        return not self._pending

    def backward_end(self):
        threads.set_progress(None)

    def wait(self, handle):
        super().wait(handle)
        self._pending = [r for r in self._pending if r != self.MPI.REQUEST_NULL]

    def close(self):
        self.backward_end()
        super().close()


class ThreadTransport(MPITransport):
    """``--comm=thread``: a communication thread runs a blocking Allreduce
    per bucket (needs MPI_THREAD_MULTIPLE; the GIL is released inside MPI
    and BLAS)."""
    mode = "thread"

    def __init__(self, world):
        if world.thread_level < world.MPI.THREAD_MULTIPLE:
            raise CaffeError("--comm=thread needs MPI_THREAD_MULTIPLE; this MPI gives level %d"
                             % world.thread_level)
        super().__init__(world)
        self._queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="caffempi-comm", daemon=True)
        self._thread.start()

    def allreduce_start(self, buf):
        done = threading.Event()
        self._queue.put((buf, done))
        return done

    def wait(self, handle):
        handle.wait()
        if self._error is not None:
            raise self._error

    def _run(self):
        denormals.apply_here()      # MPI's sums run on this thread
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, done = item
            try:
                self._allreduce_now(buf)
            except BaseException as e:  # reported to the waiting thread
                self._error = e
            done.set()

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        super().close()


#: --comm name -> host transport class
HOST_TRANSPORTS = {cls.mode: cls for cls in (BlockingTransport, IallreduceTransport, AsyncProgressTransport,
                                             OverlapTransport, ThreadTransport)}
