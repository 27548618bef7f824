"""``--comm=nccl`` (and ``auto`` for GPU nets that NCCL can join): each
bucket summed by NCCL on a side stream, ordered after the compute stream's
writes by an event; ``wait`` makes the compute stream wait for the bucket's
event and queues the scale there, so the host never blocks.  Imported only for CuPy buffers.
"""
import cupy as cp

from ...common import CaffeError
from .base import Transport, scale_in_place


def nccl_loaded():
    """Whether CuPy's NCCL library loads in this process."""
    try:
        from cupy.cuda import nccl
        return bool(nccl.available)
    except Exception:
        return False


def nccl_unavailable_reason(world):
    """Why NCCL cannot join these ranks, or None.  Collective: every rank
    calls it and gets the same answer."""
    dev = cp.cuda.Device()
    where = (world.processor_name(), dev.pci_bus_id, nccl_loaded())
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


class NCCLTransport(Transport):
    device_buffers = True
    name = "nccl"

    def __init__(self, world):
        from cupy.cuda import nccl
        self.nccl = nccl
        # the unique id travels over MPI (the bootstrap NCCL needs)
        uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def allreduce_start(self, buf, scale=1.0):
        ready = cp.cuda.Event(disable_timing=True)
        ready.record()                       # the bucket's last gradient is queued
        self.stream.wait_event(ready)
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _nccl_dtype(self.nccl, buf.dtype),
                            self.nccl.NCCL_SUM, self.stream.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return done, buf, scale

    def wait(self, handle):
        done, buf, scale = handle
        cp.cuda.get_current_stream().wait_event(done)
        scale_in_place(buf, scale)

    def close(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
