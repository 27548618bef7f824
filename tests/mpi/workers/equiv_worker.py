"""Run a few SGD steps of workers/nets.MLP on this rank's shard of a fixed
global batch and save the averaged gradients, losses and weights (rank 0).
Backend "gpu" runs the net on CuPy, one GPU per local rank (round robin)."""
import sys
import os

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nets import net_param, global_batch, shard  # noqa: E402

from caffempi.backend import to_numpy  # noqa: E402
from caffempi.common import set_random_seed  # noqa: E402
from caffempi.net import Net  # noqa: E402
from caffempi.parallel.comm import get_world  # noqa: E402
from caffempi.parallel.collectives import Collectives
from caffempi.parallel.rank import install_abort_handlers  # noqa: E402
from caffempi.parallel.sync import BucketedAllreduce  # noqa: E402


def main(out, comm="overlap", global_b=12, steps=4, iter_size=1, bucket_mb="0.001", backend="cpu"):
    world = get_world(comm)
    install_abort_handlers(world)
    xp = np
    if backend == "gpu":
        import cupy as xp
        xp.cuda.Device(world.local_rank()[0] % xp.cuda.runtime.getDeviceCount()).use()
    b = global_b // world.size // iter_size
    # different seeds per rank: the broadcast must make the weights equal
    set_random_seed(1 + 100 * world.rank)
    net = Net(net_param(b), data_shard=(world.rank, world.size), xp=xp)
    Collectives(world).broadcast_arrays([net.param_data])
    red = BucketedAllreduce(world, comm=comm, bucket_mb=float(bucket_mb), first_bucket_mb=float(bucket_mb))
    red.attach(net, iter_size)
    lr, mom = 0.1, 0.9
    hist = xp.zeros_like(net.param_data)
    rec = {"loss": [], "acc": []}
    for it in range(steps):
        x, y = global_batch(it, global_b)
        xs, ys = shard(x, world.rank, world.size), shard(y, world.rank, world.size)
        net.clear_param_diffs()
        red.start_iteration(net)
        loss = 0.0
        acc = 0.0
        for k in range(iter_size):
            net.blobs["data"].data[...] = xp.asarray(xs[k::iter_size])
            net.blobs["label"].data[...] = xp.asarray(ys[k::iter_size])
            loss += net.forward_backward()
            acc += float(net.blobs["accuracy"].data.reshape(-1)[0])
        red.finish(net)
        net.param_diff *= np.float32(1.0 / iter_size)
        loss, acc = red.collectives.mean_scalars([loss / iter_size, acc / iter_size])
        rec["loss"].append(loss)
        rec["acc"].append(acc)
        rec["grad%d" % it] = to_numpy(net.param_diff).copy()
        hist[...] = mom * hist + lr * net.param_diff
        net.param_data -= hist
        rec["w%d" % it] = to_numpy(net.param_data).copy()
    assert red.collectives.check_in_sync(net), "weights differ between ranks"
    if world.rank == 0:
        np.savez(out, **{k: np.asarray(v) for k, v in rec.items()})
    red.close()


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[2:3], *[int(a) for a in sys.argv[3:6]], *sys.argv[6:8])
