"""Blob: an N-d array with its gradient (``diff``), as in Caffe and pycaffe."""
import numbers

import numpy as np

from .common import CaffeError


def _released(data):
    """Whether ``data`` is what :meth:`Blob.release_data` left: a broadcast
    of a 0-d array (no storage of its own; a 0-d view is not one)."""
    base = getattr(data, "base", None)
    return base is not None and base.ndim == 0 and data.ndim > 0 and not any(data.strides)


class Blob:
    """Holds ``data`` and ``diff`` arrays of one shape on one array module.

    Activation blobs own their arrays: assigning ``blob.data = a`` rebinds
    (no copy), so a layer can hand over the array it computed.  Parameter blobs
    are views into the net's flat buffers (see :meth:`bind`): assigning to them
    copies into the view, so the flat buffers always hold the values.
    """

    __slots__ = ("_data", "_diff", "_shape", "xp", "dtype", "_bound")

    def __init__(self, shape=(), xp=np, dtype=np.float32):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self._bound = False
        self._data = None
        self._diff = None
        self._shape = ()
        self.reshape(shape)

    # ------------------------------------------------------------------ shape
    @property
    def shape(self):
        return self._shape

    @property
    def count(self):
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def num_axes(self):
        return len(self._shape)

    def shape_at(self, axis):
        return self._shape[self.canonical_axis(axis)]

    def canonical_axis(self, axis):
        n = len(self._shape)
        if not -n <= axis < max(n, 1):
            raise ValueError("axis %d out of range for a %d-D blob %s" % (axis, n, self._shape))
        return axis % n if n else 0

    def count_range(self, start, end=None):
        n = 1
        for d in self._shape[start:end]:
            n *= d
        return n

    def reshape(self, *dims):
        """``reshape(2, 3)`` as pycaffe, or ``reshape((2, 3))``; ``reshape()`` is a
        0-D (scalar) blob.  Data keeps its values when the shape is unchanged;
        else it is zeros, or still released where a memory plan released it
        (the next forward rebinds it: uneven batch shares reshape every
        blob, and zeros for all of them cost a CIFAR10-quick step 3-4 ms)."""
        if len(dims) == 1 and not isinstance(dims[0], numbers.Integral):
            dims = dims[0]
        shape = tuple(int(d) for d in dims)
        if any(d < 0 for d in shape):
            raise ValueError("negative blob dimension in %s" % (shape,))
        if shape == self._shape and self._data is not None:
            return
        if self._bound:
            if int(np.prod(shape)) != self.count:
                raise ValueError("cannot reshape parameter blob %s to %s" % (self._shape, shape))
            self._data = self._data.reshape(shape)
            self._diff = self._diff.reshape(shape)
        elif _released(self._data):
            # its producer rebinds it: zeros would be wasted
            self._shape = shape
            self.release_data(self._data.base)
            self._diff = None
        else:
            self._data = self.xp.zeros(shape, self.dtype)
            self._diff = None
        self._shape = shape

    def release_data(self, zero):
        """Drop the data (a memory plan ends its lifetime): the blob holds a
        read-only broadcast of the 0-d array ``zero`` to its shape, no
        storage, until its producer rebinds it; :meth:`reshape` keeps it
        released."""
        self._data = self.xp.broadcast_to(zero, self._shape)

    def reshape_like(self, other):
        self.reshape(other.shape)

    def legacy_shape(self, index):
        """Caffe's LegacyShape: axis ``index`` of a blob of at most 4 axes, 1
        past its last axis (``num``/``channels``/``height``/``width``)."""
        if len(self._shape) > 4:
            raise CaffeError("cannot use the legacy accessors (num, channels, height, width) "
                             "on a blob of %d axes %s" % (len(self._shape), self._shape))
        return self._shape[index] if index < len(self._shape) else 1

    @property
    def num(self):
        return self.legacy_shape(0)

    @property
    def channels(self):
        return self.legacy_shape(1)

    @property
    def height(self):
        return self.legacy_shape(2)

    @property
    def width(self):
        return self.legacy_shape(3)

    # ------------------------------------------------------------ data / diff
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        if value is self._data:
            return
        if self._bound:
            self._data[...] = value
        else:
            if value.shape != self._shape:
                raise ValueError("blob shape is %s, assigned data has %s" % (self._shape, value.shape))
            self._data = value

    @property
    def diff(self):
        if self._diff is None:
            self._diff = self.xp.zeros(self._shape, self.dtype)
        return self._diff

    @diff.setter
    def diff(self, value):
        if value is self._diff:
            return
        if self._bound:
            self._diff[...] = value
        else:
            if value.shape != self._shape:
                raise ValueError("blob shape is %s, assigned diff has %s" % (self._shape, value.shape))
            self._diff = value

    def has_diff(self):
        return self._diff is not None

    def release_diff(self):
        """Drop the gradient storage of an activation blob (it is recreated on use)."""
        if not self._bound:
            self._diff = None

    def bind(self, data_view, diff_view):
        """Make this blob a view into flat buffers (values copied in first)."""
        data_view[...] = self._data.reshape(data_view.shape)
        if self._diff is not None:
            diff_view[...] = self._diff.reshape(diff_view.shape)
        else:
            diff_view[...] = 0
        self._data = data_view.reshape(self._shape)
        self._diff = diff_view.reshape(self._shape)
        self._bound = True

    @property
    def bound(self):
        return self._bound

    def __repr__(self):
        return "Blob(%s)" % (self._shape,)


class BlobVec(list):
    """pycaffe's BlobVec: a layer's list of parameter blobs; ``add_blob(*dims)``
    appends a blob of zeros on the layer's array module and dtype."""

    def __init__(self, xp=np, dtype=np.float32):
        super().__init__()
        self.xp = xp
        self.dtype = np.dtype(dtype)

    def add_blob(self, *dims):
        self.append(Blob(dims, self.xp, self.dtype))
