"""An array module for tests: NumPy whose arrays refuse host reads.

On the GPU a host read of a device value (``float(a)``, ``a.item()``,
``a.get()``, ``bool(a)``) waits for every kernel queued before it; inside
a training step that stalls the device's queue and rules out capturing the
step as a CUDA graph.  :data:`module` stands in for CuPy on the CPU: its
arrays (:class:`StrictArray`, a NumPy subclass whose reductions stay 0-d
arrays) raise :class:`HostRead` on such reads while :func:`refusing_reads`
is active, so a test runs a whole training step and finds any read the
GPU would wait on.  The only read allowed is the deferred one
(backend/reads.py), which copies with ``np.array``.

The module says ``host_arrays = True``, so the backend runs the CPU's
kernels on its arrays (:func:`caffempi.backend.on_host`), and it is not
NumPy, so nets defer their reads as on the GPU
(:func:`caffempi.backend.reads.defers_reads`).
"""
import threading
import types

import numpy as np

from ..common import locally


class HostRead(AssertionError):
    """A host read of an array value inside :func:`refusing_reads`."""


_state = threading.local()


def refusing_reads():
    """A block inside which host reads of :class:`StrictArray` values raise."""
    return locally(_state, "refusing", True)


def _refuse(what):
    if getattr(_state, "refusing", False):
        raise HostRead("%s of a device array inside the step: the GPU would wait here" % what)


class StrictArray(np.ndarray):
    """A NumPy array whose value reads raise inside :func:`refusing_reads`;
    results of NumPy's functions on it are StrictArrays again, full
    reductions 0-d ones (where NumPy would give a scalar, which reads
    freely)."""

    def __array_wrap__(self, array, context=None, return_scalar=False):
        return super().__array_wrap__(array, context, False)

    def __float__(self):
        _refuse("float()")
        return float(self.view(np.ndarray))

    def __int__(self):
        _refuse("int()")
        return int(self.view(np.ndarray))

    def __bool__(self):
        _refuse("bool()")
        return bool(self.view(np.ndarray))

    def item(self, *args):
        _refuse(".item()")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        _refuse(".tolist()")
        return self.view(np.ndarray).tolist()

    def get(self, *args, **kwargs):
        """CuPy's copy to the host."""
        _refuse(".get()")
        return np.array(self.view(np.ndarray))


def _strict(fn):
    def made(*args, **kwargs):
        out = fn(*args, **kwargs)
        # a NumPy scalar too (np.dot of vectors gives one): a 0-d StrictArray
        return np.asarray(out).view(StrictArray) if isinstance(out, (np.ndarray, np.generic)) else out
    made.__name__ = fn.__name__
    return made


# the functions that make arrays from shapes, host values or other arrays
_MAKERS = ("array", "asarray", "ascontiguousarray", "empty", "zeros", "ones", "full", "empty_like",
           "zeros_like", "ones_like", "full_like", "arange", "concatenate", "stack", "where", "einsum",
           "dot", "tensordot", "broadcast_to", "copy")

module = types.ModuleType("caffempi_strict_numpy", __doc__)
module.__dict__.update({name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
module.__dict__.update({name: _strict(getattr(np, name)) for name in _MAKERS})
module.host_arrays = True
