"""Compressed sums over MPI (``--comm_dtype=fp16`` with an MPI ``--comm``):
the ranks' pieces are added by the compressor, not by MPI, which has no
float16 addition in float32.

:class:`CompressedExchange` sums a buffer over one communicator in three
non-blocking steps.  The ranks agree on the buffer's largest magnitude
(``MPI_Iallreduce`` of one float, MAX), from which the compressor picks the
scale (:meth:`Compressor.agreed_scale`).  The buffer, compressed with it, is
cut into one piece per rank and the pieces are exchanged
(``MPI_Ialltoallv``: rank r receives every rank's piece r); rank r adds them
(:meth:`Compressor.sum`, in rank order), and the summed pieces are gathered
back (``MPI_Iallgatherv``), then decompressed with the mean folded in.  Each
rank sends 2(P-1)/P of the buffer's wire bytes, as a ring allreduce does,
and every rank ends with the same values.

:class:`ExchangeTransport` runs it over all ranks, its steps issued in
bucket order on every rank (chained.ChainedTransport), polled by the
computing thread (overlap, nopoll, async), by a communication thread
(thread), or run to the end at once after backward (blocking);
hierarchical.HierarchicalTransport runs it over the hosts' first ranks.
"""
import numpy as np

from .chained import ChainedTransport


class CompressedExchange:
    """The three steps of a compressed sum over ``comm`` (mpi4py), a chain's
    state kept on the chain (``buf``, ``step``)."""
    steps = 3            # agree on the scale, exchange the pieces, gather the summed pieces

    def __init__(self, MPI, comm, compressor):
        self.MPI = MPI
        self.compressor = compressor
        # a communicator a step (chained.py)
        self.scale_comm, self.exchange_comm, self.gather_comm = (comm.Dup() for _ in range(3))
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        from mpi4py.util import dtlib       # mpi4py only under MPI
        self.wire_type = dtlib.from_numpy_dtype(compressor.wire_view)

    def issue(self, c, step):
        """Start ``step`` (0, 1, 2) of the sum of ``c.buf``; returns its request."""
        view, u = self.compressor.wire_view, self.wire_type
        if step == 0:
            n = c.buf.size
            c.counts = np.array([n // self.size + (r < n % self.size) for r in range(self.size)], np.int64)
            c.displs = np.concatenate([[0], np.cumsum(c.counts)[:-1]]).astype(np.int64)
            c.largest = np.array([self.compressor.largest(c.buf)], np.float32)
            return self.scale_comm.Iallreduce(self.MPI.IN_PLACE, c.largest, op=self.MPI.MAX)
        wire = self.compressor.wire_dtype
        mine = int(c.counts[self.rank])
        if step == 1:
            c.wire_scale = self.compressor.agreed_scale(float(c.largest[0]), self.size)
            c.send = np.empty(c.buf.size, wire)
            self.compressor.compress(c.buf, c.wire_scale, c.send)
            c.pieces = np.empty(self.size * mine, wire)
            recv_counts = np.full(self.size, mine, np.int64)
            recv_displs = np.arange(self.size, dtype=np.int64) * mine
            return self.exchange_comm.Ialltoallv([c.send.view(view), (c.counts, c.displs), u],
                                                 [c.pieces.view(view), (recv_counts, recv_displs), u])
        # the pieces are in: add them, in rank order
        c.mine = np.empty(mine, wire)
        self.compressor.sum(c.pieces.reshape(self.size, mine), c.mine)
        c.out = np.empty(c.buf.size, wire)
        return self.gather_comm.Iallgatherv([c.mine.view(view), u], [c.out.view(view), (c.counts, c.displs), u])

    def result(self, c, scale):
        """The sum, times ``scale``, into ``c.buf`` (after step 2 completed)."""
        self.compressor.decompress(c.out, scale / c.wire_scale, c.buf)

    def close(self):
        for comm in (self.scale_comm, self.exchange_comm, self.gather_comm):
            if comm is not None:
                comm.Free()
        self.scale_comm = self.exchange_comm = self.gather_comm = None


class ExchangeTransport(ChainedTransport):
    steps = CompressedExchange.steps

    def __init__(self, world, compressor, comm_thread=False, blocking=False):
        """``comm_thread``: progress on a communication thread; ``blocking``:
        one sum of the whole gradient after backward (--comm=blocking)."""
        super().__init__(world, comm_thread)
        self.name = compressor.name + ("-thread" if comm_thread else "-blocking" if blocking else "")
        self.overlaps_backward = not blocking
        self.exchange = CompressedExchange(world.MPI, world.comm, compressor)

    def issue(self, c):
        return self.exchange.issue(c, c.step)

    def complete(self, c):
        self.exchange.result(c, c.scale)

    def close(self):
        super().close()
        self.exchange.close()
