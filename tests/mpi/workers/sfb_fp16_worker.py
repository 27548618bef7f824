"""Sufficient factors as float16 (--comm_dtype=fp16) when the gradients have
realistic magnitudes (the loss weighted 1e-6: top diffs near 1e-7, float16
subnormals unscaled): every factor-formed weight gradient within float16's
relative precision of the float32 one."""
import sys
import os

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nets import net_param, global_batch, shard  # noqa: E402

from caffempi.common import set_random_seed  # noqa: E402
from caffempi.net import Net  # noqa: E402
from caffempi.parallel.comm import get_world  # noqa: E402
from caffempi.parallel.rank import install_abort_handlers  # noqa: E402
from caffempi.parallel.sfb import SufficientFactors  # noqa: E402
from caffempi.parallel.sync import BucketedAllreduce  # noqa: E402


def gradient(world, comm_dtype, x, y):
    param = net_param(len(x))
    param.layer[-2].loss_weight.append(1e-6)
    set_random_seed(3)
    net = Net(param, data_shard=(world.rank, world.size))
    factors = SufficientFactors(mode="on")
    sync = BucketedAllreduce(world, comm="overlap", bucket_mb=0.001, first_bucket_mb=0.001,
                             comm_dtype=comm_dtype, plugins=[factors], link_gbps=1, gemm_gflops=50)
    sync.attach(net, 1)
    net.clear_param_diffs()
    sync.start_iteration(net)
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = y
    net.forward_backward()
    sync.finish(net)
    layers = [net.layer_names[i] for i, _, _ in factors.factor_layers]
    grads = {name: net.layer(name).blobs[0].diff.copy() for name in layers}
    sync.close()
    return grads


def main():
    world = get_world("overlap")
    install_abort_handlers(world)
    x, y = global_batch(0, 4 * world.size)
    x, y = shard(x, world.rank, world.size), shard(y, world.rank, world.size)
    exact = gradient(world, "fp32", x, y)
    half = gradient(world, "fp16", x, y)
    assert sorted(exact) == ["ip1", "ip2", "ip3"], sorted(exact)
    for name, g in exact.items():
        assert 0 < np.abs(g).max() < 1e-4, (name, np.abs(g).max())       # gradients' magnitudes
        err = np.abs(half[name] - g).max() / np.abs(g).max()
        assert err < 2e-3, (name, err)
    if world.rank == 0:
        print("SFB FP16 OK")


if __name__ == "__main__":
    main()
