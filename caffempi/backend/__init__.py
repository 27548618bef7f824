"""Array backends.  Layer code is written once against an array module ``xp``
(NumPy or CuPy); the few kernels that need two implementations live here."""
import numpy as np

_cupy = None


def cupy_or_none():
    """The cupy module if it imports, else None (cached)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
            _cupy = cupy
        except Exception:  # ImportError, or a CUDA library that fails to load
            _cupy = False
    return _cupy or None


def get_array_module(*arrays):
    """Chainer's pattern: cupy if any argument is a CuPy array, else numpy."""
    cp = cupy_or_none()
    if cp is not None:
        return cp.get_array_module(*arrays)
    return np


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    return a.get() if hasattr(a, "get") else np.asarray(a)


def synchronize(xp):
    """Wait for the device's queued work (timing GPU code); no-op on NumPy."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
