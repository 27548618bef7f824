"""Sums made of several non-blocking MPI steps a bucket, chained without
blocking (the base of the hierarchical and float16 transports).

Every rank issues the steps of its buckets in bucket order (a bucket issues
a step only once every earlier bucket has issued it) and each step runs on a
communicator of its own, so the collectives on each communicator come in the
same order on every rank, as MPI requires (on one communicator, one rank
could issue bucket 0's second step before bucket 1's first, another the
other way round).
Progress as in ``overlap``: :meth:`poll` runs between layers and, on the
CPU, between the chunks of a layer's kernels.
"""
from abc import abstractmethod

from ...backend import threads
from .base import Transport, yield_core


class Chain:
    """One bucket's sum: ``step`` counts the steps completed."""

    def __init__(self, buf):
        self.buf, self.step, self.request = buf, 0, None


class ChainedTransport(Transport):
    steps = 1            # steps a bucket's sum takes

    def __init__(self, MPI):
        self.MPI = MPI
        self._chains = []                 # this iteration's, in start order

    def allreduce_start(self, buf):
        chain = self.make_chain(buf)
        self._chains.append(chain)
        self.poll()
        threads.set_progress(self.poll)
        return chain

    def make_chain(self, buf):
        return Chain(buf)

    @abstractmethod
    def issue(self, chain):
        """Start step ``chain.step`` of ``chain``; returns its MPI request."""

    def complete(self, chain):
        """All steps of ``chain`` are done (the first unfinished chain)."""

    def poll(self):
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
            self.complete(self._chains.pop(0))
        return not self._chains

    def backward_end(self):
        threads.set_progress(None)

    def wait(self, handle):
        while handle.step < self.steps or handle in self._chains:
            self.poll()
            if handle in self._chains:
                yield_core()
