"""convert_mnist_data: MNIST idx files -> LMDB or LevelDB of Datums, as BVLC's
examples/mnist/convert_mnist_data.cpp writes it (keys %08d, 1×rows×cols raw
bytes, label).

    python tools/convert_mnist_data.py [--backend=lmdb] IMAGES LABELS OUTPUT_DB
"""
import gzip
import struct

import numpy as np

from ..common import CaffeError
from ..data.datum import array_to_datum
from ..data.db import backend_name, open_writer
from ..flags import FlagSet
from ._util import info, progress, run_tool


def _open(path):
    try:
        return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise CaffeError("cannot open %s: %s" % (path, e.strerror or e)) from None


def read_idx_images(path):
    with _open(path) as f:
        head = f.read(16)
        if len(head) < 16:
            raise CaffeError("%s: too short for an idx image file" % path)
        magic, n, rows, cols = struct.unpack(">iiii", head)
        if magic != 2051:
            raise CaffeError("%s: incorrect image file magic %d (expected 2051)" % (path, magic))
        data = f.read()
    if len(data) < n * rows * cols:
        raise CaffeError("%s: %d images of %dx%d need %d bytes, file has %d"
                         % (path, n, rows, cols, n * rows * cols, len(data)))
    return np.frombuffer(data, np.uint8, n * rows * cols).reshape(n, rows, cols)


def read_idx_labels(path):
    with _open(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise CaffeError("%s: too short for an idx label file" % path)
        magic, n = struct.unpack(">ii", head)
        if magic != 2049:
            raise CaffeError("%s: incorrect label file magic %d (expected 2049)" % (path, magic))
        data = f.read()
    if len(data) < n:
        raise CaffeError("%s: %d labels but %d bytes" % (path, n, len(data)))
    return np.frombuffer(data, np.uint8, n)


def write_mnist_db(images, labels, db_path, desc=None, backend="lmdb"):
    """N×rows×cols uint8 images and N labels -> a new database (lmdb or
    leveldb) as convert_mnist_data writes it."""
    images = np.asarray(images, np.uint8)
    if len(images) != len(labels):
        raise CaffeError("%d images but %d labels" % (len(images), len(labels)))
    with open_writer(db_path, backend) as w:
        for i in progress(range(len(images)), len(images), desc or db_path):
            w.put("%08d" % i, array_to_datum(images[i][None], int(labels[i])).SerializeToString())
    return len(images)


def convert_dataset(image_file, label_file, db_path, backend="lmdb"):
    backend_name(backend)
    images = read_idx_images(image_file)
    labels = read_idx_labels(label_file)
    if len(images) != len(labels):
        raise CaffeError("%s has %d images but %s has %d labels"
                         % (image_file, len(images), label_file, len(labels)))
    info("A total of %d items.", len(images))
    info("Rows: %d Cols: %d", images.shape[1], images.shape[2])
    n = write_mnist_db(images, labels, db_path, backend=backend)
    info("Processed %d files.", n)
    return n


FLAGS = FlagSet("convert_mnist_data", "This script converts the MNIST dataset to the leveldb/lmdb format "
                "used by Caffe to load data.")
FLAGS.argument("input_image_file", "the idx image file (gzipped or not)")
FLAGS.argument("input_label_file", "the idx label file (gzipped or not)")
FLAGS.argument("output_db_file", "the database to create")
FLAGS.define("backend", "lmdb", "The backend {lmdb, leveldb} for storing the result")


def _main(flags, input_image_file, input_label_file, output_db_file):
    convert_dataset(input_image_file, input_label_file, output_db_file, flags.backend)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
