"""compute_image_mean: the mean image of an LMDB or LevelDB of Datums -> .binaryproto
(BlobProto 1×C×H×W with legacy num/channels/height/width), summed in float32
datum by datum as BVLC's tools/compute_image_mean.cpp does.

    python tools/compute_image_mean.py [--backend=lmdb] INPUT_DB [OUTPUT_FILE]
"""
import numpy as np

from ..common import CaffeError
from ..data.datum import datum_to_array, parse_datum
from ..data import db
from ..data.transformer import mean_to_blob_proto
from ..io import proto_io
from ..flags import FlagSet
from ._util import info, progress, run_tool


def compute_mean(db_path, backend="lmdb"):
    """C×H×W float32 mean of every Datum in the database."""
    source = db.open_read(db_path, backend)
    total = None
    count = 0
    try:
        for key, value in progress(source.records(), source.num, "mean"):
            where = "%s key '%s'" % (db_path, key.decode("ascii", "replace"))
            arr = datum_to_array(parse_datum(value, where), where=where)
            if total is None:
                total = np.zeros(arr.shape, np.float32)
            elif arr.shape != total.shape:
                raise CaffeError("%s: image is %s but the first image is %s"
                                 % (where, arr.shape, total.shape))
            total += arr.astype(np.float32)
            count += 1
    finally:
        db.release(source)
    info("Processed %d files.", count)
    return total / np.float32(count)


FLAGS = FlagSet("compute_image_mean", "Compute the mean_image of a set of images given by a leveldb/lmdb")
FLAGS.argument("INPUT_DB", "the database of Datums")
FLAGS.argument("OUTPUT_FILE", "the .binaryproto to write the mean to (none: only the per-channel means "
               "are logged)", default=None)
FLAGS.define("backend", "lmdb", "The backend {leveldb, lmdb} containing the images")


def _main(flags, input_db, output_file):
    mean = compute_mean(input_db, flags.backend)
    if output_file:
        info("Write to %s", output_file)
        proto_io.write_binary_proto_atomic(output_file, mean_to_blob_proto(mean))
    dim = mean.shape[1] * mean.shape[2]
    for c in range(mean.shape[0]):
        info("mean_value channel [%d]: %g", c, float(mean[c].astype(np.float64).sum()) / dim)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
