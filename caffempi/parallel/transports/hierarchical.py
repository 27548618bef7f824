"""Host-aware sums (Caffe-MPI's intra-node then inter-node scheme): the
default under ``--comm=auto`` when the ranks span several hosts and some
host has several of them (``--comm=hierarchical`` asks for it).

Per bucket, steps chained without blocking: the host's ranks reduce onto
the host's first rank (``MPI_Ireduce``; MPI moves those bytes through
shared memory), the first ranks of the hosts sum across hosts
(``MPI_Iallreduce``: only one rank per host uses the network, with the
host's whole sum), and the host's first rank broadcasts the result back
(``MPI_Ibcast``).  With a compressor (``--comm_dtype=fp16``) only the sum
across hosts is compressed (exchange.CompressedExchange over the first
ranks, two steps instead of one): the host's sums stay float32, so the
result has one float16 rounding of the hosts' sums, not of each rank's
gradient (other bits than ``overlap``'s float16 sums).  Each step has its
own communicator, and every rank issues the steps of the buckets in bucket
order, so the collectives on each communicator come in the same order on
every rank.  Progress as in ``overlap``: polled between layers and between
the chunks of CPU kernels.
"""
from .chained import ChainedTransport
from .exchange import CompressedExchange


class HierarchicalTransport(ChainedTransport):
    name = "hierarchical"
    steps = 3            # reduce on the host, sum across hosts, broadcast on the host

    def __init__(self, world, host, compressor=None):
        super().__init__(world)
        MPI = self.MPI
        self.reduce_comm = host                  # the host's ranks (this transport frees it)
        self.bcast_comm = host.Dup()
        self.leader = host.rank == 0
        color = 0 if self.leader else MPI.UNDEFINED
        self.across = world.comm.Split(color, world.rank)   # COMM_NULL on the other ranks
        self.compressed = compressor is not None
        self.exchange = None                     # the leaders' compressed sum
        if self.compressed:
            self.name = "%s-hierarchical" % compressor.name
            self.steps = 2 + CompressedExchange.steps
            if self.leader:
                self.exchange = CompressedExchange(MPI, self.across, compressor)

    def issue(self, s):
        MPI = self.MPI
        if s.step == 0:
            if self.leader:
                return self.reduce_comm.Ireduce(MPI.IN_PLACE, s.buf, op=MPI.SUM, root=0)
            return self.reduce_comm.Ireduce(s.buf, None, op=MPI.SUM, root=0)
        if s.step < self.steps - 1:              # across hosts
            if not self.leader:
                return MPI.REQUEST_NULL           # the other ranks take no part
            if self.compressed:
                return self.exchange.issue(s, s.step - 1)
            return self.across.Iallreduce(MPI.IN_PLACE, s.buf, op=MPI.SUM)
        if self.leader and self.compressed:       # the mean goes out with the broadcast
            self.exchange.result(s, s.scale)
        return self.bcast_comm.Ibcast(s.buf, root=0)

    def complete(self, s):
        if not self.compressed:                   # compressed: scaled before the broadcast
            super().complete(s)

    def close(self):
        super().close()
        if self.exchange is not None:
            self.exchange.close()
        for comm in (self.bcast_comm, self.reduce_comm, self.across):
            if comm is not None and comm != self.MPI.COMM_NULL:
                comm.Free()
        self.bcast_comm = self.reduce_comm = self.across = None
