"""``--comm_dtype=fp16``: buckets cross the network as float16, summed in
float32 (Horovod's fp16 compression, with the sum kept in float32).

Per bucket, three non-blocking steps on host buffers.  The ranks agree on
the bucket's largest magnitude (``MPI_Iallreduce`` of one float, MAX) and
scale the bucket by a power of two that brings it to at most 2^14 / P, so
that the sum of P pieces stays below float16's maximum and gradients, whose
magnitudes (1e-5 to 1e-8) are float16's subnormals, keep float16's full
precision (subnormals carry few bits).  The conversions and the sum are
backend/half.py's compiled kernels (NumPy's casts were the step's cost).
The scaled bucket, rounded to float16, is cut into one piece per rank and
the pieces are exchanged (``MPI_Ialltoallv``: rank r receives every rank's
piece r); rank r adds them in float32, in rank order, rounds its summed
piece to float16, and the pieces are gathered back (``MPI_Iallgatherv``),
then unscaled (exactly: a power of two).  Each rank sends 2(P-1)/P of the
bucket's float16 bytes, half of a float32 ring allreduce, and every rank
ends with the same values.  Steps are issued in bucket order on every rank
(chained.ChainedTransport), polled by the computing thread or by a
communication thread (``comm_thread``: make_transport's choice, as for
float32 sums).
"""
import math

import numpy as np

from ...backend import half
from .chained import Chain, ChainedTransport

# the scaled bucket's largest magnitude times the ranks: room for the sum
# (float16's largest is 65504)
SCALED_MAX = 2.0 ** 14


def bucket_scale(largest, ranks):
    """The power of two that brings ``largest`` (the bucket's largest
    magnitude over all ranks) to at most SCALED_MAX / ranks; 1 for a bucket
    of zeros or of non-finite values (they stay as they are)."""
    if not math.isfinite(largest) or largest <= 0:
        return 1.0
    exponent = math.floor(math.log2(SCALED_MAX / (ranks * largest)))
    return math.ldexp(1.0, max(-126, min(126, exponent)))


class Float16Transport(ChainedTransport):
    name = "fp16"
    steps = 3            # agree on the scale, exchange the pieces, gather the summed pieces

    def __init__(self, world, comm_thread=False):
        super().__init__(world, comm_thread)
        self.name = "fp16-thread" if comm_thread else "fp16"
        self.scale_comm = world.comm.Dup()          # a communicator a step (chained.py)
        self.exchange_comm = world.comm.Dup()
        self.gather_comm = world.comm.Dup()
        self.rank, self.size = world.rank, world.size

    def make_chain(self, buf):
        c = Chain(buf)
        n = buf.size
        c.counts = np.array([n // self.size + (r < n % self.size) for r in range(self.size)], np.int64)
        c.displs = np.concatenate([[0], np.cumsum(c.counts)[:-1]]).astype(np.int64)
        flat = buf.reshape(-1)
        # max and -min: no temporary, unlike abs() (this runs on the computing thread)
        c.largest = np.array([max(flat.max(), -flat.min()) if n else 0.0], np.float32)
        mine = int(c.counts[self.rank])
        c.pieces = np.empty(self.size * mine, np.float16)
        c.mine = np.empty(mine, np.float16)
        c.send = np.empty(n, np.float16)
        c.out = np.empty(n, np.float16)
        return c

    def issue(self, c):
        u16 = self.MPI.UNSIGNED_SHORT
        mine = int(c.counts[self.rank])
        if c.step == 0:
            return self.scale_comm.Iallreduce(self.MPI.IN_PLACE, c.largest, op=self.MPI.MAX)
        if c.step == 1:
            c.scale = bucket_scale(float(c.largest[0]), self.size)
            half.to_half(c.buf, c.scale, c.send)
            c.recv_counts = np.full(self.size, mine, np.int64)
            c.recv_displs = np.arange(self.size, dtype=np.int64) * mine
            return self.exchange_comm.Ialltoallv([c.send.view(np.uint16), (c.counts, c.displs), u16],
                                                 [c.pieces.view(np.uint16), (c.recv_counts, c.recv_displs), u16])
        # the pieces are in: sum them in float32, in rank order
        half.sum_halves(c.pieces.reshape(self.size, mine), c.mine)
        return self.gather_comm.Iallgatherv([c.mine.view(np.uint16), u16],
                                            [c.out.view(np.uint16), (c.counts, c.displs), u16])

    def complete(self, c):
        half.from_half(c.out, 1.0 / c.scale, c.buf)

    def close(self):
        super().close()
        for comm in (self.scale_comm, self.exchange_comm, self.gather_comm):
            if comm is not None:
                comm.Free()
        self.scale_comm = self.exchange_comm = self.gather_comm = None
