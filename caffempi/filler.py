"""Caffe's weight fillers.  Values are drawn on the host from the process RNG
(:func:`caffempi.common.rng`) so a seed gives the same weights on any backend."""
import math

import numpy as np

from .backend import threads
from .common import CaffeError, rng

FAN_IN, FAN_OUT, AVERAGE = 0, 1, 2


def _fan(shape, variance_norm):
    count = int(np.prod(shape))
    fan_in = count // shape[0] if shape and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    if variance_norm == AVERAGE:
        return (fan_in + fan_out) / 2.0
    if variance_norm == FAN_OUT:
        return fan_out
    return fan_in


def fill(filler, shape, dtype=np.float32):
    """Return a NumPy array of ``shape`` filled as Caffe's FillerParameter says."""
    shape = tuple(shape)
    r = rng()
    kind = filler.type
    if kind == "constant":
        out = np.full(shape, filler.value)
    elif kind == "uniform":
        out = r.uniform(filler.min, filler.max, shape)
    elif kind == "gaussian":
        out = r.normal(filler.mean, filler.std, shape)
        if filler.sparse >= 0:
            # Each output keeps on average `sparse` non-zero inputs.
            if len(shape) < 1 or shape[0] == 0:
                raise CaffeError("sparse gaussian filler needs a blob with a first axis")
            keep = filler.sparse / float(shape[0])
            out = out * (r.random_sample(shape) < keep)
    elif kind == "positive_unitball":
        out = r.uniform(0, 1, shape)
        rows = out.reshape(shape[0], -1) if shape else out.reshape(1, -1)
        rows /= rows.sum(axis=1, keepdims=True)
    elif kind == "xavier":
        scale = math.sqrt(3.0 / _fan(shape, filler.variance_norm))
        out = r.uniform(-scale, scale, shape)
    elif kind == "msra":
        std = math.sqrt(2.0 / _fan(shape, filler.variance_norm))
        out = r.normal(0.0, std, shape)
    elif kind == "bilinear":
        if len(shape) != 4 or shape[2] != shape[3]:
            raise CaffeError("bilinear filler needs a square 4-D blob, got %s" % (shape,))
        k = shape[3]
        f = math.ceil(k / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        y = np.arange(k)[:, None]
        x = np.arange(k)[None, :]
        kernel = (1 - np.abs(x / f - c)) * (1 - np.abs(y / f - c))
        out = np.broadcast_to(kernel, shape).copy()
    else:
        raise CaffeError("unknown filler type '%s'" % kind)
    return np.array(out, dtype=dtype, order="C")


# A refill draws this many values a generator (a chunk on the kernel threads).
_REFILL_CHUNK = 1 << 16


def refill(filler, shape, dtype=np.float32):
    """Values for a top drawn anew every forward (DummyData).  Gaussian and
    uniform float32 values come from float32 uniforms of NumPy's Generator
    (SFC64), gaussians by Box-Muller (:func:`_box_muller`), in fixed chunks
    on the kernel threads, each seeded from one draw of the process RNG:
    reproducible from random_seed and the same for any thread count.  Other
    fillers and dtypes: :func:`fill`."""
    kind = filler.type
    if np.dtype(dtype) != np.float32 or kind not in ("gaussian", "uniform") or \
            (kind == "gaussian" and filler.sparse >= 0):
        return fill(filler, shape, dtype)
    out = np.empty(int(np.prod(shape)), np.float32)
    chunks = max(1, -(-out.size // _REFILL_CHUNK))
    seeds = np.random.SeedSequence(int(rng().randint(2 ** 31))).spawn(chunks)
    if kind == "gaussian":
        scale, shift = filler.std, filler.mean
    else:
        scale, shift = filler.max - filler.min, filler.min

    def draw(i):
        part = out[i * _REFILL_CHUNK:(i + 1) * _REFILL_CHUNK]
        g = np.random.Generator(np.random.SFC64(seeds[i]))
        if kind == "gaussian":
            _box_muller(g, part)
        else:
            g.random(out=part, dtype=np.float32)
        if scale != 1:
            part *= np.float32(scale)
        if shift:
            part += np.float32(shift)
    threads.for_chunks(chunks, draw)
    return out.reshape(shape)


def _box_muller(g, out):
    """``out`` (float32, 1-D) filled N(0, 1) by Box-Muller from float32
    uniforms, faster than NumPy's float32 ziggurat and as fast as BVLC
    Caffe's draws (docs/design/cpu.md).  24-bit uniforms end the tails at
    5.8 sigma."""
    half = -(-out.size // 2)
    u = g.random(2 * half, dtype=np.float32)
    radius, angle = u[:half], u[half:]
    np.subtract(np.float32(1), radius, out=radius)          # (0, 1]: log is finite
    np.log(radius, out=radius)
    radius *= np.float32(-2)
    np.sqrt(radius, out=radius)
    angle *= np.float32(2 * np.pi)
    low, high = out[:half], out[half:]
    np.cos(angle, out=low)
    low *= radius
    np.sin(angle[:high.size], out=high)
    high *= radius[:high.size]
