"""Matrix products split over the intra-op threads.

BLAS runs at one thread (:mod:`caffempi.backend.threads`); a large product
is cut into one block of output rows (or columns) per intra-op thread
instead.  At one thread a product stays whole: splitting it only costs
(docs/design/cpu.md, "Products").
"""
import numpy as np

from .. import cblas, threads
from .chunking import each_chunk

# Products of at least this many multiply-adds are split over the threads.
_SPLIT_MIN_MACS = 1 << 20


def _blocks(size, t, unit=32):
    """(start, length) of up to ``t`` blocks of ``size`` rows (or columns),
    cut at multiples of ``unit``."""
    step = -(-(-(-size // t)) // unit) * unit
    return [(i, min(step, size - i)) for i in range(0, size, step)]


def matmul(a, b):
    """a (M, K) @ b (K, N), split into one block of output rows (columns
    where M < 64) per intra-op thread, at multiples of 32 rows (128
    columns).  Unlike the convolutions' chunks these blocks depend on the
    thread count; OpenBLAS gives bitwise the same result for most row
    splits but not all (it has special kernels for small shapes), so
    products may differ in the last bits between thread counts."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.result_type(a, b))
    t = threads.thread_count()
    if t == 1 or m * n * k < _SPLIT_MIN_MACS or (m < 64 and n < 256):
        return np.matmul(a, b, out=out)
    if m >= 64:
        each_chunk(_blocks(m, t), lambda i, r: np.matmul(a[i:i + r], b, out=out[i:i + r]))
    else:
        each_chunk(_blocks(n, t, 128), lambda j, r: np.matmul(a, b[:, j:j + r], out=out[:, j:j + r]))
    return out


def matmul_into(a, b, out, accumulate=False):
    """out = a (M, K) @ b (K, N), or out += a @ b with ``accumulate``, with
    one GEMM (beta = 0 or 1) writing straight into the C-contiguous ``out``:
    no temporary product and no second pass over ``out``, which matters
    where a few rows make a large gradient (a memory-bound product: see
    docs/design/cpu.md).  Through :mod:`caffempi.backend.cblas`, which releases the GIL;
    NumPy's products where that is missing.  Split into blocks of ``out``'s
    rows on the intra-op threads as :func:`matmul`."""
    if cblas.gemm is None or out.dtype.type not in (np.float32, np.float64) or not out.flags.c_contiguous:
        if accumulate:
            out += matmul(a, b)
        else:
            out[...] = matmul(a, b)
        return out
    m, n = out.shape
    a, b = (cblas.operand(x.astype(out.dtype, copy=False)) for x in (a, b))
    beta = 1.0 if accumulate else 0.0

    def rows(i, r):
        cblas.gemm(a[i:i + r], b, out[i:i + r], beta)
    t = threads.thread_count()
    if t == 1 or m * n * a.shape[1] < _SPLIT_MIN_MACS or m < 64:
        rows(0, m)
    else:
        each_chunk(_blocks(m, t), rows)
    return out
