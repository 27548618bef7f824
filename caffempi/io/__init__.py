"""File I/O for Caffe protobuf formats (prototxt, binaryproto, caffemodel)."""
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
