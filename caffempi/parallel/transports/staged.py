"""Device (CuPy) buffers summed by a host transport through pinned host
copies: GPU nets where NCCL cannot join the ranks (no NCCL, or two ranks on
one GPU, which NCCL refuses), or a --comm mode NCCL does not have.
Imported only for CuPy buffers."""
import cupyx

from .base import Transport


class StagedTransport(Transport):
    device_buffers = True

    def __init__(self, host):
        self.host = host
        self.name = host.name + "-staged"
        self.overlaps_backward = host.overlaps_backward
        self._pinned = {}

    def _to_host(self, buf):
        key = (buf.data.ptr, buf.size)
        h = self._pinned.get(key)
        if h is None:
            h = self._pinned[key] = cupyx.empty_pinned(buf.shape, buf.dtype)
        buf.get(out=h)      # waits for the gradients on the compute stream
        return h

    def allreduce_start(self, buf, scale=1.0):
        h = self._to_host(buf)
        return self.host.allreduce_start(h, scale), h, buf

    def poll(self):
        return self.host.poll()

    def backward_end(self):
        self.host.backward_end()

    def wait(self, handle):
        request, h, buf = handle
        self.host.wait(request)
        buf.set(h)

    def close(self):
        self._pinned.clear()
        self.host.close()
