"""extract_features: run a trained net over its input and store the values
of some blobs, one Datum per image, in new LMDBs, as BVLC's
tools/extract_features.cpp does (keys are the image index as 10 zero-padded
digits; ``float_data`` holds the image's values, channels/height/width are
the blob's legacy shape, height and width 1 for an N x D blob; no label).

    python tools/extract_features.py PRETRAINED.caffemodel NET.prototxt \\
        BLOB1[,BLOB2,...] DB1[,DB2,...] NUM_MINI_BATCHES lmdb [CPU|GPU] [DEVICE_ID]

The net is built in the TEST phase; its data layer supplies the images.
"""
import argparse
import contextlib
import types

import numpy as np

from ..backend import to_numpy
from ..common import CaffeError, TEST
from ..data.lmdb_io import LMDBWriter, check_backend
from ..proto import caffe_pb2
from ._util import info, run_main


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


def extract_features(net, blob_names, db_paths, num_mini_batches):
    """Forward ``num_mini_batches`` times, writing each blob's per-image
    values into its database; returns the image count per blob."""
    if len(blob_names) != len(db_paths):
        raise CaffeError("the number of blob names (%d) and dataset names (%d) must be equal"
                         % (len(blob_names), len(db_paths)))
    for name in blob_names:
        if name not in net.blobs:
            raise CaffeError("Unknown feature blob name %s in the network %s" % (name, net.source_name))
    counts = [0] * len(blob_names)
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(LMDBWriter(p)) for p in db_paths]
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


def _main(argv):
    ap = argparse.ArgumentParser(
        prog="extract_features",
        description="Run a trained net on the input of its data layer and store the features of "
                    "the given blobs, one Datum per image, in new databases.")
    ap.add_argument("pretrained_net_param")
    ap.add_argument("feature_extraction_proto_file")
    ap.add_argument("blob_names", help="blob1[,blob2,...]")
    ap.add_argument("dataset_names", help="db1[,db2,...], one per blob")
    ap.add_argument("num_mini_batches", type=int)
    ap.add_argument("db_type")
    ap.add_argument("mode", nargs="?", default="CPU", choices=("CPU", "GPU"))
    ap.add_argument("device_id", nargs="?", type=int, default=0)
    a = ap.parse_args(argv)
    check_backend(a.db_type)
    from ..cli import select_backend
    from ..net import Net
    xp = np
    if a.mode == "GPU":
        xp = select_backend(types.SimpleNamespace(gpu=str(a.device_id)))
    net = Net(a.feature_extraction_proto_file, phase=TEST, weights=a.pretrained_net_param, xp=xp)
    extract_features(net, a.blob_names.split(","), a.dataset_names.split(","), a.num_mini_batches)


def main(argv=None):
    return run_main(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
