"""Images per second the Data layer alone delivers (LMDB reader thread +
decode/transform workers + prefetch queue), on synthetic databases:

* MNIST-sized: 1×28×28 raw Datums, scale 1/256 (LeNet's Data layer);
* CIFAR-sized: 3×32×32 raw Datums, crop 28, mirror, mean file (TRAIN).

    python benchmarks/data_throughput.py [--records 10000] [--batch 64] [--iters 300] [--workers 2]
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import caffempi.layer_types.data  # noqa: E402,F401
from caffempi import Net, TRAIN, config  # noqa: E402
from caffempi.data.transformer import mean_to_blob_proto  # noqa: E402
from caffempi.io import proto_io  # noqa: E402
from caffempi.proto import caffe_pb2  # noqa: E402
from caffempi.testing.datasets import random_datum_lmdb  # noqa: E402


def bench(source, batch, iters, transform, warmup=20):
    p = text_format.Parse('''layer { name: "data" type: "Data" top: "data" top: "label"
        transform_param { %s } data_param { source: "%s" batch_size: %d backend: LMDB } }'''
                          % (transform, source, batch), caffe_pb2.NetParameter())
    net = Net(p, TRAIN)
    for _ in range(warmup):
        net.forward()
    t0 = time.perf_counter()
    for _ in range(iters):
        net.forward()
    dt = time.perf_counter() - t0
    net.layers[0].close()
    return batch * iters / dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--workers", type=int, default=None, help="decode threads (CAFFEMPI_DATA_WORKERS)")
    a = ap.parse_args(argv)
    if a.workers:
        config.settings.data_workers = a.workers
    with tempfile.TemporaryDirectory() as tmp:
        mnist, cifar = os.path.join(tmp, "mnist_lmdb"), os.path.join(tmp, "cifar_lmdb")
        random_datum_lmdb(mnist, (1, 28, 28), a.records)
        random_datum_lmdb(cifar, (3, 32, 32), a.records)
        mean = os.path.join(tmp, "mean.binaryproto")
        proto_io.write_binary_proto_atomic(mean, mean_to_blob_proto(np.full((3, 32, 32), 120, np.float32)))
        r1 = bench(mnist, a.batch, a.iters, "scale: 0.00390625")
        r2 = bench(cifar, a.batch, a.iters, 'crop_size: 28 mirror: true mean_file: "%s"' % mean)
    print("Data layer throughput (batch %d, %d workers, %d iterations):"
          % (a.batch, config.settings.data_workers, a.iters))
    print("  MNIST-sized 1x28x28, scale:                   %10.0f images/s" % r1)
    print("  CIFAR-sized 3x32x32, crop 28 + mirror + mean: %10.0f images/s" % r2)


if __name__ == "__main__":
    main()
