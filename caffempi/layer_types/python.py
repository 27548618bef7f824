"""Layers written in Python: pycaffe's ``caffe.Layer`` base class and Caffe's
``Python`` layer type, which imports ``python_param.module``, instantiates its
class ``python_param.layer`` and runs it as a layer of the net."""
import importlib
import importlib.util
import sys

import numpy as np

from ..blob import BlobVec
from ..common import TRAIN, CaffeError, log
from . import base

# The modules `import caffe` needs in Python layers written for pycaffe.
PYCAFFE_ALIASES = ("caffe", "caffe.io", "caffe.proto", "caffe.proto.caffe_pb2")


class Layer:
    """pycaffe's ``caffe.Layer``: subclass it and define ``setup(bottom, top)``,
    ``reshape(bottom, top)``, ``forward(bottom, top)`` and
    ``backward(top, propagate_down, bottom)`` over lists of blobs
    (``bottom[0].data``, ``top[0].reshape(*dims)``, ``top[0].data[...] = y``,
    ``bottom[0].diff[...] = dx`` for the bottoms with ``propagate_down[i]``).

    Attributes, set before ``setup`` as Caffe's PythonLayer does:
    ``param_str`` (python_param.param_str), ``phase`` (caffempi.TRAIN or
    TEST) and ``blobs``, the learnable parameters (``self.blobs.add_blob(*dims)``
    in setup): the net trains them like any layer's, and backward *adds* their
    gradients (as Caffe's layers do) to ``blobs[i].diff``.

    A loss layer's top diff holds its loss weight in backward (set
    ``loss_weight: 1`` in the prototxt: a Python layer is no loss by default,
    as in Caffe); scale the bottom diffs by it, as Caffe's loss layers do.
    """

    def __init__(self, param=None):
        self.param_str = param.python_param.param_str if param is not None else ""
        self.phase = TRAIN
        self.blobs = BlobVec()

    def setup(self, bottom, top):
        """Check the bottoms, read ``param_str``, add parameter blobs."""

    def reshape(self, bottom, top):
        raise NotImplementedError("%s defines no reshape(bottom, top)" % type(self).__name__)

    def forward(self, bottom, top):
        raise NotImplementedError("%s defines no forward(bottom, top)" % type(self).__name__)

    def backward(self, top, propagate_down, bottom):
        """No gradient (a data layer): fine while no bottom needs one."""
        if any(propagate_down):
            raise CaffeError("%s defines no backward(top, propagate_down, bottom)" % type(self).__name__)


def alias_pycaffe_modules():
    """Make ``import caffe`` (and caffe.io, caffe.proto.caffe_pb2) give caffempi
    when no real pycaffe is importable, so Python layers written for pycaffe
    run unedited.  A real pycaffe on sys.path is left alone (its caffe.Layer
    is no caffempi.Layer: :class:`PythonLayer` then says so)."""
    if "caffe" in sys.modules:
        return
    spec = importlib.util.find_spec("caffe")
    if spec is not None and spec.origin is not None:     # a module or package, not a bare directory
        return
    import caffempi
    targets = (caffempi, caffempi.io, caffempi.proto, caffempi.proto.caffe_pb2)
    sys.modules.update(zip(PYCAFFE_ALIASES, targets))
    log.info("No pycaffe importable: 'import caffe' in Python layers gives caffempi (%s)",
             ", ".join(PYCAFFE_ALIASES))


def import_layer_class(layer_param):
    """The class ``python_param.layer`` of module ``python_param.module``,
    imported from sys.path as pycaffe does (BVLC Caffe does not look in the
    prototxt's directory, and neither does this: put it on PYTHONPATH)."""
    p = layer_param.python_param
    where = "layer '%s' (Python)" % layer_param.name
    if not p.module or not p.layer:
        raise CaffeError("%s: python_param needs both module and layer" % where)
    alias_pycaffe_modules()
    try:
        module = importlib.import_module(p.module)
    except ModuleNotFoundError as e:
        if e.name is None or not (p.module == e.name or p.module.startswith(e.name + ".")):
            raise                                        # the module itself fails to import something
        raise CaffeError("%s: python_param.module '%s' is not importable from sys.path (Caffe does not "
                         "search the prototxt's directory: add the module's directory to PYTHONPATH)"
                         % (where, p.module)) from None
    cls = getattr(module, p.layer, None)
    if cls is None:
        raise CaffeError("%s: module '%s' (%s) has no class '%s' (python_param.layer)"
                         % (where, p.module, getattr(module, "__file__", "?"), p.layer))
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        bases = ", ".join("%s.%s" % (b.__module__, b.__qualname__) for b in getattr(cls, "__mro__", ())[1:])
        raise CaffeError("%s: %s.%s is not a subclass of caffempi.Layer (pycaffe's caffe.Layer; its bases: %s)"
                         % (where, p.module, p.layer, bases or "none"))
    return cls


@base.register("Python")
class PythonLayer(base.Layer):
    """Caffe's Python layer: runs an instance of a :class:`Layer` subclass
    (``python_layer``), whose ``blobs`` are this layer's parameter blobs.

    The instance gets ``param_str``, ``phase`` and ``blobs`` before its setup,
    as in Caffe.  Before each forward the tops that are not bottoms get fresh
    zeroed arrays: a pycaffe layer writes its tops in place, and between passes
    the net's memory plan may leave a read-only placeholder there.
    ``python_param.share_in_parallel`` (share one instance among a process's
    solver threads) has no meaning here: every rank runs its own instance, and
    its parameters join the gradient exchange like any layer's.  On the GPU
    backend the blobs hold CuPy arrays, not pycaffe's NumPy ones: such a layer
    must work on either (``cupy.get_array_module``).  A pycaffe loss layer
    need not read its top's diff (BVLC's pyloss.py does not): data-parallel
    averaging scales the summed gradients, not backward's seed, so it holds
    for such a layer too.
    """

    def __init__(self, layer_param, phase=TRAIN, xp=np, dtype=np.float32):
        super().__init__(layer_param, phase, xp, dtype)
        self.blobs = BlobVec(self.xp, self.dtype)
        self.python_layer = import_layer_class(layer_param)(layer_param)

    def setup(self, bottom, top):
        layer = self.python_layer
        layer.param_str = self.param.python_param.param_str
        layer.phase = self.phase
        layer.blobs = self.blobs
        layer.setup(bottom, top)

    def reshape(self, bottom, top):
        self.python_layer.reshape(bottom, top)

    def forward(self, bottom, top):
        for t in top:
            if not any(t is b for b in bottom):
                t.data = self.xp.zeros(t.shape, self.dtype)
        self.python_layer.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.python_layer.backward(top, propagate_down, bottom)
