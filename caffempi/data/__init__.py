"""Data input: Caffe Datum records, LMDB and LevelDB access, the DataTransformer and the
threaded per-rank batch reader used by the data layers."""
from .datum import array_to_datum, datum_to_array, decode_image, parse_datum  # noqa: F401
from .transformer import DataTransformer  # noqa: F401
