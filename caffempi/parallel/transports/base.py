"""The transport interface: how a gradient strategy sums buffers over ranks.

A :class:`~caffempi.parallel.sync.BucketedAllreduce` hands the transport
contiguous slices of the net's flat gradient buffer as backward finishes
them; the transport sums each over the ranks, in place.  Everything a
caller may use is declared here, once.
"""
import os
import time
from abc import ABC, abstractmethod

# Give the core (and the GIL) to whatever else wants it while waiting: a
# sleep wakes late, plain spinning starves this rank's data readers.
yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))


class Transport(ABC):
    """Sums buffers over the ranks of a world, in place.

    Every rank makes the same calls in the same order (each call may be
    collective).  One iteration is: ``allreduce_start`` for each bucket as
    backward produces it (``poll`` between layers), ``backward_end`` once
    backward has run, then ``wait`` on every handle, in start order.  After
    ``wait(h)`` the buffer of ``h`` holds the sum over ranks.
    """

    #: shown in the log line that says how gradients are averaged
    name = "transport"
    #: True: takes device (CuPy) buffers; False: host (NumPy) buffers only
    device_buffers = False
    #: True: sums may start during backward, bucket by bucket; False: the
    #: caller starts one sum of the whole gradient after backward
    overlaps_backward = True

    @abstractmethod
    def allreduce_start(self, buf):
        """Start summing ``buf`` (contiguous) over the ranks; returns a handle."""

    def poll(self):
        """Let pending sums progress; True when none is pending."""
        return True

    @abstractmethod
    def wait(self, handle):
        """Return once the sum of ``handle``'s buffer is in the buffer."""

    def backward_end(self):
        """Backward has run: no more starts this iteration."""

    def missing_ranks(self, handle):
        """The ranks whose part of ``handle``'s sum has not arrived, where the
        transport can tell (for the watchdog's message), else None."""
        return None

    def allreduce(self, buf):
        """Sum ``buf`` over the ranks now (start, end, wait)."""
        handle = self.allreduce_start(buf)
        self.backward_end()
        self.wait(handle)

    def close(self):
        """Release what the transport holds (collective)."""


class LocalTransport(Transport):
    """One rank: the sum is the buffer itself."""
    name = "local"
    device_buffers = True

    def allreduce_start(self, buf):
        return None

    def wait(self, handle):
        pass
