"""Flush-to-zero for denormal floats in the threads that compute.

x86 handles denormal (subnormal) floats in microcode: a step whose values
underflow (a net driven to zero loss, the decaying momentum of dead units)
ran many times slower (docs/configuration.md).  Setting MXCSR's FTZ
(results that would be denormal are 0) and DAZ (denormal inputs read as 0)
removes that cost, as ``torch.set_flush_denormal(True)`` does; it changes
only values below 1.2e-38, far under float32's precision of any weight or
gradient.

MXCSR is per thread.  :func:`apply_here` sets it in the calling thread when
:attr:`caffempi.config.settings.ftz` is on (``CAFFEMPI_FTZ``, default 1):
every thread that computes calls it once, from
:func:`.threads.thread_count` (the kernels and products ask it first), the
kernel pool's initializer, the communication thread and the data workers.
BLAS runs on those threads (it is kept at one thread of its own), so its
products are covered too.

The register is read and written through glibc's ``fegetmode``/``fesetmode``
(ISO C's ``femode_t`` holds MXCSR on x86-64), called with ctypes: no compiled
code of ours.  Elsewhere (another machine or C library) :func:`supported` is
False and nothing is changed.
"""
import ctypes
import ctypes.util
import platform

from .. import config

FTZ = 0x8000     # MXCSR bit 15: flush denormal results to zero
DAZ = 0x0040     # MXCSR bit 6: denormal inputs are zero


class _FeMode(ctypes.Structure):
    """glibc's x86-64 ``femode_t``."""
    _fields_ = [("control_word", ctypes.c_ushort), ("reserved", ctypes.c_ushort),
                ("mxcsr", ctypes.c_uint)]


_libm = None


def _lib():
    """libm with fegetmode/fesetmode on x86-64, else False (cached)."""
    global _libm
    if _libm is None:
        _libm = False
        if platform.machine().lower() in ("x86_64", "amd64"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
                lib.fegetmode.argtypes = lib.fesetmode.argtypes = [ctypes.POINTER(_FeMode)]
                _libm = lib
            except (OSError, AttributeError):    # no libm, or one older than glibc 2.25
                pass
    return _libm


def supported():
    """True where this thread's MXCSR can be read and set."""
    return bool(_lib())


def mxcsr():
    """The calling thread's MXCSR control bits (None where unsupported)."""
    lib = _lib()
    if not lib:
        return None
    mode = _FeMode()
    lib.fegetmode(ctypes.byref(mode))
    return mode.mxcsr


def set_flush(enable):
    """Sets (or clears) FTZ and DAZ in the calling thread; returns whether
    they were set before (None where unsupported)."""
    lib = _lib()
    if not lib:
        return None
    mode = _FeMode()
    lib.fegetmode(ctypes.byref(mode))
    before = mode.mxcsr & (FTZ | DAZ) == FTZ | DAZ
    mode.mxcsr = mode.mxcsr | FTZ | DAZ if enable else mode.mxcsr & ~(FTZ | DAZ)
    lib.fesetmode(ctypes.byref(mode))
    return before


def apply_here():
    """Flushes denormals in the calling thread if the ``ftz`` setting is on."""
    if config.settings.ftz:
        set_flush(True)
