"""Compressed sums over MPI (``--comm_dtype=fp16`` with any MPI ``--comm``):
the ranks' pieces are added by the compressor, not by MPI, which has no
float16 addition in float32.

Per bucket, three non-blocking steps on host buffers.  The ranks agree on
the bucket's largest magnitude (``MPI_Iallreduce`` of one float, MAX), from
which the compressor picks the scale (:meth:`Compressor.agreed_scale`).
The bucket, compressed with it, is cut into one piece per rank and the
pieces are exchanged (``MPI_Ialltoallv``: rank r receives every rank's
piece r); rank r adds them (:meth:`Compressor.sum`, in rank order), and the
summed pieces are gathered back (``MPI_Iallgatherv``), then decompressed
with the mean folded in.  Each rank sends 2(P-1)/P of the bucket's wire
bytes, as a ring allreduce does, and every rank ends with the same values.
Steps are issued in bucket order on every rank (chained.ChainedTransport),
polled by the computing thread (overlap, nopoll, async), by a communication
thread (thread), or run to the end at once after backward (blocking).
"""
import numpy as np

from .chained import Chain, ChainedTransport


class ExchangeTransport(ChainedTransport):
    steps = 3            # agree on the scale, exchange the pieces, gather the summed pieces

    def __init__(self, world, compressor, comm_thread=False, blocking=False):
        """``comm_thread``: progress on a communication thread; ``blocking``:
        one sum of the whole gradient after backward (--comm=blocking)."""
        super().__init__(world, comm_thread)
        self.compressor = compressor
        self.name = compressor.name + ("-thread" if comm_thread else "-blocking" if blocking else "")
        self.overlaps_backward = not blocking
        self.scale_comm = world.comm.Dup()          # a communicator a step (chained.py)
        self.exchange_comm = world.comm.Dup()
        self.gather_comm = world.comm.Dup()
        self.rank, self.size = world.rank, world.size
        from mpi4py.util import dtlib       # mpi4py only under MPI
        self.wire_type = dtlib.from_numpy_dtype(compressor.wire_view)

    def make_chain(self, buf, scale):
        c = Chain(buf, scale)
        n = buf.size
        wire = self.compressor.wire_dtype
        c.counts = np.array([n // self.size + (r < n % self.size) for r in range(self.size)], np.int64)
        c.displs = np.concatenate([[0], np.cumsum(c.counts)[:-1]]).astype(np.int64)
        c.largest = np.array([self.compressor.largest(buf)], np.float32)
        mine = int(c.counts[self.rank])
        c.pieces = np.empty(self.size * mine, wire)
        c.mine = np.empty(mine, wire)
        c.send = np.empty(n, wire)
        c.out = np.empty(n, wire)
        return c

    def issue(self, c):
        view, u = self.compressor.wire_view, self.wire_type
        mine = int(c.counts[self.rank])
        if c.step == 0:
            return self.scale_comm.Iallreduce(self.MPI.IN_PLACE, c.largest, op=self.MPI.MAX)
        if c.step == 1:
            c.wire_scale = self.compressor.agreed_scale(float(c.largest[0]), self.size)
            self.compressor.compress(c.buf, c.wire_scale, c.send)
            c.recv_counts = np.full(self.size, mine, np.int64)
            c.recv_displs = np.arange(self.size, dtype=np.int64) * mine
            return self.exchange_comm.Ialltoallv([c.send.view(view), (c.counts, c.displs), u],
                                                 [c.pieces.view(view), (c.recv_counts, c.recv_displs), u])
        # the pieces are in: add them, in rank order
        self.compressor.sum(c.pieces.reshape(self.size, mine), c.mine)
        return self.gather_comm.Iallgatherv([c.mine.view(view), u],
                                            [c.out.view(view), (c.counts, c.displs), u])

    def complete(self, c):
        self.compressor.decompress(c.out, c.scale / c.wire_scale, c.buf)

    def close(self):
        super().close()
        for comm in (self.scale_comm, self.exchange_comm, self.gather_comm):
            if comm is not None:
                comm.Free()
        self.scale_comm = self.exchange_comm = self.gather_comm = None
