"""Scratch buffers that persist between kernel calls, one set per thread.

Why: a fresh multi-MB temporary page-faults on every call, which can cost
as much as the GEMM it feeds (docs/design/cpu.md).
"""
import threading

import numpy as np

_local = threading.local()


def buffer(slot, size, dtype):
    """A 1-D scratch array of ``size`` elements of ``dtype``, the calling
    thread's own for ``slot``: its contents are undefined, and the next call
    for the same slot, dtype and thread returns the same memory (grown when
    ``size`` is larger), so a kernel must be done with it before asking
    again."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (slot, np.dtype(dtype).str)
    b = bufs.get(key)
    if b is None or b.size < size:
        b = bufs[key] = np.empty(max(size, 1), dtype)
    return b[:size]
