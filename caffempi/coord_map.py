"""pycaffe's ``caffe.coord_map``: how the spatial coordinates of one NetSpec
top relate to another's, and the Crop layer that aligns them (the offsets of
BVLC's FCN scripts: ``n.score = crop(n.upscore, n.data)``).

A map is a triple ``(axis, scale, shift)``: a point at coordinate ``x`` of
the source, along each axis after ``axis``, lies at ``scale * x + shift`` in
the destination.  ``scale`` and ``shift`` are NumPy arrays with one entry per
spatial axis, or one entry for all of them; ``(None, 1, 0)`` is the identity,
which holds on any axis.  A layer's map (:func:`coord_map`) takes its first
bottom to its tops, placing each output at the centre of its window:

- Convolution, Im2col, Pooling: scale ``1/stride``, shift
  ``(pad - (extent - 1)/2) / stride``, extent being the dilated kernel;
- Deconvolution: the inverse, scale ``stride``, shift ``(extent - 1)/2 - pad``;
- Crop: scale 1, shift ``-offset``, on the axes from ``crop_param.axis``;
- elementwise layers (:data:`PASS_THROUGH_LAYERS`): the identity;
- any other layer (InnerProduct, global pooling, ...): none
  (:class:`UndefinedMapException`), which ends a walk through the net.

:func:`coord_map_from_to` walks back from both tops to a top they share and
chains the maps; :func:`crop` turns the result into an ``L.Crop``.
"""
import numpy as np

from .common import CaffeError
from .net_spec import NotATopError, Top, layers as L
from .proto import caffe_pb2

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Clip", "Dropout", "Eltwise", "ELU", "Exp",
                       "Log", "LRN", "MVN", "Power", "PReLU", "ReLU", "Scale", "Sigmoid", "Split", "Swish",
                       "TanH", "Threshold"]
WINDOW_LAYERS = ("Convolution", "Im2col", "Pooling")       # output = window over the input
IDENTITY = (None, 1, 0)


class UndefinedMapException(CaffeError):
    """The layer has no coordinate map (it does not keep spatial layout)."""


class AxisMismatchException(CaffeError):
    """Two maps to be chained start their coordinates at different axes."""


class UnconnectedTopsError(CaffeError, RuntimeError):
    """No top from which both tops are reached through mappable layers
    (pycaffe raises a RuntimeError)."""


class CropError(CaffeError, AssertionError):
    """The map between the tops is no crop: a scale other than 1, or an
    offset that is negative or fractional (pycaffe's asserts)."""


def layer_param(fn):
    """The LayerParameter of NetSpec layer ``fn`` (its type and parameters;
    no names), so that the proto's defaults apply."""
    layer = caffe_pb2.LayerParameter(type=fn.type_name)
    fn.fill_params(layer, "coord_map: %s layer" % fn.type_name)
    return layer


def per_axis(message, repeated, pair, default):
    """A geometry field as an int array: ``<pair>_h, <pair>_w`` where the
    legacy 2-D fields are set, else the repeated/single field, else ``default``."""
    h, w = pair + "_h", pair + "_w"
    if message.HasField(h) or message.HasField(w):
        return np.array([getattr(message, h), getattr(message, w)])
    value = getattr(message, repeated)
    if hasattr(value, "__len__"):
        return np.array(list(value) or [default], ndmin=1)
    return np.array([value if message.HasField(repeated) else default])


def conv_params(fn):
    """``(axis, stride, extent, pad)`` of a Convolution, Deconvolution, Im2col
    or Pooling layer: ``extent`` is the kernel's span, ``(kernel - 1) *
    dilation + 1``; the arrays have one entry per spatial axis or one for all."""
    lp = layer_param(fn)
    if fn.type_name == "Pooling":
        p = lp.pooling_param
        if p.global_pooling:
            raise UndefinedMapException("coord_map: a global Pooling layer has no coordinate map")
        axis, dilation = 1, np.array([1])
    else:
        p = lp.convolution_param
        axis, dilation = p.axis, np.array(list(p.dilation) or [1])
    kernel = per_axis(p, "kernel_size", "kernel", 0)
    if not kernel.all():
        raise CaffeError("coord_map: %s layer without a kernel size" % fn.type_name)
    return (axis, per_axis(p, "stride", "stride", 1), (kernel - 1) * dilation + 1, per_axis(p, "pad", "pad", 0))


def crop_params(fn):
    """``(axis, offset)`` of a Crop layer (proto defaults: axis 2, offset 0)."""
    p = layer_param(fn).crop_param
    return p.axis, np.array(list(p.offset) or [0])


def coord_map(fn):
    """The map ``(axis, scale, shift)`` from the first bottom of NetSpec layer
    ``fn`` to its tops; :class:`UndefinedMapException` for a layer without one."""
    kind = fn.type_name
    if kind in WINDOW_LAYERS or kind == "Deconvolution":
        axis, stride, extent, pad = conv_params(fn)
        centre = (extent - 1) / 2.0                 # window start -> window centre
        if kind == "Deconvolution":
            return axis, stride.astype(float), centre - pad
        return axis, 1.0 / stride, (pad - centre) / stride
    if kind == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset.astype(float)
    if kind in PASS_THROUGH_LAYERS:
        return IDENTITY
    raise UndefinedMapException("coord_map: no coordinate map for a %s layer" % kind)


def compose(base_map, next_map):
    """``base_map`` after ``next_map``: a point goes through ``next_map``
    first, then ``base_map`` (scales multiply; the inner shift is scaled)."""
    axis1, scale1, shift1 = base_map
    axis2, scale2, shift2 = next_map
    if axis1 is not None and axis2 is not None and axis1 != axis2:
        raise AxisMismatchException("coord_map: cannot chain a map on the axes after %s with one on the "
                                    "axes after %s" % (axis2, axis1))
    return (axis2 if axis1 is None else axis1), scale1 * scale2, scale1 * shift2 + shift1


def inverse(coord_map):
    """The map back: ``x = (y - shift) / scale``."""
    axis, scale, shift = coord_map
    return axis, 1.0 / scale, -shift / scale


def mapped_bottoms(top):
    """The bottoms whose coordinates map to ``top``'s: all of them, except a
    Crop's second (the reference it only takes its size from)."""
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def maps_to(top):
    """``{ancestor: map from the ancestor's coordinates to top's}`` for top
    and each top above it reached through mappable layers, nearest first."""
    maps, queue = {top: IDENTITY}, [top]
    for current in queue:                          # breadth first: the list grows as it is read
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in mapped_bottoms(current):
            if bottom not in maps:
                maps[bottom] = compose(maps[current], step)
                queue.append(bottom)
    return maps


def coord_map_from_to(top_from, top_to):
    """The map ``(axis, scale, shift)`` from ``top_from``'s coordinates to
    ``top_to``'s, through the nearest top above ``top_to`` that ``top_from``
    also comes from; :class:`UnconnectedTopsError` (a RuntimeError) if none."""
    for name, top in (("top_from", top_from), ("top_to", top_to)):
        if not isinstance(top, Top):
            raise NotATopError("coord_map_from_to: %s is not a Top (type is %s)" % (name, type(top)))
    from_maps = maps_to(top_from)
    for common, to_map in maps_to(top_to).items():
        if common in from_maps:
            return compose(to_map, inverse(from_maps[common]))
    raise UnconnectedTopsError("coord_map_from_to: no top from which both tops are reached through layers "
                               "that keep spatial coordinates (%s, %s)" % (top_from.fn.type_name,
                                                                          top_to.fn.type_name))


def crop(top_from, top_to):
    """``L.Crop(top_from, top_to)`` with the axis and offsets that cut
    ``top_from`` to ``top_to``'s region; :class:`CropError` (an
    AssertionError, as pycaffe's asserts) where no crop does."""
    axis, scale, shift = coord_map_from_to(top_from, top_to)
    if not np.all(np.asarray(scale) == 1):
        raise CropError("crop: the tops' scales differ (scale %s); a crop cannot align them" % (scale,))
    offset = -np.asarray(shift, dtype=float).reshape(-1)
    if np.any(offset < 0):
        raise CropError("crop: top_to starts before top_from (offset %s); cannot crop a negative offset"
                        % (offset,))
    if np.any(np.round(offset) != offset):
        raise CropError("crop: the offset %s is not a whole number of pixels" % (offset,))
    return L.Crop(top_from, top_to, crop_param=dict(axis=2 if axis is None else axis + 1,
                                                   offset=[int(o) for o in np.round(offset)]))
