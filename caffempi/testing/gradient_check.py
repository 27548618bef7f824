"""Finite-difference gradient checks of single layers (Caffe's GradientChecker,
run in float64 so the numerical gradient is trustworthy)."""
import numpy as np
from google.protobuf import text_format

from ..blob import Blob
from ..common import TRAIN, set_random_seed
from ..layer_types.base import create_layer
from ..proto import caffe_pb2


def make_layer(text, phase=TRAIN, xp=np, dtype=np.float64):
    """A layer from the text of a LayerParameter (``'type: "ReLU"'``)."""
    lp = caffe_pb2.LayerParameter()
    text_format.Merge(text, lp)
    if not lp.name:
        lp.name = lp.type.lower() or "layer"
    return create_layer(lp, phase, xp, dtype)


def _as_layer(layer, phase, dtype):
    return make_layer(layer, phase, dtype=dtype) if isinstance(layer, str) else layer


def run_layer(layer, bottom_arrays, num_top=None, phase=TRAIN, dtype=np.float64, seed=1701):
    """Set up and run forward; returns (layer, bottom blobs, top blobs)."""
    layer = _as_layer(layer, phase, dtype)
    xp = layer.xp
    bottoms = []
    for a in bottom_arrays:
        b = Blob(np.shape(a), xp, layer.dtype)
        b.data = xp.asarray(a, layer.dtype).copy()
        bottoms.append(b)
    if num_top is None:
        num_top = max(len(layer.param.top), 1)
    tops = [Blob((), xp, layer.dtype) for _ in range(num_top)]
    set_random_seed(seed)
    layer.check_blob_counts(bottoms, tops)
    layer.setup(bottoms, tops)
    layer.reshape(bottoms, tops)
    set_random_seed(seed)
    layer.forward(bottoms, tops)
    return layer, bottoms, tops


def check_gradient(layer, bottom_arrays, check_bottoms=None, check_params=True, num_top=None,
                   eps=1e-4, rtol=1e-4, atol=1e-6, phase=TRAIN, seed=1701, top_weights=None):
    """Compare a layer's backward with central differences of
    L = sum_j <top_j, W_j> for fixed random W_j, over every checked bottom
    (indices in ``check_bottoms``, default all) and every parameter blob.

    Stochastic layers see the same random draws in every forward (the process
    RNG is reseeded).  Raises AssertionError naming the blob and element.
    """
    layer, bottoms, tops = run_layer(layer, bottom_arrays, num_top, phase, np.float64, seed)
    xp = layer.xp
    if check_bottoms is None:
        check_bottoms = range(len(bottoms))
    check_bottoms = list(check_bottoms)
    wrng = np.random.RandomState(seed + 1)
    if top_weights is None:
        top_weights = [wrng.uniform(0.5, 1.5, t.shape) for t in tops]
    weights = [xp.asarray(w, layer.dtype) for w in top_weights]

    def objective():
        set_random_seed(seed)
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
        return sum(float((t.data * w).sum()) for t, w in zip(tops, weights))

    # analytic
    objective()
    for t, w in zip(tops, weights):
        t.diff = w.copy()
    for p in layer.blobs:
        p.diff = xp.zeros(p.shape, layer.dtype)
    propagate = [i in check_bottoms for i in range(len(bottoms))]
    set_random_seed(seed)
    layer.backward(tops, propagate, bottoms)
    targets = [("bottom %d" % i, bottoms[i], bottoms[i].diff.copy()) for i in check_bottoms]
    if check_params:
        targets += [("param %d" % k, p, p.diff.copy()) for k, p in enumerate(layer.blobs)]

    for label, blob, analytic in targets:
        analytic = np.asarray(analytic.get() if hasattr(analytic, "get") else analytic)
        numeric = np.zeros(blob.shape)
        flat = blob.data.reshape(-1)
        for idx in range(flat.size):
            orig = float(flat[idx])
            flat[idx] = orig + eps
            plus = objective()
            flat[idx] = orig - eps
            minus = objective()
            flat[idx] = orig
            numeric.reshape(-1)[idx] = (plus - minus) / (2 * eps)
        bad = ~np.isclose(analytic, numeric, rtol=rtol, atol=atol)
        if bad.any():
            first = np.unravel_index(np.argmax(bad), numeric.shape)
            raise AssertionError(
                "%s (%s) gradient of %s mismatches at %d of %d elements; first at %s: analytic %.8g, numeric %.8g"
                % (layer.name, layer.type, label, int(bad.sum()), bad.size, first,
                   analytic[first], numeric[first]))
    return layer
