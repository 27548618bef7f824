"""compute_image_mean: the mean image of an LMDB of Datums -> .binaryproto
(BlobProto 1×C×H×W with legacy num/channels/height/width), summed in float32
datum by datum as BVLC's tools/compute_image_mean.cpp does.

    python tools/compute_image_mean.py [--backend=lmdb] INPUT_DB [OUTPUT_FILE]
"""
import argparse

import numpy as np

from ..common import CaffeError
from ..data.datum import datum_to_array, parse_datum
from ..data.lmdb_io import check_backend, open_read, release
from ..data.transformer import mean_to_blob_proto
from ..io import proto_io
from ._util import info, progress, run_main


def compute_mean(db_path):
    """C×H×W float32 mean of every Datum in the database."""
    env, n = open_read(db_path)
    total = None
    count = 0
    try:
        with env.begin(buffers=False) as txn:
            for key, value in progress(txn.cursor(), n, "mean"):
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
        release(env)
    info("Processed %d files.", count)
    return total / np.float32(count)


def _main(argv):
    ap = argparse.ArgumentParser(prog="compute_image_mean",
                                 description="Compute the mean image of a set of images given by a leveldb/lmdb")
    ap.add_argument("input_db")
    ap.add_argument("output_file", nargs="?")
    ap.add_argument("--backend", default="lmdb")
    a = ap.parse_args(argv)
    check_backend(a.backend)
    mean = compute_mean(a.input_db)
    if a.output_file:
        info("Write to %s", a.output_file)
        proto_io.write_binary_proto_atomic(a.output_file, mean_to_blob_proto(mean))
    dim = mean.shape[1] * mean.shape[2]
    for c in range(mean.shape[0]):
        info("mean_value channel [%d]: %g", c, float(mean[c].astype(np.float64).sum()) / dim)


def main(argv=None):
    return run_main(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
