"""A field's cardinality on every protobuf runtime setup.py allows (4.25
through 7.x): 6.31 added ``FieldDescriptor.is_repeated`` / ``is_required``
and 7.34 removed the ``label`` they replace, so no one attribute reads
them all; these read whichever the runtime has."""
from google.protobuf.descriptor import FieldDescriptor


def is_repeated(field):
    """True for a repeated field (``field``: a FieldDescriptor)."""
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def is_required(field):
    """True for a proto2 required field."""
    if hasattr(field, "is_required"):
        return field.is_required
    return field.label == FieldDescriptor.LABEL_REQUIRED
