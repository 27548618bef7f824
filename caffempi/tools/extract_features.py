"""extract_features: run a trained net over its input and store the values
of some blobs, one Datum per image, in new LMDBs or LevelDBs, as BVLC's
tools/extract_features.cpp does (keys are the image index as 10 zero-padded
digits; ``float_data`` holds the image's values, channels/height/width are
the blob's legacy shape, height and width 1 for an N x D blob; no label).

    python tools/extract_features.py PRETRAINED.caffemodel NET.prototxt \\
        BLOB1[,BLOB2,...] DB1[,DB2,...] NUM_MINI_BATCHES lmdb|leveldb [CPU|GPU] [DEVICE_ID]

The net is built in the TEST phase; its data layer supplies the images.
"""
import contextlib
import types

import numpy as np

from ..backend import to_numpy
from ..common import CaffeError, TEST
from ..data.db import backend_name, open_writer
from ..proto import caffe_pb2
from ..flags import FlagSet
from ._util import info, run_tool


def legacy_shape(shape):
    """Caffe's (channels, height, width) of one image of a blob: axes 1-3,
    1 where the blob has fewer axes."""
    dims = list(shape[1:4]) + [1] * (4 - min(len(shape), 4))
    return tuple(int(d) for d in dims[:3])


def feature_datum(values, chw):
    d = caffe_pb2.Datum()
    d.channels, d.height, d.width = chw
    d.float_data.extend(values.tolist())
    return d


def extract_features(net, blob_names, db_paths, num_mini_batches, backend="lmdb"):
    """Forward ``num_mini_batches`` times, writing each blob's per-image
    values into its new database (lmdb or leveldb); returns the image count
    per blob."""
    if len(blob_names) != len(db_paths):
        raise CaffeError("the number of blob names (%d) and dataset names (%d) must be equal"
                         % (len(blob_names), len(db_paths)))
    for name in blob_names:
        if name not in net.blobs:
            raise CaffeError("Unknown feature blob name %s in the network %s" % (name, net.source_name))
    counts = [0] * len(blob_names)
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(open_writer(p, backend)) for p in db_paths]
        info("Extracting Features")
        for _ in range(num_mini_batches):
            net.forward(blobs=blob_names)
            for i, name in enumerate(blob_names):
                data = to_numpy(net.blobs[name].data)
                chw = legacy_shape(data.shape)
                for row in data.reshape(data.shape[0], -1):
                    writers[i].put("%010d" % counts[i], feature_datum(row, chw).SerializeToString())
                    counts[i] += 1
                    if counts[i] % 1000 == 0:
                        info("Extracted features of %d query images for feature blob %s", counts[i], name)
    for name, n in zip(blob_names, counts):
        info("Extracted features of %d query images for feature blob %s", n, name)
    info("Successfully extracted the features!")
    return counts


FLAGS = FlagSet("extract_features", "Run a trained net on the input of its data layer and store the "
                "features of the given blobs, one Datum per image, in new databases.")
FLAGS.argument("pretrained_net_param", "the .caffemodel")
FLAGS.argument("feature_extraction_proto_file", "the net's prototxt (built in the TEST phase)")
FLAGS.argument("extract_feature_blob_name1[,name2,...]", "the blobs to store")
FLAGS.argument("save_feature_dataset_name1[,name2,...]", "one new database per blob")
FLAGS.argument("num_mini_batches", "the forward passes to run", kind=int)
FLAGS.argument("db_type", "lmdb or leveldb")
FLAGS.argument("CPU/GPU", "where the net runs", default="CPU")
FLAGS.argument("DEVICE_ID", "the GPU's id", kind=int, default=0)


def _main(flags, pretrained_net_param, proto_file, blob_names, dataset_names, num_mini_batches, db_type,
          mode, device_id):
    if mode not in ("CPU", "GPU"):
        raise CaffeError("mode '%s' is not CPU or GPU" % mode)
    backend_name(db_type)
    from ..cli import select_backend
    from ..net import Net
    xp = np
    if mode == "GPU":
        xp = select_backend(types.SimpleNamespace(gpu=str(device_id)))
    net = Net(proto_file, phase=TEST, weights=pretrained_net_param, xp=xp)
    extract_features(net, blob_names.split(","), dataset_names.split(","), num_mini_batches, db_type)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
