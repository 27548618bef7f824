"""Host reads of device values that do not stall the device's queue.

A host read of a GPU value (``float(a)``, ``a.get()``) waits for every
kernel queued before it, and the host issues nothing meanwhile.  Inside a
training step that read came after the loss layer's forward, so the host
could never run ahead into backward and the next iteration: ResNet-50's
forward was paced by the host's issuing, its backward by the GPU, one
after the other (docs/performance/gpu.md).  :func:`read_later` starts the
copies where the values are made and waits for them only when asked,
after the host has issued the work that follows.
"""
import numpy as np

from . import on_host


def defers_reads(xp):
    """Whether host reads of ``xp``'s arrays are deferred: on the GPU, and
    for any module but NumPy itself (caffempi.testing.strict checks the
    GPU's rule on the CPU), not on NumPy, where a read is free."""
    return xp is not np


class PendingRead:
    """Host copies of arrays, ready at :meth:`result`."""

    def __init__(self, hosts, done=None):
        self._hosts, self._done = hosts, done

    def result(self):
        """The host copies (NumPy arrays), waiting for the work they
        follow (and only that) where they are still on their way."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._hosts


def read_later(xp, arrays):
    """A :class:`PendingRead` of ``arrays`` (of ``xp``): on NumPy copies
    made at once; on the GPU asynchronous copies into pinned host memory,
    queued after the work issued so far, and an event after them."""
    if on_host(xp):
        return PendingRead([np.array(a) for a in arrays])
    from . import gpu
    return PendingRead(*gpu.copies_to_host(arrays))
