"""convert_cifar_data: CIFAR-10 binary batches -> cifar10_train_lmdb and
cifar10_test_lmdb, as BVLC's examples/cifar10/convert_cifar_data.cpp
(keys %05d; 3×32×32 bytes as stored in the file; label = first byte).

    python tools/convert_cifar_data.py INPUT_FOLDER OUTPUT_FOLDER [lmdb]
"""
import argparse
import os

import numpy as np

from ..common import CaffeError
from ..data.datum import array_to_datum
from ..data.lmdb_io import LMDBWriter, check_backend
from ._util import info, progress, run_main

IMAGE_BYTES = 3 * 32 * 32
BATCH_SIZE = 10000
NUM_TRAIN_BATCHES = 5


def read_batch(path, expect=BATCH_SIZE):
    """(labels, images N×3×32×32) from one CIFAR-10 .bin batch."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CaffeError("unable to open file %s: %s" % (path, e.strerror or e)) from None
    rec = IMAGE_BYTES + 1
    if len(raw) % rec or (expect and len(raw) != expect * rec):
        raise CaffeError("%s: %d bytes is not %s records of %d bytes"
                         % (path, len(raw), expect or "whole", rec))
    a = np.frombuffer(raw, np.uint8).reshape(-1, rec)
    return a[:, 0].copy(), a[:, 1:].reshape(-1, 3, 32, 32)


def convert_dataset(input_folder, output_folder, db_type="lmdb", batch_size=BATCH_SIZE):
    check_backend(db_type)
    os.makedirs(output_folder, exist_ok=True)
    info("Writing Training data")
    with LMDBWriter(os.path.join(output_folder, "cifar10_train_%s" % db_type)) as w:
        for fileid in range(NUM_TRAIN_BATCHES):
            path = os.path.join(input_folder, "data_batch_%d.bin" % (fileid + 1))
            info("Training Batch %d", fileid + 1)
            labels, images = read_batch(path, batch_size)
            for j in progress(range(len(labels)), len(labels), "data_batch_%d" % (fileid + 1)):
                w.put("%05d" % (fileid * batch_size + j),
                      array_to_datum(images[j], int(labels[j])).SerializeToString())
    info("Writing Testing data")
    with LMDBWriter(os.path.join(output_folder, "cifar10_test_%s" % db_type)) as w:
        labels, images = read_batch(os.path.join(input_folder, "test_batch.bin"), batch_size)
        for j in progress(range(len(labels)), len(labels), "test_batch"):
            w.put("%05d" % j, array_to_datum(images[j], int(labels[j])).SerializeToString())


def _main(argv):
    ap = argparse.ArgumentParser(prog="convert_cifar_data",
                                 description="Convert the CIFAR-10 binary batches to LMDB.")
    ap.add_argument("input_folder")
    ap.add_argument("output_folder")
    ap.add_argument("db_type", nargs="?", default="lmdb")
    a = ap.parse_args(argv)
    convert_dataset(a.input_folder, a.output_folder, a.db_type)
    info("Successfully converted CIFAR-10 data")


def main(argv=None):
    return run_main(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
