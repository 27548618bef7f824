"""What a change of batch shares (--balance) costs a rank: LeNet and
CIFAR10-quick reading LMDBs of random images through the Data layer, as rank
0 of 2, the shares switching between b+d : b-d and b-d : b+d every
--every iterations, announced ahead as the balancer announces them (the
readers read the new shares without a restart; the net reshapes), or with
--immediate set at the change (the readers restart, dropping what they
prefetched).  The cost is the first step after a change against the steady
steps of the same share (medians), printed with the steady step.

    python benchmarks/share_change.py [--changes 20] [--every 12] [--delta 0.25] [--immediate]
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from caffempi import TRAIN, Net  # noqa: E402
from caffempi.io import proto_io  # noqa: E402
from caffempi.memory import tune_allocator  # noqa: E402
from caffempi.testing.datasets import random_datum_lmdb  # noqa: E402

NETS = {
    "LeNet": ("models/mnist/lenet_train_test.prototxt", (1, 28, 28)),
    "CIFAR10-quick": ("models/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32)),
}


def run(name, changes, every, delta, immediate, workdir):
    model, shape = NETS[name]
    db = os.path.join(workdir, name)
    random_datum_lmdb(db, shape, 4000, seed=1)
    param = proto_io.read_net_param(str(REPO / model))
    for lp in param.layer:
        if lp.type == "Data":
            lp.data_param.source = db
            lp.transform_param.ClearField("mean_file")
    net = Net(param, TRAIN, data_shard=(0, 2), memory="reuse")
    batch = net.shareable_batch()[0]
    d = max(1, int(delta * batch))
    shares = [(batch + d, batch - d), (batch - d, batch + d)]
    ahead = 0 if immediate else net.share_lookahead()
    if ahead >= every:
        raise SystemExit("--every must exceed the readers' lookahead, %d" % ahead)
    first, steady = {s: [] for s in shares}, {s: [] for s in shares}
    net.set_batch_shares(shares[0])
    for j in range((changes + 1) * every):
        k, i = divmod(j, every)
        if (j + ahead) % every == 0 and j + ahead > 0:
            net.set_batch_shares(shares[(j + ahead) // every % 2], ahead)
        t = time.perf_counter()
        net.clear_param_diffs()
        net.forward_backward()
        seconds = time.perf_counter() - t
        if k:                        # the first period starts the readers: not a change
            (first if i == 0 else steady)[shares[k % 2]].append(seconds)
    for share in shares:
        f, s = 1e3 * np.median(first[share]), 1e3 * np.median(steady[share][every:])
        print("%-14s shares %3d:%-3d  steady step %7.2f ms  first after a change %7.2f ms  cost %+6.2f ms "
              "(%d changes)" % (name, share[0], share[1], s, f, f - s, len(first[share])))
    for layer in net.layers:
        if hasattr(layer, "close"):
            layer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--immediate", action="store_true", help="set the shares at the change, unannounced")
    ap.add_argument("--delta", type=float, default=0.25, help="the share moved, a fraction of the batch")
    ap.add_argument("--nets", default=",".join(NETS))
    a = ap.parse_args()
    tune_allocator()
    with tempfile.TemporaryDirectory() as workdir:
        for name in a.nets.split(","):
            run(name, a.changes, a.every, a.delta, a.immediate, workdir)


if __name__ == "__main__":
    main()
