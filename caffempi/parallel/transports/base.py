"""The transport interface: how a gradient strategy sums buffers over ranks.

A :class:`~caffempi.parallel.sync.Reducer` hands the transport contiguous
slices of the net's flat gradient buffer as backward finishes them; the
transport sums each over the ranks, in place, times a scale (the reducer's
1/N: the mean).  Everything a caller may use is declared here, once.
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
    ``wait(h)`` the buffer of ``h`` holds the sum over ranks times the
    scale it was started with.  The transport never installs anything
    process-wide: the caller calls :meth:`poll` (between layers, and
    between a kernel's chunks through ``threads.progress``).
    """

    #: shown in the log line that says how gradients are averaged
    name = "transport"
    #: True: takes device (CuPy) buffers; False: host (NumPy) buffers only
    device_buffers = False
    #: True: sums may start during backward, bucket by bucket; False: the
    #: caller starts one sum of the whole gradient after backward
    overlaps_backward = True

    @abstractmethod
    def allreduce_start(self, buf, scale=1.0):
        """Start summing ``buf`` (contiguous) over the ranks, the sum to be
        multiplied by ``scale``; returns a handle.  The scale is folded into
        a copy the transport makes anyway where it makes one, else applied
        in one pass once the sum is in (Caffe's NCCL scales after the sum)."""

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

    def allreduce(self, buf, scale=1.0):
        """Sum ``buf`` over the ranks now (start, end, wait)."""
        handle = self.allreduce_start(buf, scale)
        self.backward_end()
        self.wait(handle)

    def close(self):
        """Release what the transport holds (collective)."""


class LocalTransport(Transport):
    """One rank: the sum is the buffer itself."""
    name = "local"
    device_buffers = True

    def allreduce_start(self, buf, scale=1.0):
        scale_in_place(buf, scale)

    def wait(self, handle):
        pass


def scale_in_place(buf, scale):
    """``buf *= scale`` (in buf's type), skipped for a scale of 1."""
    if scale != 1.0:
        buf *= buf.dtype.type(scale)
