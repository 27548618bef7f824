"""``--comm=shm``: the ranks of one host sum in shared memory, and the rank
that is waiting does the sums (the default for CPU nets when every rank is
on one host).

On one host moving the bytes is the ranks' own CPU work; with MPI's
allreduce each rank does its share on its critical path, while ranks never
finish backward together, so the first one done has time to spare: it sums.

  Every rank has a segment of an MPI-3 shared-memory window; the host has
  one result area.  A bucket is copied into the rank's segment and flagged
  ready (the round's number in the rank's ready flag for that bucket).
  Waiting for a bucket, a rank that sees every rank's ready flag sums the
  bucket's chunks that no rank has flagged done yet into the result area
  (segments added in rank order, so any rank writes the same bits; two
  ranks may sum the same chunk at once, harmlessly) and flags them.  When
  all of the bucket's chunks are done, it copies the result out.

With a compressor (``--comm_dtype=fp16``), each rank also writes its
bucket's largest magnitude beside its ready flag; the summing rank
compresses each rank's chunk with that rank's scale, adds the pieces with
the compressor (rank order) into the result area in wire form, under the
scale every rank derives from all of them, and every rank decompresses its
copy: the same arithmetic, and bits, as ``transports.exchange``'s sums.

A round is one iteration's buckets; a segment and the result area are
written again only once every rank has flagged that it copied the last
round out.  Memory ordering: ``Win.Sync`` (MPI_Win_sync, a memory barrier)
between writing data and raising its flag, and between seeing a flag and
reading the data.  No MPI message is sent in a step.

History and measurements: docs/design/parallel.md.
"""
import os

import numpy as np

from ...common import CaffeError, log
from .base import Transport, yield_core

CHUNK_BYTES = 1 << 16          # a sum's unit of work: 64 KB, a few microseconds
MAX_BUCKETS = 4096             # buckets in one iteration (flags reserved for)
SHM_DIR = "/dev/shm"           # where MPICH keeps the window's memory (a tmpfs)


def make_shm_transport(world, host, capacity_bytes, asked, compressor=None):
    """The shm transport over ``host`` (the ranks of this host, all of the
    world's; the transport takes it over) when its shared memory has room
    for the window, else None, ``host`` freed (the caller uses MPI).
    Collective."""
    MPI = world.MPI
    # Past the tmpfs's size the window's pages cannot be had, and the
    # first rank to touch one dies of SIGBUS with no message (a
    # container's /dev/shm is 64 MB unless docker run --shm-size).
    # Segments rounded to 64 KB, and 1 MB to spare, for MPICH's alignment.
    need = sum(-(-_layout(capacity_bytes, q)[3] // 65536) * 65536 for q in range(host.size)) + 2 ** 20
    free = host.bcast(free_bytes(SHM_DIR) if host.rank == 0 else None, 0)
    if free is not None and free < need:
        reason = ("%s has %.1f MB free and the sums need %.1f MB (give it more, e.g. docker run "
                  "--shm-size)" % (SHM_DIR, free / 2 ** 20, need / 2 ** 20))
        asked = True            # worth saying even when nobody asked for shm
    else:
        try:
            return SharedMemoryTransport(world, host, capacity_bytes, compressor)
        except MPI.Exception as e:
            reason = "no shared window of %.1f MB (%s)" % (need / 2 ** 20, e.Get_error_string())
    host.Free()
    if asked and world.rank == 0:
        log.warning("--comm=shm: %s; using --comm=overlap", reason)
    return None


def free_bytes(path):
    """Bytes free to an unprivileged writer under path, or None if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _layout(capacity_bytes, rank):
    """(capacity, flag bytes, done flags, bytes of rank's segment): every
    rank holds [data: capacity][ready flags: MAX_BUCKETS][copied flag]
    [largest magnitudes: MAX_BUCKETS], rank 0 also [result: capacity][done
    flags]."""
    capacity = max(8, -(-int(capacity_bytes) // 8) * 8)
    flags = 8 * (2 * MAX_BUCKETS + 1)
    max_chunks = capacity // CHUNK_BYTES + MAX_BUCKETS
    return capacity, flags, max_chunks, capacity + flags + (capacity + 8 * max_chunks if rank == 0 else 0)


class _Bucket:
    __slots__ = ("buf", "scale", "off", "chunk0", "chunks", "slot", "copied")

    def __init__(self, buf, scale, off, chunk0, chunks, slot):
        self.buf, self.scale, self.off, self.chunk0, self.chunks, self.slot = buf, scale, off, chunk0, chunks, slot
        self.copied = False


class SharedMemoryTransport(Transport):
    name = "shm"

    def __init__(self, world, host, capacity_bytes, compressor=None):
        MPI = self.MPI = world.MPI
        self.host = host
        self.compressor = compressor
        if compressor is not None:
            self.name = "%s-shm" % compressor.name
        self.rank, self.size = host.rank, host.size
        self.capacity, flags, max_chunks, own = _layout(capacity_bytes, self.rank)
        self.win = MPI.Win.Allocate_shared(own, 8, comm=host)
        try:
            self.win.Lock_all(MPI.MODE_NOCHECK)
            seg = [self.win.Shared_query(q)[0] for q in range(self.size)]
            self.data = [np.frombuffer(s, np.uint8, self.capacity) for s in seg]
            self.ready = [np.frombuffer(s, np.int64, MAX_BUCKETS, self.capacity) for s in seg]
            self.copied_round = [np.frombuffer(s, np.int64, 1, self.capacity + 8 * MAX_BUCKETS) for s in seg]
            self.largest = [np.frombuffer(s, np.float64, MAX_BUCKETS, self.capacity + 8 * (MAX_BUCKETS + 1))
                            for s in seg]
            base = self.capacity + flags
            self.result = np.frombuffer(seg[0], np.uint8, self.capacity, base)
            self.done = np.frombuffer(seg[0], np.int64, max_chunks, base + self.capacity)
        except BaseException:
            self.win.Free()
            raise
        # round numbers start at 1: the window's zeros mean "never"
        self.ready[self.rank][:] = 0
        self.copied_round[self.rank][0] = 0
        if self.rank == 0:
            self.done[:] = 0
        self.win.Sync()
        host.Barrier()
        self.round = 1
        self._buckets = []         # this round's, in start order
        self._used = self._chunks_used = 0
        self._copied = 0           # of this round's buckets, copied out here
        self._closing = False

    # -- the interface
    def allreduce_start(self, buf, scale=1.0):
        if not buf.flags.c_contiguous:
            raise CaffeError("--comm=shm sums contiguous buffers only")
        if not self._buckets:
            self._start_round()
        if len(self._buckets) >= MAX_BUCKETS:
            raise CaffeError("--comm=shm: more than %d buckets in an iteration (raise --bucket_mb)"
                             % MAX_BUCKETS)
        # buckets packed at their values' alignment: capacity_bytes of them
        # fit however the gradient is cut (odd-sized pieces around the
        # factor layers' weights included)
        off, nbytes = self._used, buf.nbytes
        self._used += nbytes
        if self._used > self.capacity:
            raise CaffeError("--comm=shm: %d bytes of gradients in one iteration, %d allocated"
                             % (self._used, self.capacity))
        chunks = max(1, -(-nbytes // CHUNK_BYTES))
        b = _Bucket(buf, scale, off, self._chunks_used, chunks, len(self._buckets))
        self._chunks_used += chunks
        self._view(self.data[self.rank], b)[...] = buf.reshape(-1)
        if self.compressor is not None:
            self.largest[self.rank][b.slot] = np.float32(self.compressor.largest(buf))
        self.win.Sync()
        self.ready[self.rank][b.slot] = self.round
        self._buckets.append(b)
        return b

    def wait(self, b):
        if not b.copied:
            while not all(r[b.slot] == self.round for r in self.ready):
                yield_core()
            self.win.Sync()
            wire_scale = self._sum(b)
            self.win.Sync()
            out = b.buf.reshape(-1)
            if self.compressor is not None:
                self.compressor.decompress(self._view(self.result, b, self.compressor.wire_dtype),
                                           b.scale / wire_scale, out)
            elif b.scale != 1.0:
                np.multiply(self._view(self.result, b), out.dtype.type(b.scale), out=out)
            else:
                out[...] = self._view(self.result, b)
            b.copied = True
            self._copied += 1
        if self._closing and self._copied == len(self._buckets):
            # the iteration's buckets are all out on this rank
            self._closing = False
            self.win.Sync()
            self.copied_round[self.rank][0] = self.round
            self.round += 1
            self._buckets = []
            self._used = self._chunks_used = self._copied = 0

    def backward_end(self):
        self._closing = True

    def missing_ranks(self, b):
        return [q for q, ready in enumerate(self.ready) if ready[b.slot] != self.round] or None

    def close(self):
        if self.win is None:
            return
        self.host.Barrier()        # no rank reads a segment any more
        self.win.Unlock_all()
        self.win.Free()
        self.host.Free()
        self.win = None

    # -- the work
    def _view(self, area, b, dtype=None):
        return np.frombuffer(area, dtype or b.buf.dtype, b.buf.size, b.off)

    def _sum(self, b):
        """Sum the chunks of b that no rank has flagged done, starting at this
        rank's share so that ranks summing at once rarely meet; returns the
        compressor's scale (1 without one)."""
        item = b.buf.dtype.itemsize
        per = CHUNK_BYTES // item
        n = b.buf.size
        segs = [self._view(d, b) for d in self.data]
        add, wire_scale = self._add, 1.0
        if self.compressor is not None:
            scales = [self.compressor.piece_scale(float(g[b.slot]), self.size) for g in self.largest]
            wire_scale = self.compressor.sum_scale(scales)
            add = self._compressed_adder(scales, wire_scale, per)
        out = self._view(self.result, b, None if self.compressor is None else self.compressor.wire_dtype)
        first = b.chunks * self.rank // self.size
        for j in range(b.chunks):
            c = (first + j) % b.chunks
            flag = b.chunk0 + c
            if self.done[flag] == self.round:
                continue
            lo, hi = c * per, min(n, (c + 1) * per)
            add([s[lo:hi] for s in segs], out[lo:hi])
            self.win.Sync()
            self.done[flag] = self.round
        return wire_scale

    @staticmethod
    def _add(pieces, out):
        """out := the pieces added in rank order."""
        if len(pieces) == 2:
            np.add(pieces[0], pieces[1], out=out)
        else:
            # partial sums stay private: another rank may be writing
            # this chunk's final values at the same time
            acc = np.add(pieces[0], pieces[1])
            for piece in pieces[2:]:
                acc += piece
            out[...] = acc

    def _compressed_adder(self, scales, wire_scale, per):
        """An ``_add`` for the compressor: each rank's piece compressed with
        its rank's scale, the pieces added by the compressor into ``out``
        under ``wire_scale`` (the exchange transport's arithmetic)."""
        stack = np.empty(self.size * per, self.compressor.wire_dtype)

        def add(pieces, out):
            rows = stack[:self.size * len(out)].reshape(self.size, len(out))
            for row, piece, scale in zip(rows, pieces, scales):
                self.compressor.compress(piece, scale, row)
            # partial sums stay private, as in _add
            total = np.empty(len(out), out.dtype)
            self.compressor.sum(rows, scales, wire_scale, total)
            out[...] = total
        return add

    def _start_round(self):
        """Segments and the result area hold the last round until every rank
        has copied it out."""
        last = self.round - 1
        while not all(c[0] >= last for c in self.copied_round):
            yield_core()
        self.win.Sync()
