"""Array backends.  Layer code is written once against an array module ``xp``
(NumPy or CuPy); the few kernels that need two implementations live here."""
import numpy as np

_cupy = None
_default = np      # what nets and solvers made without ``xp`` use (set_mode_*)


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


def _usable_cupy(what):
    cp = cupy_or_none()
    try:
        if cp is not None and cp.cuda.runtime.getDeviceCount() > 0:
            return cp
    except Exception:
        pass
    from ..common import CaffeError
    raise CaffeError("%s: no usable GPU (CuPy with a working CUDA device is required)" % what)


def set_mode_cpu():
    """pycaffe's ``caffe.set_mode_cpu()``: nets and solvers made without
    ``xp`` compute with NumPy."""
    global _default
    _default = np


def set_mode_gpu():
    """pycaffe's ``caffe.set_mode_gpu()``: nets and solvers made without
    ``xp`` compute with CuPy on the current device (:func:`set_device`)."""
    global _default
    _default = _usable_cupy("set_mode_gpu")


def set_device(device_id):
    """pycaffe's ``caffe.set_device(id)``: the GPU that CuPy uses from now on."""
    cp = _usable_cupy("set_device")
    count = cp.cuda.runtime.getDeviceCount()
    if not 0 <= int(device_id) < count:
        from ..common import CaffeError
        raise CaffeError("set_device: no GPU %d (this host has %d)" % (device_id, count))
    cp.cuda.Device(int(device_id)).use()


def default_array_module():
    return _default


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
