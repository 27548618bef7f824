"""Denormal floats are flushed to zero in the computing threads (x86, on by
default, CAFFEMPI_FTZ=0 turns it off): values that would be denormal come out
0, and a step whose values underflow is not slower than a normal one."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import Net, set_random_seed
from caffempi.backend import denormals, threads
from caffempi.proto import caffe_pb2

pytestmark = pytest.mark.skipif(not denormals.supported(),
                                reason="MXCSR is not reachable here (not x86-64 glibc)")

TINY = np.float32(1e-20)      # TINY * TINY is a float32 denormal (1e-40)
TINY_SQUARED_BITS = 71362     # its bit pattern: 1e-40 / 2**-149, rounded

NET = """
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 32 dim: 1 dim: 28 dim: 28 } shape { dim: 32 dim: 10 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 8 kernel_size: 5 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv" top: "ip1"
        inner_product_param { num_output: 200 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""


def make_net(scale):
    """The net above with data and every weight multiplied by ``scale``."""
    set_random_seed(1)
    p = caffe_pb2.NetParameter()
    text_format.Merge(NET, p)
    net = Net(p)
    rs = np.random.RandomState(0)
    net.blobs["data"].data[...] = rs.randn(*net.blobs["data"].shape) * scale
    net.blobs["target"].data[...] = 0
    for blob in net.params["conv"] + net.params["ip1"] + net.params["ip2"]:
        blob.data[...] *= scale
    return net


def in_thread(fn):
    """fn() on a new thread (a thread that has not computed yet); its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def test_a_computing_thread_flushes_denormals():
    def run():
        net = make_net(TINY)
        net.forward()
        return denormals.mxcsr(), net.blobs["conv"].data.copy()
    mxcsr, conv = in_thread(run)
    assert mxcsr & (denormals.FTZ | denormals.DAZ) == denormals.FTZ | denormals.DAZ
    # each product is ~1e-40: without flushing these are denormals, not 0
    # (compared as bits: DAZ would read a denormal as 0)
    assert not conv.view(np.uint32).any()


def test_the_kernel_threads_flush_denormals():
    previous = threads.set_thread_count(2)
    try:
        products = []
        threads.for_chunks(4, lambda i: (time.sleep(0.01), TINY * TINY * np.ones(4, np.float32))[1],
                           products.append)
    finally:
        threads.set_thread_count(previous)
    assert len(products) == 4 and not any(p.view(np.uint32).any() for p in products)


def test_set_flush_switches_both_bits_and_reports_the_previous_state():
    def run():
        was = denormals.set_flush(False)
        off = np.ones(1, np.float32) * TINY * TINY
        denormals.set_flush(True)
        on = np.ones(1, np.float32) * TINY * TINY
        return was, off, on, denormals.set_flush(was)
    was, off, on, now = in_thread(run)
    # compared as bits: with DAZ set, this thread reads a denormal as 0
    assert off.view(np.uint32)[0] == TINY_SQUARED_BITS and on.view(np.uint32)[0] == 0
    assert now is True


def test_caffempi_ftz_0_leaves_denormals_alone():
    code = ("import numpy as np; from test_denormals import make_net, TINY; net = make_net(TINY); "
            "net.forward(); print(int(net.blobs['conv'].data.view(np.uint32).any()))")
    env = dict(os.environ, CAFFEMPI_FTZ="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"


def test_a_step_whose_values_underflow_is_not_slower_than_a_normal_one():
    """Without flushing, x86 CPUs that take microcode assists on denormals
    ran such a step 20-45x slower; 2x leaves room for this shared host's
    noise.  The two nets' steps alternate and the fastest of each is
    compared: a neighbour's load only ever adds time, and alternating
    spreads it over both (the whole suite runs beside the Open MPI one)."""
    def step_seconds(net):
        t = time.perf_counter()
        net.forward()
        net.backward()
        return time.perf_counter() - t

    def run():
        nets = {"normal": make_net(np.float32(1)), "tiny": make_net(TINY)}
        times = {name: [] for name in nets}
        for _ in range(9):
            for name, net in nets.items():
                times[name].append(step_seconds(net))
        return (1e3 * min(times["normal"]), 1e3 * min(times["tiny"]),
                nets["tiny"].params["ip2"][0].diff.view(np.uint32).any())
    normal, tiny, grad_nonzero = in_thread(run)
    assert not grad_nonzero           # every product underflowed
    assert tiny < 2 * normal, (tiny, normal)
