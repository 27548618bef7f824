"""pycaffe's NetSpec: nets written in Python that become a NetParameter.

``L = caffempi.layers`` makes layers (``L.Convolution(bottom, kernel_size=5,
num_output=20, weight_filler=dict(type='xavier'))`` is a :class:`Top`), ``P =
caffempi.params`` gives the proto's enum values (``P.Pooling.MAX``), and a
:class:`NetSpec` names tops by attribute (``n.conv1 = ...``) and serialises
every layer they need with ``n.to_proto()``.

Keyword arguments, as pycaffe routes them: ``ntop`` (number of tops; 0 gives
the layer itself, to assign to a NetSpec name) and ``in_place`` (tops are the
bottoms); names ending in ``param`` (``param``, ``transform_param``,
``python_param``, ...) are LayerParameter fields; any other name is a field of
the layer type's own ``<type>_param`` when it has one, else a LayerParameter
field (``loss_weight``, ``include``, ``propagate_down``, ``name``).  Values:
lists fill repeated fields (a single value is a one-element list), dicts fill
messages, enum fields take numbers or names (``pool='MAX'``).

Names as pycaffe gives them: a top is its NetSpec name, or the layer type and
a per-type counter (``Convolution1``); a layer is named after its first top
(after its own NetSpec name when it has no tops).
"""
from collections import Counter, OrderedDict

from google.protobuf import message as pb_message

from .common import CaffeError
from .proto import caffe_pb2
from .proto.fields import is_repeated


def param_name_dict():
    """Layer type -> the prefix of its ``<prefix>_param`` field, from the
    LayerParameter descriptor (``ConvolutionParameter convolution_param`` gives
    Convolution -> convolution), as pycaffe derives it; plus the types whose
    parameter message is named after another type (Caffe's layer factory)."""
    names = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            names[field.message_type.name[:-len("Parameter")]] = field.name[:-len("_param")]
    names.update(Deconvolution="convolution", Im2col="convolution", LSTM="recurrent", RNN="recurrent")
    return names


PARAM_NAMES = param_name_dict()
LAYER_FIELDS = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name


def enum_value(field, value, where):
    """An enum field's number for ``value`` (a number or a value's name)."""
    if not isinstance(value, str):
        return value
    found = field.enum_type.values_by_name.get(value)
    if found is None:
        raise CaffeError("%s: '%s' is no value of %s (%s)" % (
            where, value, field.enum_type.name, ", ".join(field.enum_type.values_by_name)))
    return found.number


def assign_proto(proto, name, value, where="NetSpec"):
    """Set field ``name`` of message ``proto`` from a Python value: lists (or
    tuples) fill repeated fields, a single value is a one-element list, dicts
    (or messages) fill messages, enum fields take names or numbers."""
    field = proto.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise CaffeError("%s: %s has no field '%s'" % (where, proto.DESCRIPTOR.name, name))
    where = "%s: %s.%s" % (where, proto.DESCRIPTOR.name, name)
    is_message = field.message_type is not None
    if is_repeated(field):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        container = getattr(proto, name)
        for item in items:
            if is_message:
                fill_message(container.add(), item, where)
            else:
                put_scalar(container.append, field, item, where)
    elif is_message:
        fill_message(getattr(proto, name), value, where)
    else:
        put_scalar(lambda v: setattr(proto, name, v), field, value, where)


def fill_message(msg, value, where):
    if isinstance(value, pb_message.Message):
        try:
            msg.CopyFrom(value)
        except TypeError:
            raise CaffeError("%s: expects a %s, got a %s" % (
                where, msg.DESCRIPTOR.name, value.DESCRIPTOR.name)) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            assign_proto(msg, key, item, where)
    else:
        raise CaffeError("%s: a %s is given as a dict, got %r" % (where, msg.DESCRIPTOR.name, value))


def put_scalar(put, field, value, where):
    """``put(value)`` for a scalar field (enum names as numbers); protobuf's
    refusal of a value becomes a CaffeError naming the field."""
    if field.enum_type is not None:
        value = enum_value(field, value, where)
    try:
        put(value)
    except (TypeError, ValueError) as e:
        raise CaffeError("%s: cannot take %r (%s)" % (where, value, e)) from None


class NotATopError(CaffeError, TypeError):
    """A layer's input is not a Top (pycaffe raises a TypeError)."""


class Top:
    """One output blob of a layer: top ``n`` of ``fn``."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """A NetParameter of every layer this top needs."""
        return to_proto(self)


class Function:
    """One layer: its type, its input Tops and its keyword parameters."""

    def __init__(self, type_name, inputs, params):
        for i, top in enumerate(inputs):
            if not isinstance(top, Top):
                raise NotATopError("%s input %d is not a Top (type is %s)" % (type_name, i, type(top)))
        self.type_name = type_name
        self.inputs = tuple(inputs)
        params = dict(params)
        self.ntop = params.pop("ntop", 1)
        self.in_place = params.pop("in_place", False)
        if not isinstance(self.ntop, int) or self.ntop < 0:
            raise CaffeError("%s: ntop must be a non-negative int, got %r" % (type_name, self.ntop))
        self.params = params
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def top_name(self, top, names, autonames):
        if top not in names:
            autonames[self.type_name] += 1
            names[top] = "%s%d" % (self.type_name, autonames[self.type_name])
        return names[top]

    def layer_name(self, names, autonames):
        if self not in names:
            if self.ntop > 0:
                names[self] = self.top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = "%s%d" % (self.type_name, autonames[self.type_name])
        return names[self]

    def add_to(self, layers, names, autonames):
        """Add the LayerParameters of this layer and of its inputs (first) to
        ``layers`` (an OrderedDict Function -> LayerParameter)."""
        if self in layers:
            return
        bottoms = []
        for top in self.inputs:
            top.fn.add_to(layers, names, autonames)
            bottoms.append(layers[top.fn].top[top.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottoms)
        if self.in_place:
            layer.top.extend(bottoms)
        else:
            layer.top.extend(self.top_name(top, names, autonames) for top in self.tops)
        layer.name = self.layer_name(names, autonames)
        self.fill_params(layer, "NetSpec layer '%s' (%s)" % (layer.name, self.type_name))
        layers[self] = layer

    def fill_params(self, layer, where):
        """Set the keyword parameters on LayerParameter ``layer``, routed as
        pycaffe routes them (the module's docstring)."""
        own = PARAM_NAMES.get(self.type_name)
        own_fields = LAYER_FIELDS[own + "_param"].message_type.fields_by_name if own else {}
        for key, value in self.params.items():
            if not key.endswith("param") and key in own_fields:
                assign_proto(getattr(layer, own + "_param"), key, value, where)
            elif key in LAYER_FIELDS:
                assign_proto(layer, key, value, where)
            else:
                raise CaffeError("%s: no field '%s' in %sLayerParameter" % (
                    where, key, "%s_param or " % own if own else ""))


def to_proto(*tops):
    """A NetParameter of every layer the given Tops need (auto-named)."""
    layers, names, autonames = OrderedDict(), {}, Counter()
    for top in tops:
        top.fn.add_to(layers, names, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class NetSpec:
    """Tops (or top-less layers) assigned as attributes (``n.conv1 = ...``, or
    ``n['conv1'] = ...``); ``to_proto()`` gives the layers they need, named
    after the assignments, in assignment order."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        if isinstance(value, tuple):
            raise CaffeError("NetSpec: '%s' is given %d tops; name each of them "
                             "(n.a, n.b = L.X(..., ntop=2))" % (name, len(value)))
        if not isinstance(value, (Top, Function)):
            raise NotATopError("NetSpec: '%s' must be a Top or a layer with ntop=0 (type is %s)"
                               % (name, type(value)))
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError("NetSpec has no top '%s'" % name) from None

    def __setitem__(self, key, value):
        self.__setattr__(key, value)

    def __getitem__(self, key):
        return self.tops[key]

    def to_proto(self):
        names = {value: name for name, value in self.tops.items()}
        layers, autonames = OrderedDict(), Counter()
        for value in self.tops.values():
            (value if isinstance(value, Function) else value.fn).add_to(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class Layers:
    """``L.<Type>(*bottoms, **params)``: a layer of that Caffe type; returns
    its Top, a tuple of Tops (``ntop`` > 1) or the layer itself (``ntop=0``)."""

    def __getattr__(self, type_name):
        if type_name.startswith("_"):
            raise AttributeError(type_name)

        def layer(*bottoms, **params):
            fn = Function(type_name, bottoms, params)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        layer.__name__ = type_name
        return layer


class ParamValues:
    """The enum values of one parameter message (``P.Pooling.MAX``)."""

    def __init__(self, message_class):
        self.message_class = message_class

    def __getattr__(self, name):
        if name.startswith("_"):                     # no enum value starts so; keeps copy/pickle sane
            raise AttributeError(name)
        values = self.message_class.DESCRIPTOR.enum_values_by_name
        if name not in values:
            raise AttributeError("%s has no enum value '%s' (values: %s)" % (
                self.message_class.DESCRIPTOR.name, name, ", ".join(values) or "none"))
        return values[name].number


class Parameters:
    """``P.<Type>.<VALUE>``: the enum values of ``<Type>Parameter``."""

    def __getattr__(self, type_name):
        message_class = getattr(caffe_pb2, type_name + "Parameter", None)
        if message_class is None or type_name.startswith("_"):
            raise AttributeError("caffe.proto has no message %sParameter" % type_name)
        return ParamValues(message_class)


layers = Layers()
params = Parameters()
