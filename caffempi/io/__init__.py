"""File I/O for Caffe protobuf formats (prototxt, binaryproto, caffemodel), and
pycaffe's ``caffe.io`` (Transformer, load_image, BlobProto/Datum conversions)."""
from .blobproto import (
    ConversionError,
    array_to_blobproto,
    array_to_datum,
    arraylist_to_blobprotovector_str,
    blobproto_to_array,
    blobprotovector_str_to_arraylist,
    datum_to_array,
)
from .image import Transformer, center_crop_box, load_image, oversample, resize_image
from .proto_io import (
    ProtoError,
    array_to_blob_proto,
    blob_proto_shape,
    blob_proto_to_array,
    is_legacy_blob,
    legacy_shape_matches,
    read_binary_proto,
    read_net_param,
    read_solver_param,
    upgrade_net_param,
    upgrade_solver_param,
    write_binary_proto_atomic,
)

__all__ = [
    "ConversionError",
    "Transformer",
    "array_to_blobproto",
    "array_to_datum",
    "arraylist_to_blobprotovector_str",
    "blobproto_to_array",
    "blobprotovector_str_to_arraylist",
    "center_crop_box",
    "datum_to_array",
    "load_image",
    "oversample",
    "resize_image",
    "ProtoError",
    "array_to_blob_proto",
    "blob_proto_shape",
    "blob_proto_to_array",
    "is_legacy_blob",
    "legacy_shape_matches",
    "read_binary_proto",
    "read_net_param",
    "read_solver_param",
    "upgrade_net_param",
    "upgrade_solver_param",
    "write_binary_proto_atomic",
]
