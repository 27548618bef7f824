"""--comm=overlap polls its pending allreduces between the chunks of a CPU
kernel, not only between layers: counts the transport's polls made inside
the convolution's backward (chunks forced small), checks that the poll is
uninstalled after finish, and that the averaged gradient is the mean.
With the argument ``sfb``: --sfb=on, whose factor gathers (ip's, started
before the convolution's backward) are tested in those chunks too, beside
the transport's polls; rank 1 starts late, so that rank 0's gathers are
still pending through its convolution's backward; ip's weight gradient,
which the factors write whole, is not cleared before (it holds NaN there)."""
import sys
import time

import numpy as np
from google.protobuf import text_format

from caffempi.backend import threads
from caffempi.backend.cpu import chunking
from caffempi.net import Net
from caffempi.parallel.comm import get_world
from caffempi.parallel.collectives import Collectives
from caffempi.parallel.rank import install_abort_handlers
from caffempi.parallel.sfb import SufficientFactors
from caffempi.parallel.sync import BucketedAllreduce
from caffempi.proto import caffe_pb2

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 10 dim: 10 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def main(argv):
    sfb = "sfb" in argv
    world = get_world("overlap")
    install_abort_handlers(world)
    chunking.COL_CHUNK_BYTES = 4096          # a chunk per image or two
    param = caffe_pb2.NetParameter()
    text_format.Merge(NET, param)
    net = Net(param)
    Collectives(world).broadcast_arrays([net.param_data])
    plugin = SufficientFactors(mode="on")
    red = BucketedAllreduce(world, comm="overlap", bucket_mb=1e-6, first_bucket_mb=1e-6,
                            plugins=[plugin] if sfb else [], link_gbps=1, gemm_gflops=50)
    red.attach(net)
    transport = red.transport
    polls = {"conv": 0, "gathers": 0}
    inside = {"conv": False}

    def counting(obj, name, key):
        real = getattr(obj, name)

        def count():
            if inside["conv"]:
                polls[key] += 1
            return real()
        setattr(obj, name, count)
    counting(transport, "poll", "conv")
    if sfb:
        counting(plugin, "progress", "gathers")
    conv = net.layers[net.layer_names.index("conv")]
    real_backward = conv.backward

    def timed_backward(*args):
        inside["conv"] = True
        try:
            return real_backward(*args)
        finally:
            inside["conv"] = False
    conv.backward = timed_backward
    r = np.random.RandomState(world.rank)
    net.blobs["data"].data[...] = r.randn(*net.blobs["data"].shape)
    net.blobs["label"].data[...] = r.randint(0, 5, size=8)
    own_net = Net(param)                 # this rank's own gradient, unreduced
    own_net.param_data[...] = net.param_data
    for name in ("data", "label"):
        own_net.blobs[name].data[...] = net.blobs[name].data
    own_net.clear_param_diffs()
    own_net.forward_backward()
    own = own_net.param_diff.copy()
    ip_weight = net.params["ip"][0]
    net.param_diff[...] = np.nan             # what the last update left, as far as finish may know
    net.clear_param_diffs()
    # the factors write ip's weight gradient whole: the clear leaves it
    assert np.isnan(ip_weight.diff).all() == sfb and not np.isnan(net.params["conv"][0].diff).any()
    red.start_iteration(net)
    if sfb and world.rank == 1:
        time.sleep(0.5)
    net.forward_range()
    with threads.progress(red.progress):       # as the solver runs backward
        net.backward_range()
    red.finish(net)
    assert threads.progress_here() is None, "the poll stayed installed after finish"
    # the ip bucket starts before the conv's backward, whose chunks poll it
    assert polls["conv"] >= 4, polls
    if sfb and world.rank == 0:
        # and test ip's factor gathers, still pending there (rank 1 is late)
        assert polls["gathers"] >= 4, polls
    mean = world.comm.allreduce(own.astype(np.float64)) / world.size
    np.testing.assert_allclose(net.param_diff, mean, rtol=1e-5, atol=1e-7)
    red.close()
    net.clear_param_diffs()                  # detached: every gradient cleared again
    assert not net.param_diff.any()
    if world.rank == 0:
        print("polls inside conv backward:", polls["conv"], "gather tests:", polls["gathers"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
