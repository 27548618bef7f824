"""Compressors: how gradients cross the network in fewer bytes
(``--comm_dtype``; Horovod's ``Compressor``, DDP's fp16 hook).

A :class:`Compressor` says how a float32 buffer becomes a wire buffer and
back, and how wire pieces add up.  It is used in two ways:

* **sums** (gradient buckets, by a transport that adds the ranks' pieces
  itself: ``transports.exchange``, ``transports.shm``): every rank
  compresses with its own scale (:meth:`Compressor.piece_scale`), which
  travels with its pieces, so no collective agrees on one first; the
  pieces are added by :meth:`Compressor.sum`, each unscaled by its rank's
  scale, and the sum is compressed again with a scale every rank derives
  from all of them (:meth:`Compressor.sum_scale`), then decompressed with
  the mean folded into the same pass;
* **gathers** (sufficient factors, which are concatenated, not added): each
  rank picks its own scale, which travels inside the message
  (:meth:`Compressor.encode`, :meth:`Compressor.decode`).

A new compressor subclasses :class:`Compressor` and gets a name in
:data:`COMPRESSORS`.
"""
import math
from abc import ABC, abstractmethod

import numpy as np

from ..backend import half


class Compressor(ABC):
    """A wire format for float32 buffers, with its scale rules."""

    #: the --comm_dtype name, and the suffix of the transport's log name
    name = None
    #: the wire values' NumPy type
    wire_dtype = None
    #: the MPI-visible type of a wire value (an unsigned integer of its size:
    #: MPI moves the bytes, the compressor adds them)
    wire_view = None

    @staticmethod
    def largest(buf):
        """This rank's largest magnitude in ``buf`` (0 for an empty one);
        max and -min take no temporary, unlike abs()."""
        flat = buf.reshape(-1)
        return float(max(flat.max(), -flat.min())) if flat.size else 0.0

    @abstractmethod
    def piece_scale(self, largest, ranks):
        """The scale a rank applies before :meth:`compress`, from its own
        largest magnitude, with room for the sum of ``ranks`` such pieces."""

    @staticmethod
    def sum_scale(scales):
        """The scale of a sum of pieces compressed with ``scales`` (every
        rank has them all, so every rank derives the same): the smallest,
        under which the sum of the pieces stays in range."""
        return float(np.min(scales))

    def exponent(self, scale):
        """The wire value that carries ``scale`` (a power of two) beside
        the pieces: its exponent, exact in any float wire type."""
        return math.log2(scale)

    @staticmethod
    def scales(exponents):
        """The scales (float32) that :meth:`exponent`'s wire values carry,
        in one pass for all ranks."""
        return np.ldexp(np.float32(1), np.asarray(exponents).astype(np.int32))

    @abstractmethod
    def compress(self, buf, scale, out):
        """``out`` (wire) := ``buf`` (float32) times ``scale``, in wire form."""

    @abstractmethod
    def decompress(self, wire, scale, out):
        """``out`` := ``wire`` widened to out's type, times ``scale``."""

    @abstractmethod
    def sum(self, pieces, scales, out_scale, out):
        """``out`` (wire, n) := the sum of ``pieces`` (ranks x n wire, rows
        contiguous), each decompressed with 1/its rank's scale, added in rank
        order (every rank adding them gets the same bits), compressed with
        ``out_scale``."""

    def encode(self, buf):
        """A self-describing wire message of ``buf``: its values scaled by
        this rank's own scale, then the scale (for gathers)."""
        buf = np.asarray(buf)
        scale = self.piece_scale(self.largest(buf), 1)
        send = np.empty(buf.size + 1, self.wire_dtype)
        self.compress(buf, scale, send[:-1])
        send[-1] = self.exponent(scale)
        return send

    def decode(self, message, out, scale=1.0):
        """``out`` := the values of an :meth:`encode` message, unscaled,
        times ``scale``."""
        self.decompress(message[:-1], scale / float(self.scales(message[-1:])[0]), out)


class Float16(Compressor):
    """float16 on the wire, float32 sums (half the bytes of float32).

    Scales are powers of two (exact to apply and undo) that bring a rank's
    largest magnitude to at most ``SCALED_MAX / ranks``: the sum of the
    ranks' pieces under the smallest of their scales stays below float16's
    maximum (65504), and gradients,
    whose magnitudes (1e-5 to 1e-8) are float16's subnormals, keep its full
    11 bits.  The conversions and the sum are backend/half.py's compiled
    kernels (NumPy's casts cost more than the link saved)."""
    name = "fp16"
    wire_dtype = np.dtype(np.float16)
    wire_view = np.dtype(np.uint16)
    SCALED_MAX = 2.0 ** 14

    def piece_scale(self, largest, ranks):
        """1 for zeros or non-finite values (they stay as they are)."""
        if not math.isfinite(largest) or largest <= 0:
            return 1.0
        exponent = math.floor(math.log2(self.SCALED_MAX / (ranks * largest)))
        return math.ldexp(1.0, max(-126, min(126, exponent)))

    def compress(self, buf, scale, out):
        half.to_half(buf, scale, out)

    def decompress(self, wire, scale, out):
        half.from_half(wire, scale, out)

    def sum(self, pieces, scales, out_scale, out):
        half.sum_halves(pieces, out, np.float32(1) / np.asarray(scales, np.float32), out_scale)


#: --comm_dtype name -> compressor class (fp32: none)
COMPRESSORS = {cls.name: cls for cls in (Float16,)}
