"""Compressed sums over MPI (``--comm_dtype=fp16`` with an MPI ``--comm``):
the ranks' pieces are added by the compressor, not by MPI, which has no
float16 addition in float32.

:class:`CompressedExchange` sums a buffer over one communicator in two
non-blocking steps.  Each rank compresses its buffer with its own scale
(:meth:`Compressor.piece_scale`), cuts it into one piece per rank and sends
every piece with that scale's exponent after it (``MPI_Ialltoallv``: rank r
receives every rank's piece r); rank r adds them (:meth:`Compressor.sum`,
each unscaled by its sender's scale, in rank order) and compresses the sum
with the smallest of the scales, which every rank has received and so
derives alike; the summed pieces are gathered back (``MPI_Iallgatherv``)
and decompressed with the mean folded in.  Each rank sends 2(P-1)/P of the
buffer's wire bytes (and P exponents), as a ring allreduce does, every rank
ends with the same values, and no collective agrees on a scale first (a
third step, whose latency a small bucket's sum paid in full).

:class:`ExchangeTransport` runs it over all ranks, its steps issued in
bucket order on every rank (chained.ChainedTransport), polled by the
computing thread (overlap, nopoll, async), by a communication thread
(thread), or run to the end at once after backward (blocking);
hierarchical.HierarchicalTransport runs it over the hosts' first ranks.
"""
import numpy as np

from .chained import ChainedTransport


class _Layout:
    """How a buffer of ``n`` values is cut (one piece per rank) and where
    the pieces and their exponents lie in the two messages; the same for
    every bucket of that size, so it is made once."""

    def __init__(self, n, rank, size):
        self.counts = np.array([n // size + (r < n % size) for r in range(size)], np.int64)
        self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        # sent: piece q then its exponent, for each q
        self.send = (self.counts + 1, self.displs + np.arange(size))
        self.slots = self.send[1] + self.counts             # where each exponent goes
        self.pieces = [(slice(d, d + c), slice(d + q, d + q + c))
                       for q, (d, c) in enumerate(zip(self.displs.tolist(), self.counts.tolist()))]
        self.mine = int(self.counts[rank])
        self.recv = (np.full(size, self.mine + 1, np.int64), np.arange(size, dtype=np.int64) * (self.mine + 1))


class CompressedExchange:
    """The two steps of a compressed sum over ``comm`` (mpi4py), a chain's
    state kept on the chain (``buf``, ``step``)."""
    steps = 2            # exchange the pieces, gather the summed pieces

    def __init__(self, MPI, comm, compressor):
        self.MPI = MPI
        self.compressor = compressor
        # a communicator a step (chained.py)
        self.exchange_comm, self.gather_comm = (comm.Dup() for _ in range(2))
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        from mpi4py.util import dtlib       # mpi4py only under MPI
        self.wire_type = dtlib.from_numpy_dtype(compressor.wire_view)
        self._layouts = {}                  # values -> _Layout

    def issue(self, c, step):
        """Start ``step`` (0, 1) of the sum of ``c.buf``; returns its request."""
        view, u, wire = self.compressor.wire_view, self.wire_type, self.compressor.wire_dtype
        if step == 0:
            n = c.buf.size
            layout = self._layouts.get(n)
            if layout is None:
                layout = self._layouts[n] = _Layout(n, self.rank, self.size)
            c.layout = layout
            flat = c.buf.reshape(-1)
            scale = self.compressor.piece_scale(self.compressor.largest(flat), self.size)
            c.send = np.empty(n + self.size, wire)
            for values, at in layout.pieces:
                self.compressor.compress(flat[values], scale, c.send[at])
            c.send[layout.slots] = self.compressor.exponent(scale)
            c.received = np.empty((self.size, layout.mine + 1), wire)
            return self.exchange_comm.Ialltoallv([c.send.view(view), layout.send, u],
                                                 [c.received.view(view), layout.recv, u])
        # the pieces are in: add them, each unscaled, in rank order
        scales = self.compressor.scales(c.received[:, -1])
        c.wire_scale = self.compressor.sum_scale(scales)
        c.mine = np.empty(c.layout.mine, wire)
        self.compressor.sum(c.received[:, :-1], scales, c.wire_scale, c.mine)
        c.out = np.empty(c.buf.size, wire)
        return self.gather_comm.Iallgatherv([c.mine.view(view), u],
                                            [c.out.view(view), (c.layout.counts, c.layout.displs), u])

    def result(self, c, scale):
        """The sum, times ``scale``, into ``c.buf`` (after step 1 completed)."""
        self.compressor.decompress(c.out, scale / c.wire_scale, c.buf)

    def close(self):
        for comm in (self.exchange_comm, self.gather_comm):
            if comm is not None:
                comm.Free()
        self.exchange_comm = self.gather_comm = None


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
