"""Caffe's weight fillers.  Values are drawn on the host from the process RNG
(:func:`caffempi.common.rng`) so a seed gives the same weights on any backend."""
import math

import numpy as np

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
