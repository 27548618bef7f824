"""Time the trainer waits for data, as the solver logs it (`Data wait:` per
display interval), for LeNet and CIFAR10-quick reading LMDBs of random
images through the Data layer (CIFAR: mean file, as models/cifar10 uses),
with the allocator tuned as `caffempi train` tunes it.

    python benchmarks/data_wait.py [--iters 200] [--display 50]
"""
import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from caffempi.common import captured_log  # noqa: E402
from caffempi.io import proto_io  # noqa: E402
from caffempi.memory import tune_allocator  # noqa: E402
from caffempi.proto import caffe_pb2  # noqa: E402
from caffempi.solvers import get_solver  # noqa: E402
from caffempi.testing.datasets import random_datum_lmdb  # noqa: E402
from caffempi.data.transformer import mean_to_blob_proto  # noqa: E402
from caffempi.tools.compute_image_mean import compute_mean  # noqa: E402

NETS = {
    "LeNet": ("models/mnist/lenet_train_test.prototxt", (1, 28, 28)),
    "CIFAR10-quick": ("models/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32)),
}


def run(name, iters, display, workdir):
    model, shape = NETS[name]
    train_db, test_db = os.path.join(workdir, name + "_train"), os.path.join(workdir, name + "_test")
    random_datum_lmdb(train_db, shape, 2000, seed=1)
    random_datum_lmdb(test_db, shape, 200, seed=2)
    net = proto_io.read_net_param(str(REPO / model))
    for lp in net.layer:
        if lp.type == "Data":
            test = any(r.phase == caffe_pb2.TEST for r in lp.include)
            lp.data_param.source = test_db if test else train_db
            if lp.transform_param.mean_file:
                mean = os.path.join(workdir, name + "_mean.binaryproto")
                proto_io.write_binary_proto_atomic(mean, mean_to_blob_proto(compute_mean(train_db)))
                lp.transform_param.mean_file = mean
    sp = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, lr_policy="fixed", max_iter=iters,
                                   display=display, snapshot_after_train=False, random_seed=1)
    sp.net_param.CopyFrom(net)
    solver = get_solver(sp)
    with captured_log() as lines:
        solver.solve()
    waits = [(float(m.group(1)), float(m.group(2))) for m in
             (re.search(r"Data wait: ([\d.]+) ms/iter \(([\d.]+)% of the step", l) for l in lines) if m]
    for l in lines:
        if "Data wait" in l or " iter/s" in l:
            print("  " + l.strip())
    # the first interval includes the reader's start-up (empty queue)
    steady = waits[1:] or waits
    print("%s: data wait %.3f ms/iter = %.2f%% of the step (mean over %d display intervals after the first)"
          % (name, np.mean([w for w, _ in steady]), np.mean([p for _, p in steady]), len(steady)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--display", type=int, default=50)
    args = ap.parse_args()
    tune_allocator()
    with tempfile.TemporaryDirectory() as d:
        for name in NETS:
            run(name, args.iters, args.display, d)


if __name__ == "__main__":
    main()
