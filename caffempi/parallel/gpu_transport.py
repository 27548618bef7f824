"""Transports for device (CuPy) gradient buffers; see reducer.py for the
interface (allreduce_start / poll / wait / allreduce / backward_end).

NCCLTransport   NCCL allreduce of each bucket on a side stream, ordered
                after the compute stream's writes by an event; ``wait`` makes
                the compute stream wait for the bucket's event, so the host
                never blocks.
StagedTransport MPI on pinned host copies (the fallback: no NCCL, or two
                ranks on one GPU, which NCCL refuses).

Only imported when a net's buffers are CuPy arrays.
"""
import cupy as cp
import cupyx

from ..common import CaffeError


def nccl_unavailable_reason(world):
    """Why NCCL cannot join these ranks, or None.  Collective: every rank
    calls it and gets the same answer."""
    try:
        from cupy.cuda import nccl
        ok = bool(nccl.available)
    except Exception:
        ok = False
    dev = cp.cuda.Device()
    where = (world.processor_name(), dev.pci_bus_id, ok)
    seen = {}
    for rank, (host, bus, has) in enumerate(world.allgather(where)):
        if not has:
            return "rank %d's CuPy has no NCCL" % rank
        if (host, bus) in seen:
            return ("ranks %d and %d share the GPU %s on %s (NCCL needs one GPU per rank)"
                    % (seen[(host, bus)], rank, bus, host))
        seen[(host, bus)] = rank
    return None


def _nccl_dtype(nccl, dtype):
    try:
        return {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}[str(dtype)]
    except KeyError:
        raise CaffeError("NCCL transport: unsupported gradient dtype %s" % dtype) from None


class NCCLTransport:
    device_buffers = True
    name = "nccl"

    def __init__(self, world):
        from cupy.cuda import nccl
        self.nccl = nccl
        # the unique id travels over MPI (the bootstrap NCCL needs)
        uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.comm_seconds = 0.0     # the host never blocks in a collective here
        self._spans = []            # (start, done) events of this iteration's buckets
        self._backward_end = None

    def _launch(self, buf, stream):
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _nccl_dtype(self.nccl, buf.dtype),
                            self.nccl.NCCL_SUM, stream.ptr)

    def allreduce_start(self, buf):
        if not self._spans:
            self._backward_end = None
        ready = cp.cuda.Event(disable_timing=True)
        ready.record()                       # the bucket's last gradient is queued
        self.stream.wait_event(ready)
        start, done = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.stream)
        self._launch(buf, self.stream)
        done.record(self.stream)
        self._spans.append((start, done))
        return done

    def poll(self):
        return True

    def backward_end(self):
        """Mark where backward ended on the compute stream (for timings)."""
        self._backward_end = cp.cuda.Event()
        self._backward_end.record()

    def wait(self, handle):
        cp.cuda.get_current_stream().wait_event(handle)

    def allreduce(self, buf):
        self._spans = []
        self._launch(buf, cp.cuda.get_current_stream())

    def timings(self):
        """(communication ms, ms of it after backward ended) of the last
        iteration's buckets; synchronizes.  Communication time is each
        bucket's span on the side stream, which includes waiting for the
        other ranks to reach the same bucket."""
        if not self._spans or self._backward_end is None:
            return 0.0, 0.0
        self._spans[-1][1].synchronize()
        comm = sum(cp.cuda.get_elapsed_time(s, d) for s, d in self._spans)
        exposed = max(0.0, cp.cuda.get_elapsed_time(self._backward_end, self._spans[-1][1]))
        self._spans = []
        return comm, exposed

    def close(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


class StagedTransport:
    """Device buffers summed by a host transport through pinned copies."""
    device_buffers = True

    def __init__(self, host):
        self.host = host
        self.name = host.name + "-staged"
        self._pinned = {}

    @property
    def comm_seconds(self):
        return self.host.comm_seconds

    def _to_host(self, buf):
        key = (buf.data.ptr, buf.size)
        h = self._pinned.get(key)
        if h is None:
            h = self._pinned[key] = cupyx.empty_pinned(buf.shape, buf.dtype)
        buf.get(out=h)      # waits for the gradients on the compute stream
        return h

    def allreduce_start(self, buf):
        h = self._to_host(buf)
        return self.host.allreduce_start(h), h, buf

    def poll(self):
        return self.host.poll()

    def backward_end(self):
        self.host.backward_end()

    def wait(self, handle):
        request, h, buf = handle
        self.host.wait(request)
        buf.set(h)

    def allreduce(self, buf):
        h = self._to_host(buf)
        self.host.allreduce(h)
        buf.set(h)

    def close(self):
        self._pinned.clear()
        self.host.close()
