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


def usable_cupy(what):
    """The cupy module when it loads and sees a CUDA device, else a
    CaffeError starting with ``what``."""
    from ..common import CaffeError
    cp = cupy_or_none()
    reason = "CuPy with a working CUDA device is required"
    if cp is not None:
        try:
            if cp.cuda.runtime.getDeviceCount() > 0:
                return cp
        except Exception as e:      # no driver, or no device visible
            reason = str(e)
    raise CaffeError("%s: no usable GPU (%s)" % (what, reason))


def parse_gpu_ids(spec, count):
    """``--gpu``'s value: ``all`` (the ``count`` devices) or ids separated by ','."""
    if spec == "all":
        return list(range(count))
    try:
        return [int(g) for g in spec.split(",") if g]
    except ValueError:
        from ..common import CaffeError
        raise CaffeError("invalid --gpu value '%s' (device ids separated by ',' or 'all')" % spec) from None


def check_device_id(what, device, count):
    if not 0 <= device < count:
        from ..common import CaffeError
        raise CaffeError("%s: no GPU %d (this host has %d)" % (what, device, count))


def set_mode_cpu():
    """pycaffe's ``caffe.set_mode_cpu()``: nets and solvers made without
    ``xp`` compute with NumPy."""
    global _default
    _default = np


def set_mode_gpu():
    """pycaffe's ``caffe.set_mode_gpu()``: nets and solvers made without
    ``xp`` compute with CuPy on the current device (:func:`set_device`)."""
    global _default
    _default = usable_cupy("set_mode_gpu")


def set_device(device_id):
    """pycaffe's ``caffe.set_device(id)``: the GPU that CuPy uses from now on."""
    cp = usable_cupy("set_device")
    check_device_id("set_device", int(device_id), cp.cuda.runtime.getDeviceCount())
    cp.cuda.Device(int(device_id)).use()


def default_array_module():
    return _default


def on_host(xp):
    """Whether ``xp``'s arrays live in host memory and run the CPU's
    kernels: NumPy, or a module that says so with ``host_arrays = True``
    (caffempi.testing.strict: NumPy arrays that refuse host reads, the
    GPU's rule checked on the CPU)."""
    return xp is np or bool(getattr(xp, "host_arrays", False))


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    return a.get() if hasattr(a, "get") else np.asarray(a)


def synchronize(xp):
    """Wait for the device's queued work (timing GPU code); no-op on NumPy."""
    if not on_host(xp):
        xp.cuda.get_current_stream().synchronize()
