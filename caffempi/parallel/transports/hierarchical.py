"""Host-aware sums (Caffe-MPI's intra-node then inter-node scheme): the
default under ``--comm=auto`` when the ranks span several hosts and some
host has several of them (``--comm=hierarchical`` asks for it).

Per bucket, in three steps chained without blocking: the host's ranks
reduce onto the host's first rank (``MPI_Ireduce``; MPI moves those bytes
through shared memory), the first ranks of the hosts sum across hosts
(``MPI_Iallreduce``: only one rank per host uses the network, with the
host's whole sum), and the host's first rank broadcasts the result back
(``MPI_Ibcast``).  Each step has its own communicator, and every rank issues
the steps of the buckets in bucket order, so the collectives on each
communicator come in the same order on every rank.  Progress as in
``overlap``: polled between layers and between the chunks of CPU kernels.
"""
from ...backend import threads
from .base import Transport, yield_core


class _Sum:
    """One bucket's chain: step 0 reduce, 1 across hosts (first ranks), 2
    broadcast, 3 done."""
    __slots__ = ("buf", "step", "request")

    def __init__(self, buf):
        self.buf, self.step, self.request = buf, 0, None


class HierarchicalTransport(Transport):
    name = "hierarchical"

    def __init__(self, world, host):
        MPI = self.MPI = world.MPI
        self.reduce_comm = host                  # the host's ranks (this transport frees it)
        self.bcast_comm = host.Dup()
        self.leader = host.rank == 0
        color = 0 if self.leader else MPI.UNDEFINED
        self.across = world.comm.Split(color, world.rank)   # COMM_NULL on the other ranks
        self._sums = []                          # this iteration's, in start order

    def allreduce_start(self, buf):
        s = _Sum(buf)
        self._sums.append(s)
        self.poll()
        threads.set_progress(self.poll)
        return s

    def poll(self):
        """Advance every chain as far as it can go; a bucket issues a step
        only after every earlier bucket has issued it."""
        limit = 3             # the fewest steps an earlier bucket has issued
        for s in self._sums:
            while s.step < 3:
                if s.request is not None:
                    if not s.request.Test():
                        break
                    s.step, s.request = s.step + 1, None
                elif s.step < limit:
                    s.request = self._issue(s)
                else:
                    break
            limit = min(limit, s.step + (s.request is not None))
        while self._sums and self._sums[0].step == 3:
            self._sums.pop(0)
        return not self._sums

    def _issue(self, s):
        MPI = self.MPI
        if s.step == 0:
            if self.leader:
                return self.reduce_comm.Ireduce(MPI.IN_PLACE, s.buf, op=MPI.SUM, root=0)
            return self.reduce_comm.Ireduce(s.buf, None, op=MPI.SUM, root=0)
        if s.step == 1:
            if self.leader:
                return self.across.Iallreduce(MPI.IN_PLACE, s.buf, op=MPI.SUM)
            return MPI.REQUEST_NULL               # the other ranks take no part
        return self.bcast_comm.Ibcast(s.buf, root=0)

    def backward_end(self):
        threads.set_progress(None)

    def wait(self, handle):
        while handle.step < 3:
            self.poll()
            if handle.step < 3:
                yield_core()

    def close(self):
        self.backward_end()
        for comm in (self.bcast_comm, self.reduce_comm, self.across):
            if comm is not None and comm != self.MPI.COMM_NULL:
                comm.Free()
        self.bcast_comm = self.reduce_comm = self.across = None
