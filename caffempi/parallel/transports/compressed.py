"""``--comm_dtype=fp16``: buckets cross the network as float16, summed in
float32 (Horovod's fp16 compression, with the sum kept in float32).

Per bucket, two non-blocking steps on host buffers: the bucket, rounded to
float16, is cut into one piece per rank and the pieces are exchanged
(``MPI_Ialltoallv``: rank r receives every rank's piece r); rank r adds them
in float32, in rank order, rounds its summed piece to float16, and the
pieces are gathered back (``MPI_Iallgatherv``).  Each rank sends 2(P-1)/P of
the bucket's float16 bytes, half of a float32 ring allreduce, and every rank
ends with the same values (the sum of float16-rounded gradients, itself
rounded to float16).  Steps are issued in bucket order on every rank
(chained.ChainedTransport).
"""
import numpy as np

from .chained import Chain, ChainedTransport


class Float16Transport(ChainedTransport):
    name = "fp16"
    steps = 2            # exchange the pieces, gather the summed pieces

    def __init__(self, world):
        super().__init__(world.MPI)
        self.exchange_comm = world.comm.Dup()       # a communicator a step (chained.py)
        self.gather_comm = world.comm.Dup()
        self.rank, self.size = world.rank, world.size

    def make_chain(self, buf):
        c = Chain(buf)
        n = buf.size
        c.counts = np.array([n // self.size + (r < n % self.size) for r in range(self.size)], np.int64)
        c.displs = np.concatenate([[0], np.cumsum(c.counts)[:-1]]).astype(np.int64)
        c.send = buf.reshape(-1).astype(np.float16)
        mine = int(c.counts[self.rank])
        c.pieces = np.empty(self.size * mine, np.float16)
        c.mine = np.empty(mine, np.float16)
        c.out = np.empty(n, np.float16)
        return c

    def issue(self, c):
        u16 = self.MPI.UNSIGNED_SHORT
        mine = int(c.counts[self.rank])
        if c.step == 0:
            c.recv_counts = np.full(self.size, mine, np.int64)
            c.recv_displs = np.arange(self.size, dtype=np.int64) * mine
            return self.exchange_comm.Ialltoallv([c.send.view(np.uint16), (c.counts, c.displs), u16],
                                                 [c.pieces.view(np.uint16), (c.recv_counts, c.recv_displs), u16])
        # the pieces are in: sum them in float32, in rank order
        acc = c.pieces[:mine].astype(np.float32)
        for r in range(1, self.size):
            acc += c.pieces[r * mine:(r + 1) * mine]
        c.mine[...] = acc
        return self.gather_comm.Iallgatherv([c.mine.view(np.uint16), u16],
                                            [c.out.view(np.uint16), (c.counts, c.displs), u16])

    def complete(self, c):
        c.buf.reshape(-1)[...] = c.out

    def close(self):
        self.backward_end()
        for comm in (self.exchange_comm, self.gather_comm):
            if comm is not None:
                comm.Free()
        self.exchange_comm = self.gather_comm = None
