"""convert_cifar_data: CIFAR-10 binary batches -> cifar10_train_<db_type> and
cifar10_test_<db_type> (lmdb or leveldb), as BVLC's examples/cifar10/convert_cifar_data.cpp
(keys %05d; 3×32×32 bytes as stored in the file; label = first byte).

    python tools/convert_cifar_data.py INPUT_FOLDER OUTPUT_FOLDER [lmdb]
"""
import os

import numpy as np

from ..common import CaffeError
from ..data.datum import array_to_datum
from ..data.db import backend_name, open_writer
from ..flags import FlagSet
from ._util import info, progress, run_tool

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
    backend_name(db_type)
    os.makedirs(output_folder, exist_ok=True)
    info("Writing Training data")
    with open_writer(os.path.join(output_folder, "cifar10_train_%s" % db_type), db_type) as w:
        for fileid in range(NUM_TRAIN_BATCHES):
            path = os.path.join(input_folder, "data_batch_%d.bin" % (fileid + 1))
            info("Training Batch %d", fileid + 1)
            labels, images = read_batch(path, batch_size)
            for j in progress(range(len(labels)), len(labels), "data_batch_%d" % (fileid + 1)):
                w.put("%05d" % (fileid * batch_size + j),
                      array_to_datum(images[j], int(labels[j])).SerializeToString())
    info("Writing Testing data")
    with open_writer(os.path.join(output_folder, "cifar10_test_%s" % db_type), db_type) as w:
        labels, images = read_batch(os.path.join(input_folder, "test_batch.bin"), batch_size)
        for j in progress(range(len(labels)), len(labels), "test_batch"):
            w.put("%05d" % j, array_to_datum(images[j], int(labels[j])).SerializeToString())


FLAGS = FlagSet("convert_cifar_data", "Convert the CIFAR-10 binary batches to the leveldb/lmdb format "
                "used as input for Caffe.")
FLAGS.argument("input_folder", "the folder of data_batch_1.bin ... data_batch_5.bin and test_batch.bin")
FLAGS.argument("output_folder", "where cifar10_train_<db_type> and cifar10_test_<db_type> are written")
FLAGS.argument("db_type", "lmdb or leveldb", default="lmdb")


def _main(flags, input_folder, output_folder, db_type):
    convert_dataset(input_folder, output_folder, db_type)
    info("Successfully converted CIFAR-10 data")


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
