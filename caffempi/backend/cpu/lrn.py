"""LRN's window sums on the CPU (the rest of LRN is written once against
``xp`` in :mod:`caffempi.backend.kernels`).  A window sum along an axis is
a sum of shifted slices of a zero-padded copy: one whole-array add a tap."""
import numpy as np


def _window_sum(a, axis, size, pre):
    """s[..., i, ...] = sum of a[..., i-pre .. i-pre+size-1, ...] along
    ``axis`` (zeros outside)."""
    length = a.shape[axis]
    shape = list(a.shape)
    shape[axis] += size - 1
    padded = np.zeros(shape, a.dtype)

    def span(start):
        return padded[(slice(None),) * axis + (slice(start, start + length),)]
    span(pre)[...] = a
    s = span(0).copy()
    for t in range(1, size):
        s += span(t)
    return s


def channel_window_sum(a, size, pre):
    """s[:, c] = sum of a[:, c-pre .. c-pre+size-1] (zeros outside)."""
    return _window_sum(a, 1, size, pre)


def spatial_window_sum(a, size, pre):
    """Sum over a size x size window centred (offset pre) on each pixel of
    the NCHW ``a``, zeros outside: separable, along W and then H."""
    return _window_sum(_window_sum(a, 3, size, pre), 2, size, pre)
