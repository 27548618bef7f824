"""pycaffe's ``caffe.io`` conversions between NumPy arrays and BlobProto /
BlobProtoVector / Datum messages, with pycaffe's shapes and dtypes.

The wire work is done by :mod:`caffempi.io.proto_io` (BlobProto) and
:mod:`caffempi.data.datum` (Datum); this module adapts them to pycaffe's
names, dtypes (float64 where pycaffe gives float64) and errors.
"""
import numpy as np

from ..common import CaffeError
from ..proto import caffe_pb2
from . import proto_io

__all__ = [
    "ConversionError",
    "array_to_blobproto",
    "blobproto_to_array",
    "arraylist_to_blobprotovector_str",
    "blobprotovector_str_to_arraylist",
    "array_to_datum",
    "datum_to_array",
]


class ConversionError(CaffeError, ValueError):
    """Bad input to a ``caffe.io`` helper: a one-line CaffeError that is also
    the ValueError pycaffe raises there, so scripts catching either keep working."""


def array_to_blobproto(arr, diff=None):
    """N-d array (and optional diff of the same size) -> BlobProto with the N-d
    ``shape`` and float ``data``/``diff``, as pycaffe writes it."""
    try:
        return proto_io.array_to_blob_proto(np.asarray(arr), diff=diff)
    except proto_io.ProtoError as e:
        raise ConversionError(str(e)) from None


def blobproto_to_array(blob, return_diff=False):
    """BlobProto -> float64 array (pycaffe's dtype) shaped by the legacy
    num/channels/height/width when any is set, else by ``shape`` (no dims: a
    0-d array, which must then hold exactly one value)."""
    try:
        return proto_io.blob_proto_to_array(blob, diff=return_diff).astype(np.float64)
    except proto_io.ProtoError as e:
        raise ConversionError(str(e)) from None


def arraylist_to_blobprotovector_str(arraylist):
    """Arrays -> serialized BlobProtoVector (one BlobProto per array)."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(arr) for arr in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(serialized):
    """Serialized BlobProtoVector -> list of float64 arrays."""
    vec = caffe_pb2.BlobProtoVector()
    try:
        vec.ParseFromString(bytes(serialized))
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ConversionError("not a serialized BlobProtoVector: %s" % e) from None
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """K x H x W array -> Datum: uint8 arrays as ``data`` bytes, others as
    ``float_data``; ``label`` is set only when given (as pycaffe, so an
    unlabelled Datum serializes without the field)."""
    from ..data import datum as datum_io     # on use: caffempi.data's __init__ imports caffempi.io
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ConversionError("array_to_datum needs a K x H x W array, got shape %s" % (arr.shape,))
    datum = datum_io.array_to_datum(arr)
    if label is None:
        datum.ClearField("label")
    else:
        datum.label = int(label)
    return datum


def datum_to_array(datum):
    """Datum -> K x H x W array: uint8 from ``data``, float64 from
    ``float_data`` (pycaffe's dtypes).  Unlike pycaffe, which cannot read
    encoded Datums, an encoded Datum (JPEG/PNG bytes) is decoded through
    Pillow into uint8 in Caffe's BGR channel order, as the Data layer sees it.
    The label is not returned (it is ``datum.label``)."""
    from ..data import datum as datum_io     # on use: caffempi.data's __init__ imports caffempi.io
    try:
        arr = datum_io.datum_to_array(datum, where="datum_to_array")
    except CaffeError as e:
        raise ConversionError(str(e)) from None
    return arr if arr.dtype == np.uint8 else arr.astype(np.float64)
