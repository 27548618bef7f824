"""--compress=powersgd: at full rank the low-rank gradient is the exact
mean (to float32 rounding); with error feedback what is applied over k
steps is the sum of the true mean gradients less the ranks' mean last
error; the first start_iter steps are exact; every rank applies the same
bits; with --comm_dtype=fp16, P and Q cross as float16.  A conv layer (a
4-axis weight as O x C*kh*kw) and fully connected layers."""
import sys

import numpy as np
from google.protobuf import text_format

from caffempi.common import set_random_seed
from caffempi.net import Net
from caffempi.parallel.collectives import Collectives
from caffempi.parallel.comm import get_world
from caffempi.parallel.powersgd import LowRank
from caffempi.parallel.rank import install_abort_handlers
from caffempi.parallel.sync import BucketedAllreduce
from caffempi.proto import caffe_pb2

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: %(b)d dim: 3 dim: 8 dim: 8 } shape { dim: %(b)d } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 12 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv" top: "ip1"
        inner_product_param { num_output: 24 weight_filler { type: "xavier" } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
BATCH = 4          # a rank


def make_net(world, b=BATCH):
    """The net the reducer combines and an unhooked twin for each rank's
    own gradient, with rank 0's weights (batch ``b`` a rank)."""
    param = caffe_pb2.NetParameter()
    text_format.Merge(NET % {"b": b}, param)
    set_random_seed(3)
    net, twin = Net(param), Net(param)
    Collectives(world).broadcast_arrays([net.param_data])
    twin.param_data[...] = net.param_data
    return net, twin


def batch(world, step):
    r = np.random.RandomState(100 * step + world.rank)
    return r.randn(BATCH, 3, 8, 8), r.randint(0, 5, size=BATCH)


def feed(net, world, step):
    net.blobs["data"].data[...], net.blobs["label"].data[...] = batch(world, step)


def own_gradient(net):
    net.clear_param_diffs()
    net.forward_backward()
    return net.param_diff.copy()


def step(world, nets, sync, k):
    """One combined step on batch k: (the reducer's result, the exact mean)."""
    net, twin = nets
    feed(twin, world, k)
    exact = world.comm.allreduce(own_gradient(twin).astype(np.float64)) / world.size
    feed(net, world, k)
    net.clear_param_diffs()
    sync.start_iteration(net)
    net.forward_backward()
    sync.finish(net)
    return net.param_diff.copy(), exact


def claimed_ranges(net, plugin):
    return [(net.param_offsets[m.param], net.param_offsets[m.param] + m.blob.count) for m in plugin.matrices]


def same_on_every_rank(world, arr):
    everyone = world.allgather(arr.tobytes())
    assert all(e == everyone[0] for e in everyone), "ranks differ"


def main():
    world = get_world("overlap")
    install_abort_handlers(world)

    # full rank: the exact mean
    nets = make_net(world)
    net = nets[0]
    plugin = LowRank(rank=1000, use="all")
    sync = BucketedAllreduce(world, comm="overlap", bucket_mb=0.001, first_bucket_mb=0.001, plugins=[plugin],
                             link_gbps=1, gemm_gflops=50)
    sync.attach(net)
    assert len(plugin.matrices) == 3, [m.blob.shape for m in plugin.matrices]   # conv, ip1, ip2 weights
    for k in range(3):
        got, exact = step(world, nets, sync, k)
        np.testing.assert_allclose(got, exact, rtol=2e-4, atol=2e-6 * np.abs(exact).max())
        same_on_every_rank(world, got)
    sync.close()

    # rank 1 with error feedback: applied sum = true mean sum - mean last error
    nets = make_net(world)
    net = nets[0]
    plugin = LowRank(rank=1, start_iter=2, use="all")
    sync = BucketedAllreduce(world, comm="overlap", bucket_mb=0.001, first_bucket_mb=0.001, plugins=[plugin],
                             link_gbps=1, gemm_gflops=50)
    sync.attach(net)
    ranges = claimed_ranges(net, plugin)
    assert len(ranges) == 3, ranges          # conv (12 x 27), ip1 (24 x 432), ip2 (5 x 24)
    applied = np.zeros(net.param_diff.size)
    true = np.zeros(net.param_diff.size)
    for k in range(6):
        got, exact = step(world, nets, sync, k)
        same_on_every_rank(world, got)
        differs = max(np.abs(got[s:e] - exact[s:e]).max() / np.abs(exact[s:e]).max() for s, e in ranges)
        if k < 2:
            assert differs < 1e-5, (k, differs)        # the exact start
        else:
            assert differs > 1e-2, (k, differs)        # rank 1 of a 12 x 27 gradient is not the gradient
        applied += got
        true += exact
    for m, (s, e) in zip(plugin.matrices, ranges):
        mean_error = world.comm.allreduce(m.error.astype(np.float64).reshape(-1)) / world.size
        scale = np.abs(true[s:e]).max()
        np.testing.assert_allclose(applied[s:e], true[s:e] - mean_error, rtol=0, atol=1e-5 * scale)
        assert np.abs(mean_error).max() > 1e-3 * scale          # something was delayed
    # the rest (the biases) is the exact mean
    rest = np.ones(net.param_diff.size, bool)
    for s, e in ranges:
        rest[s:e] = False
    np.testing.assert_allclose(applied[rest], true[rest], rtol=1e-5, atol=1e-7)
    sync.close()

    # --comm_dtype=fp16: P and Q cross as float16 pieces, summed in float32
    # (the compressor's exchange): at full rank the exact mean to float16's
    # rounding, and not to float32's
    nets = make_net(world)
    net = nets[0]
    plugin = LowRank(rank=1000, use="all")
    sync = BucketedAllreduce(world, comm="overlap", bucket_mb=0.001, first_bucket_mb=0.001, comm_dtype="fp16",
                             plugins=[plugin], link_gbps=1, gemm_gflops=50)
    sync.attach(net)
    assert [t.name for t in plugin._sums] == ["fp16", "fp16"], [t.name for t in plugin._sums]
    ranges = claimed_ranges(net, plugin)
    for k in range(3):
        got, exact = step(world, nets, sync, k)
        same_on_every_rank(world, got)
        for s, e in ranges:
            scale = np.abs(exact[s:e]).max()
            np.testing.assert_allclose(got[s:e], exact[s:e], rtol=0, atol=4e-3 * scale)
            assert np.abs(got[s:e] - exact[s:e]).max() > 1e-6 * scale       # float16 rounding is there
    sync.close()

    # iter_size 2: the passes' gradients are added before the low-rank step
    # (the hook arms on the last pass), so two half batches give twice
    # (each pass's loss is its own mean) what the whole batch gives
    whole, halves = make_net(world)[0], make_net(world, BATCH // 2)[0]
    syncs = []
    for net, iter_size in ((whole, 1), (halves, 2)):
        syncs.append(BucketedAllreduce(world, comm="overlap", bucket_mb=0.001, first_bucket_mb=0.001,
                                       plugins=[LowRank(rank=1, use="all")], link_gbps=1, gemm_gflops=50))
        syncs[-1].attach(net, iter_size)
    for k in range(3):
        data, label = batch(world, k)
        for net, sync, iter_size in ((whole, syncs[0], 1), (halves, syncs[1], 2)):
            net.clear_param_diffs()
            sync.start_iteration(net)
            for i in range(iter_size):
                net.blobs["data"].data[...] = data[i::iter_size]
                net.blobs["label"].data[...] = label[i::iter_size]
                net.forward_backward()
            sync.finish(net)
        scale = np.abs(whole.param_diff).max()
        np.testing.assert_allclose(halves.param_diff, 2 * whole.param_diff, rtol=0, atol=1e-5 * scale)
    for sync in syncs:
        sync.close()
    if world.rank == 0:
        print("POWERSGD OK")


if __name__ == "__main__":
    sys.exit(main())
