"""Reading, upgrading and writing Caffe protobuf files.

* ``read_net_param`` / ``read_solver_param``: text prototxt (or a binary
  NetParameter such as a .caffemodel), followed by Caffe's format upgrades
  (the logic of BVLC's ``src/caffe/util/upgrade_proto.cpp``).
* ``read_binary_proto`` / ``write_binary_proto_atomic``: binary messages.
* ``blob_proto_to_array`` / ``array_to_blob_proto``: BlobProto <-> numpy.

Every error is a :class:`ProtoError` with a one-line message naming the file.
"""
from __future__ import annotations

import os

import numpy as np
from google.protobuf import message as _pb_message
from google.protobuf import text_format

from ..common import CaffeError
from ..proto import caffe_pb2
from . import nvcaffe
from .atomic import write_bytes_atomic

__all__ = [
    "ProtoError",
    "read_net_param",
    "read_solver_param",
    "read_binary_proto",
    "write_binary_proto_atomic",
    "upgrade_net_param",
    "upgrade_solver_param",
    "blob_proto_to_array",
    "array_to_blob_proto",
    "blob_proto_shape",
    "is_legacy_blob",
    "legacy_shape_matches",
]


class ProtoError(CaffeError):
    """A Caffe protobuf file could not be read, parsed, upgraded or written."""


# --------------------------------------------------------------------------
# low-level file helpers

def _read_bytes(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ProtoError("cannot read %s file %s: %s"
                         % (what, path, e.strerror or e)) from None


def _looks_binary(text):
    """True when decoded text holds control characters a prototxt never has."""
    for ch in text:
        o = ord(ch)
        if o < 32 and ch not in "\t\n\r\f\v":
            return True
    return False


def _format_parse_error(path, err):
    line, col = err.GetLine(), err.GetColumn()
    msg = str(err)
    if line is not None:
        # protobuf prefixes "line:col : " (or "line : ") to the message.
        for prefix in ("%s:%s : " % (line, col), "%s : " % line):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
                break
        loc = "%s:%s" % (path, line) + (":%s" % col if col is not None else "")
    else:
        loc = str(path)
    msg = " ".join(msg.split())  # keep it on one line
    return ProtoError("%s: %s" % (loc, msg))


def _parse_text_or_binary(path, msg_cls, what, allow_binary):
    data = _read_bytes(path, what)
    msg = msg_cls()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    text_error = None
    if text is not None:
        try:
            # Caffe reads with TextFormat::Parse, which (unlike Merge) rejects
            # a non-repeated field given twice; Parse matches that.
            text_format.Parse(text, msg)
            return msg
        except text_format.ParseError as e:
            text_error = e
        if not allow_binary or not _looks_binary(text):
            raise _format_parse_error(path, text_error) from None
    if not allow_binary:
        raise ProtoError("%s: %s file is not UTF-8 text" % (path, what))
    msg = msg_cls()
    try:
        msg.ParseFromString(data)
    except _pb_message.DecodeError as e:
        if text_error is not None:
            raise _format_parse_error(path, text_error) from None
        raise ProtoError("%s: not a text or binary %s: %s"
                         % (path, msg_cls.DESCRIPTOR.full_name, e)) from None
    return msg


# --------------------------------------------------------------------------
# public readers / writers

def read_net_param(path):
    """Read a NetParameter from a prototxt or a binary file and upgrade it."""
    path = os.fspath(path)
    net = _parse_text_or_binary(path, caffe_pb2.NetParameter, "net", True)
    upgrade_net_param(net, path)
    return net


def read_solver_param(path):
    """Read a text SolverParameter and upgrade legacy ``solver_type``."""
    path = os.fspath(path)
    solver = read_text_proto(path, caffe_pb2.SolverParameter, "solver")
    upgrade_solver_param(solver, path)
    return solver


def read_text_proto(path, msg_cls, what):
    """Parse a text protobuf file (no upgrade); errors name file and line."""
    return _parse_text_or_binary(os.fspath(path), msg_cls, what, False)


def read_binary_proto(path, msg_cls):
    """Parse a binary protobuf file into a new ``msg_cls`` instance."""
    path = os.fspath(path)
    data = _read_bytes(path, "binary proto")
    msg = msg_cls()
    try:
        msg.ParseFromString(data)
    except _pb_message.DecodeError as e:
        raise ProtoError("%s: not a valid binary %s: %s"
                         % (path, msg_cls.DESCRIPTOR.full_name, e)) from None
    return msg


def write_binary_proto_atomic(path, msg):
    """Serialize ``msg`` to ``path`` atomically (:mod:`caffempi.io.atomic`)."""
    try:
        payload = msg.SerializeToString()
    except _pb_message.EncodeError as e:
        raise ProtoError("cannot serialize %s for %s: %s"
                         % (msg.DESCRIPTOR.full_name, path, e)) from None
    _write(path, payload)


def write_text_proto_atomic(path, msg):
    """``msg`` in protobuf text format (a .prototxt) to ``path`` atomically."""
    _write(path, text_format.MessageToString(msg).encode("utf-8"))


def _write(path, payload):
    try:
        write_bytes_atomic(path, payload)
    except OSError as e:
        raise ProtoError("cannot write %s: %s" % (os.fspath(path), e.strerror or e)) from None


# --------------------------------------------------------------------------
# net upgrades (BVLC upgrade_proto.cpp)

_V1 = caffe_pb2.V1LayerParameter

_V1_TYPE_NAMES = {
    _V1.NONE: "",
    _V1.ABSVAL: "AbsVal",
    _V1.ACCURACY: "Accuracy",
    _V1.ARGMAX: "ArgMax",
    _V1.BNLL: "BNLL",
    _V1.CONCAT: "Concat",
    _V1.CONTRASTIVE_LOSS: "ContrastiveLoss",
    _V1.CONVOLUTION: "Convolution",
    _V1.DECONVOLUTION: "Deconvolution",
    _V1.DATA: "Data",
    _V1.DROPOUT: "Dropout",
    _V1.DUMMY_DATA: "DummyData",
    _V1.EUCLIDEAN_LOSS: "EuclideanLoss",
    _V1.ELTWISE: "Eltwise",
    _V1.EXP: "Exp",
    _V1.FLATTEN: "Flatten",
    _V1.HDF5_DATA: "HDF5Data",
    _V1.HDF5_OUTPUT: "HDF5Output",
    _V1.HINGE_LOSS: "HingeLoss",
    _V1.IM2COL: "Im2col",
    _V1.IMAGE_DATA: "ImageData",
    _V1.INFOGAIN_LOSS: "InfogainLoss",
    _V1.INNER_PRODUCT: "InnerProduct",
    _V1.LRN: "LRN",
    _V1.MEMORY_DATA: "MemoryData",
    _V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss",
    _V1.MVN: "MVN",
    _V1.POOLING: "Pooling",
    _V1.POWER: "Power",
    _V1.RELU: "ReLU",
    _V1.SIGMOID: "Sigmoid",
    _V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss",
    _V1.SILENCE: "Silence",
    _V1.SOFTMAX: "Softmax",
    _V1.SOFTMAX_LOSS: "SoftmaxWithLoss",
    _V1.SPLIT: "Split",
    _V1.SLICE: "Slice",
    _V1.TANH: "TanH",
    _V1.WINDOW_DATA: "WindowData",
    _V1.THRESHOLD: "Threshold",
}

# Every V1 "*_param" message field has a LayerParameter field of the same name.
_V1_PARAM_FIELDS = tuple(
    f.name for f in _V1.DESCRIPTOR.fields
    if f.name.endswith("_param") and f.message_type is not None)

# V1 data layers whose legacy transformation fields move to transform_param.
_V1_DATA_LAYERS = (
    (_V1.DATA, "data_param"),
    (_V1.IMAGE_DATA, "image_data_param"),
    (_V1.WINDOW_DATA, "window_data_param"),
)
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def upgrade_net_param(net_param, source_name="<NetParameter>"):
    """Upgrade a NetParameter in place as Caffe's UpgradeNetAsNeeded does.

    V1 ``layers`` become ``layer`` entries, legacy data-transformation fields
    move to ``transform_param``, net-level ``input`` declarations become one
    ``Input`` layer, and old-style BatchNorm param specs are dropped.  V0 nets
    are rejected; NVCaffe fields without effect here are warned about once.
    Returns ``net_param``.
    """
    if any(l.HasField("layer") for l in net_param.layers):
        raise ProtoError("%s: V0 net format is not supported" % source_name)
    if _net_needs_data_upgrade(net_param):
        _upgrade_net_data_transformation(net_param)
    if len(net_param.layers) > 0:
        _upgrade_v1_net(net_param, source_name)
    if len(net_param.input) > 0:
        _upgrade_net_input(net_param, source_name)
    if _net_needs_batch_norm_upgrade(net_param):
        for lp in net_param.layer:
            if lp.type == "BatchNorm" and len(lp.param) == 3:
                del lp.param[:]
    nvcaffe.warn_ignored_fields(net_param, source_name)
    return net_param


def _net_needs_data_upgrade(net_param):
    for v1 in net_param.layers:
        for layer_type, field in _V1_DATA_LAYERS:
            if v1.type == layer_type:
                sub = getattr(v1, field)
                if any(sub.HasField(name) for name in _TRANSFORM_FIELDS):
                    return True
    return False


def _upgrade_net_data_transformation(net_param):
    for v1 in net_param.layers:
        for layer_type, field in _V1_DATA_LAYERS:
            if v1.type != layer_type:
                continue
            sub = getattr(v1, field)
            for name in _TRANSFORM_FIELDS:
                if sub.HasField(name):
                    setattr(v1.transform_param, name, getattr(sub, name))
                    sub.ClearField(name)


def _upgrade_v1_net(net_param, source_name):
    if len(net_param.layer) > 0:
        raise ProtoError(
            "%s: refusing to upgrade a net that has both 'layer' and 'layers' "
            "fields; use only 'layer { type: \"...\" }'" % source_name)
    upgraded = []
    for i, v1 in enumerate(net_param.layers):
        lp = caffe_pb2.LayerParameter()
        _upgrade_v1_layer(v1, lp, source_name, i)
        upgraded.append(lp)
    net_param.ClearField("layers")
    net_param.layer.extend(upgraded)


def _ensure_params(lp, n):
    while len(lp.param) < n:
        lp.param.add()


def _upgrade_v1_layer(v1, lp, source_name, index):
    lp.bottom.extend(v1.bottom)
    lp.top.extend(v1.top)
    if v1.HasField("name"):
        lp.name = v1.name
    for rule in v1.include:
        lp.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        lp.exclude.add().CopyFrom(rule)
    if v1.HasField("type"):
        try:
            lp.type = _V1_TYPE_NAMES[v1.type]
        except KeyError:
            raise ProtoError("%s: layer %d ('%s'): unknown V1 layer type %d"
                             % (source_name, index, v1.name, v1.type)) from None
    for blob in v1.blobs:
        lp.blobs.add().CopyFrom(blob)
    for i, name in enumerate(v1.param):
        _ensure_params(lp, i + 1)
        lp.param[i].name = name
    for i, mode in enumerate(v1.blob_share_mode):
        _ensure_params(lp, i + 1)
        if mode == _V1.STRICT:
            lp.param[i].share_mode = caffe_pb2.ParamSpec.STRICT
        elif mode == _V1.PERMISSIVE:
            lp.param[i].share_mode = caffe_pb2.ParamSpec.PERMISSIVE
        else:
            raise ProtoError("%s: layer %d ('%s'): unknown blob_share_mode %d"
                             % (source_name, index, v1.name, mode))
    for i, lr in enumerate(v1.blobs_lr):
        _ensure_params(lp, i + 1)
        lp.param[i].lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        _ensure_params(lp, i + 1)
        lp.param[i].decay_mult = decay
    lp.loss_weight.extend(v1.loss_weight)
    for field in _V1_PARAM_FIELDS:
        if v1.HasField(field):
            getattr(lp, field).CopyFrom(getattr(v1, field))


def _upgrade_net_input(net_param, source_name):
    """Net-level ``input`` fields -> one Input layer named "input", first."""
    has_shape = len(net_param.input_shape) > 0
    has_dim = len(net_param.input_dim) > 0
    n = len(net_param.input)
    if has_shape or has_dim:
        if has_shape and len(net_param.input_shape) < n:
            raise ProtoError("%s: %d inputs but only %d input_shape entries"
                             % (source_name, n, len(net_param.input_shape)))
        if not has_shape and len(net_param.input_dim) < 4 * n:
            raise ProtoError("%s: %d inputs need %d input_dim values, got %d"
                             % (source_name, n, 4 * n, len(net_param.input_dim)))
        lp = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, name in enumerate(net_param.input):
            lp.top.append(name)
            shape = lp.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net_param.input_shape[i])
            else:
                shape.dim.extend(net_param.input_dim[4 * i:4 * i + 4])
        layers = [caffe_pb2.LayerParameter()]
        layers[0].CopyFrom(lp)
        for existing in net_param.layer:
            copy = caffe_pb2.LayerParameter()
            copy.CopyFrom(existing)
            layers.append(copy)
        net_param.ClearField("layer")
        net_param.layer.extend(layers)
    # Without shapes (old caffemodels) the input names are simply dropped.
    net_param.ClearField("input")
    net_param.ClearField("input_shape")
    net_param.ClearField("input_dim")


def _net_needs_batch_norm_upgrade(net_param):
    return any(lp.type == "BatchNorm" and len(lp.param) == 3
               for lp in net_param.layer)


# --------------------------------------------------------------------------
# solver upgrade

_SOLVER_TYPE_NAMES = {
    caffe_pb2.SolverParameter.SGD: "SGD",
    caffe_pb2.SolverParameter.NESTEROV: "Nesterov",
    caffe_pb2.SolverParameter.ADAGRAD: "AdaGrad",
    caffe_pb2.SolverParameter.RMSPROP: "RMSProp",
    caffe_pb2.SolverParameter.ADADELTA: "AdaDelta",
    caffe_pb2.SolverParameter.ADAM: "Adam",
}


def upgrade_solver_param(solver_param, source_name="<SolverParameter>"):
    """Legacy ``solver_type`` enum -> ``type`` string (UpgradeSolverType);
    NVCaffe fields without effect here are warned about once."""
    if solver_param.HasField("solver_type"):
        if solver_param.HasField("type"):
            raise ProtoError(
                "%s: solver_type (enum) and type (string) cannot both be "
                "specified" % source_name)
        try:
            name = _SOLVER_TYPE_NAMES[solver_param.solver_type]
        except KeyError:
            raise ProtoError("%s: unknown solver_type %d"
                             % (source_name, solver_param.solver_type)) from None
        solver_param.type = name
        solver_param.ClearField("solver_type")
    nvcaffe.warn_ignored_fields(solver_param, source_name)
    return solver_param


# --------------------------------------------------------------------------
# BlobProto <-> numpy

_LEGACY_FIELDS = ("num", "channels", "height", "width")


def is_legacy_blob(blob_proto):
    """True when the blob uses the deprecated num/channels/height/width."""
    return any(blob_proto.HasField(f) for f in _LEGACY_FIELDS)


def blob_proto_shape(blob_proto):
    """Shape stored in a BlobProto, as Caffe's Blob::FromProto reads it.

    Legacy blobs give the 4-tuple (num, channels, height, width); otherwise
    the ``shape`` dims (an empty tuple is a scalar).
    """
    if is_legacy_blob(blob_proto):
        return tuple(int(getattr(blob_proto, f)) for f in _LEGACY_FIELDS)
    return tuple(int(d) for d in blob_proto.shape.dim)


def legacy_shape_matches(blob_proto, shape):
    """Caffe's Blob::ShapeEquals for a target ``shape``.

    For a legacy 4-d blob, the target (at most 4 axes) is compared after
    padding it with leading 1s, so e.g. an InnerProduct weight stored as
    (1, 1, N, K) matches (N, K) and a bias (1, 1, 1, N) matches (N,).
    Non-legacy blobs must match exactly.
    """
    shape = tuple(int(d) for d in shape)
    if is_legacy_blob(blob_proto):
        if len(shape) > 4:
            return False
        return (1,) * (4 - len(shape)) + shape == blob_proto_shape(blob_proto)
    return shape == blob_proto_shape(blob_proto)


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _repeated_numeric(blob_proto, attr, dtype):
    # upb's repeated scalar containers convert to numpy in bulk.
    container = getattr(blob_proto, attr)
    if len(container) == 0:
        return np.zeros(0, dtype)
    return np.asarray(container, dtype)


# NVCaffe's raw_data / raw_diff: little-endian values of these types.
_RAW_DTYPES = {caffe_pb2.FLOAT16: np.dtype("<f2"), caffe_pb2.FLOAT: np.dtype("<f4"),
               caffe_pb2.DOUBLE: np.dtype("<f8")}


def _raw_values(blob_proto, what, shape, count):
    """The values of NVCaffe's ``raw_<what>`` bytes (``raw_<what>_type``)."""
    raw, type_field = "raw_" + what, "raw_%s_type" % what
    if not blob_proto.HasField(type_field):
        raise ProtoError("blob has %s but no %s" % (raw, type_field))
    raw_type = getattr(blob_proto, type_field)
    dtype = _RAW_DTYPES.get(raw_type)
    if dtype is None:
        raise ProtoError("blob %s has type %s; only FLOAT16, FLOAT and DOUBLE are supported"
                         % (raw, caffe_pb2.Type.Name(raw_type)))
    payload = getattr(blob_proto, raw)
    if len(payload) != count * dtype.itemsize:
        raise ProtoError("blob %s holds %d bytes but shape %s needs %d %s values (%d bytes)"
                         % (raw, len(payload), shape, count, caffe_pb2.Type.Name(raw_type),
                            count * dtype.itemsize))
    return np.frombuffer(payload, dtype).astype(np.float32)     # a writable copy


def blob_proto_to_array(blob_proto, diff=False):
    """BlobProto -> float32 numpy array shaped as ``blob_proto_shape``.

    The values come, in NVCaffe's order of preference, from ``double_data``,
    ``data`` or NVCaffe's ``raw_data`` (FLOAT16, FLOAT or DOUBLE bytes, as its
    snapshots store them), or the ``diff`` counterparts; float16 and double
    become float32, the one type the nets compute in.  A count mismatch or an
    unsupported raw type raises ProtoError.
    """
    shape = blob_proto_shape(blob_proto)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    what = "diff" if diff else "data"
    if len(getattr(blob_proto, "double_" + what)) > 0:
        flat = _repeated_numeric(blob_proto, "double_" + what, np.float64)
    elif len(getattr(blob_proto, what)) == 0 and blob_proto.HasField("raw_" + what):
        flat = _raw_values(blob_proto, what, shape, count)
    else:
        flat = _repeated_numeric(blob_proto, what, np.float32)
    if flat.size != count:
        raise ProtoError("blob %s has %d values but shape %s needs %d"
                         % (what, flat.size, shape, count))
    return flat.astype(np.float32, copy=False).reshape(shape)


def _packed_floats(field_number, arr):
    payload = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    return (_varint((field_number << 3) | 2) + _varint(len(payload)) + payload)


def array_to_blob_proto(arr, blob_proto=None, diff=None):
    """Write ``arr`` (and optionally ``diff``) into ``blob_proto``.

    The blob is cleared and written in the N-d ``shape`` form with float
    ``data``/``diff``.  Returns the BlobProto (a new one if none was given).
    """
    if blob_proto is None:
        blob_proto = caffe_pb2.BlobProto()
    arr = np.asarray(arr)
    blob_proto.Clear()
    shape = caffe_pb2.BlobShape()
    shape.dim.extend(int(d) for d in arr.shape)
    shape_bytes = shape.SerializeToString()
    # Build the wire bytes directly: packed floats are copied, not converted
    # one by one, which matters for multi-million-element weights.
    parts = [_varint((7 << 3) | 2), _varint(len(shape_bytes)), shape_bytes]
    if arr.size:
        parts.append(_packed_floats(5, arr.reshape(-1)))
    if diff is not None:
        diff = np.asarray(diff)
        if diff.size != arr.size:
            raise ProtoError("blob diff has %d values but data has %d"
                             % (diff.size, arr.size))
        if diff.size:
            parts.append(_packed_floats(6, diff.reshape(-1)))
    blob_proto.MergeFromString(b"".join(parts))
    return blob_proto

