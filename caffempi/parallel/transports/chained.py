"""Sums made of several non-blocking MPI steps a bucket, chained without
blocking (the base of the hierarchical and exchange transports).

Every rank issues the steps of its buckets in bucket order (a bucket issues
a step only once every earlier bucket has issued it) and each step runs on a
communicator of its own, so the collectives on each communicator come in the
same order on every rank, as MPI requires (on one communicator, one rank
could issue bucket 0's second step before bucket 1's first, another the
other way round).
Progress as in ``overlap``: the caller's :meth:`poll` runs between layers
and, on the CPU, between the chunks of a layer's kernels; or, with ``comm_thread``,
a communication thread (:class:`~caffempi.parallel.transports.mpi.CommThread`)
polls them, so that the buckets' steps overlap as when polled (run
blocking, bucket after bucket, the link would idle during each bucket's
conversions: docs/design/parallel.md).
"""
import threading
from abc import abstractmethod

from .base import Transport, scale_in_place, yield_core
from .mpi import CommThread


class Chain:
    """One bucket's sum, to be multiplied by ``scale``: ``step`` counts the
    steps completed."""

    def __init__(self, buf, scale=1.0):
        self.buf, self.scale, self.step, self.request = buf, scale, 0, None
        self.done = threading.Event()


class ChainedTransport(Transport):
    steps = 1            # steps a bucket's sum takes

    def __init__(self, world, comm_thread=False):
        """``comm_thread``: poll on a communication thread (--comm=thread;
        needs MPI_THREAD_MULTIPLE), not on the computing one."""
        self.MPI = world.MPI
        self._chains = []                 # started and not complete, in start order
        self.comm_thread = CommThread(world, "--comm=thread", self._progress) if comm_thread else None

    def allreduce_start(self, buf, scale=1.0):
        chain = self.make_chain(buf, scale)
        if self.comm_thread is not None:
            self.comm_thread.submit(lambda: self._chains.append(chain))   # only that thread polls
            return chain
        self._chains.append(chain)
        self._progress()
        return chain

    def make_chain(self, buf, scale):
        return Chain(buf, scale)

    @abstractmethod
    def issue(self, chain):
        """Start step ``chain.step`` of ``chain``; returns its MPI request."""

    def complete(self, chain):
        """All steps of ``chain`` are done (the first unfinished chain):
        the sum is in its buffer, to be scaled."""
        scale_in_place(chain.buf, chain.scale)

    def poll(self):
        # with a communication thread, only that thread touches the chains
        return True if self.comm_thread is not None else self._progress()

    def _progress(self):
        """Issue and test the chains' steps; True when none is pending."""
        limit = self.steps                # the fewest steps an earlier bucket has issued
        for c in self._chains:
            while c.step < self.steps:
                if c.request is not None:
                    if not c.request.Test():
                        break
                    c.step, c.request = c.step + 1, None
                elif c.step < limit:
                    c.request = self.issue(c)
                else:
                    break
            limit = min(limit, c.step + (c.request is not None))
        while self._chains and self._chains[0].step == self.steps:
            chain = self._chains.pop(0)
            self.complete(chain)
            chain.done.set()
        return not self._chains

    def wait(self, handle):
        if self.comm_thread is not None:
            return self.comm_thread.wait(handle.done)
        while handle.step < self.steps or handle in self._chains:
            self._progress()
            if handle in self._chains:
                yield_core()

    def close(self):
        if self.comm_thread is not None:
            self.comm_thread.close()


class IallreduceChains(ChainedTransport):
    """Float32 sums as one-step chains: an ``MPI_Iallreduce`` each, on a
    communicator of its own, whose handles (:class:`Chain`) say when they
    are done (``done``), for a caller that starts work on each sum's result
    (the low-rank plug-in); polled."""
    name = "mpi-host-chains"

    def __init__(self, world):
        super().__init__(world)
        self.comm = world.comm.Dup()

    def issue(self, chain):
        return self.comm.Iallreduce(self.MPI.IN_PLACE, chain.buf, op=self.MPI.SUM)

    def close(self):
        super().close()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
