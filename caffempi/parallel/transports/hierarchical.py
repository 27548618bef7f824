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
from .chained import ChainedTransport


class HierarchicalTransport(ChainedTransport):
    name = "hierarchical"
    steps = 3            # reduce on the host, allreduce across hosts, broadcast on the host

    def __init__(self, world, host):
        super().__init__(world)
        MPI = self.MPI
        self.reduce_comm = host                  # the host's ranks (this transport frees it)
        self.bcast_comm = host.Dup()
        self.leader = host.rank == 0
        color = 0 if self.leader else MPI.UNDEFINED
        self.across = world.comm.Split(color, world.rank)   # COMM_NULL on the other ranks

    def issue(self, s):
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

    def close(self):
        super().close()
        for comm in (self.bcast_comm, self.reduce_comm, self.across):
            if comm is not None and comm != self.MPI.COMM_NULL:
                comm.Free()
        self.bcast_comm = self.reduce_comm = self.across = None
