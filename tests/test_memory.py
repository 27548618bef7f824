"""Memory modes (caffempi.memory): reuse and recompute give the numbers of
none, bit for bit, on the zoo nets at batch 1, and need less memory."""
import sys

import numpy as np
import pytest

from caffempi import Blob, CaffeError, Net, TEST, TRAIN, set_random_seed
from caffempi.common import get_rng_state
from caffempi.memory import measure, training_variant
from caffempi.timing import randomize_inputs, time_net

from test_net import MLP, net_param
from test_zoo import batch1_param

MODES = ("none", "reuse", "recompute")

ZOO_NETS = [
    "bvlc/examples/mnist/lenet_train_test.prototxt",
    "bvlc/examples/mnist/mnist_autoencoder.prototxt",
    "bvlc/examples/siamese/mnist_siamese_train_test.prototxt",
    "bvlc/examples/cifar10/cifar10_full_train_test.prototxt",
    "bvlc/examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt",
    "bvlc/models/bvlc_alexnet/train_val.prototxt",
    "bvlc/models/bvlc_googlenet/train_val.prototxt",
    "squeezenet/v1.1/train_val.prototxt",
    "resnet/ResNet-50-deploy.prototxt",
]


def zoo_net(zoo, rel, mode, phase=TRAIN):
    path = zoo / rel
    if not path.exists():
        pytest.skip("%s is absent" % rel)
    param = training_variant(batch1_param(path), 1, str(path))
    for lp in param.layer:
        # AlexNet's 4096-wide fc6/fc7 take seconds to fill: narrow them (test speed)
        if lp.type == "InnerProduct" and lp.inner_product_param.num_output == 4096:
            lp.inner_product_param.num_output = 256
    set_random_seed(7)
    net = Net(param, phase=phase, memory=mode, source_name=str(path))
    randomize_inputs(net)
    return net


def passes(net, n=2):
    """Losses, outputs, parameter gradients and parameters (BatchNorm
    statistics included) after each of ``n`` training passes."""
    out = []
    for _ in range(n):
        net.clear_param_diffs()
        loss = net.forward_range()
        outputs = {name: np.array(v) for name, v, _ in net.output_values()}
        net.backward_range()
        out.append((loss, outputs, net.param_diff.copy(), net.param_data.copy()))
    return out


@pytest.mark.parametrize("rel", ZOO_NETS, ids=[r.split("/")[-2] + "/" + r.split("/")[-1] for r in ZOO_NETS])
def test_modes_give_the_numbers_of_none(zoo, rel):
    ref = passes(zoo_net(zoo, rel, "none"))
    assert np.abs(ref[0][2]).sum() > 0
    for mode in ("reuse", "recompute"):
        got = passes(zoo_net(zoo, rel, mode))
        for (l0, o0, d0, p0), (l1, o1, d1, p1) in zip(ref, got):
            assert l0 == l1, mode
            assert o0.keys() == o1.keys()
            for k in o0:
                np.testing.assert_array_equal(o0[k], o1[k], err_msg="%s %s" % (mode, k))
            np.testing.assert_array_equal(d0, d1, err_msg=mode)
            np.testing.assert_array_equal(p0, p1, err_msg=mode)   # statistics updated once


def test_test_phase_and_layer_by_layer_runs_match(zoo):
    """A TEST net (no backward) and `time`'s layer-by-layer stepping."""
    rel = "bvlc/models/bvlc_googlenet/train_val.prototxt"
    ref = zoo_net(zoo, rel, "none", TEST)
    ref.forward_range()
    want = {n: np.array(v) for n, v, _ in ref.output_values()}
    for mode in ("reuse", "recompute"):
        net = zoo_net(zoo, rel, mode, TEST)
        net.forward_range()
        for n, v, _ in net.output_values():
            np.testing.assert_array_equal(v, want[n])
    rel = "bvlc/examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt"
    res = {}
    for mode in MODES:
        net = zoo_net(zoo, rel, mode)
        time_net(net, iterations=1, report=lambda *a: None)
        res[mode] = net.param_diff.copy()
    np.testing.assert_array_equal(res["none"], res["reuse"])
    np.testing.assert_array_equal(res["none"], res["recompute"])


def test_peak_memory_is_lower(zoo):
    """GoogLeNet and ResNet-50 at batch 1: the planned modes cut the peak of
    live activation + gradient bytes (reuse: GoogLeNet >= 50%, ResNet-50 >=
    25%; recompute: both >= 58%)."""
    got = {}
    for rel in ("bvlc/models/bvlc_googlenet/train_val.prototxt", "resnet/ResNet-50-deploy.prototxt"):
        for mode in MODES:
            m = measure(zoo_net(zoo, rel, mode))
            got[rel.split("/")[-2], mode] = m["peak_live_bytes"]
    g, r = "bvlc_googlenet", "resnet"
    assert got[g, "reuse"] <= 0.5 * got[g, "none"]
    assert got[g, "recompute"] <= 0.42 * got[g, "none"]
    assert got[r, "reuse"] < 0.75 * got[r, "none"]
    assert got[r, "recompute"] <= 0.42 * got[r, "none"]


def make_mlp(mode):
    set_random_seed(3)
    net = Net(net_param(MLP), memory=mode)
    rs = np.random.RandomState(0)
    net.blobs["data"].data[...] = rs.randn(4, 3)
    net.blobs["target"].data[...] = rs.randn(4, 2)
    return net


@pytest.mark.parametrize("mode", ["reuse", "recompute"])
def test_outputs_inputs_and_requested_blobs_keep_their_values(mode):
    ref, net = make_mlp("none"), make_mlp(mode)
    want = ref.forward(blobs=["ip1", "ip2"])
    got = net.forward(blobs=["ip1"])
    np.testing.assert_array_equal(got["loss"], want["loss"])
    np.testing.assert_array_equal(got["ip1"], want["ip1"])
    np.testing.assert_array_equal(net.blobs["data"].data, ref.blobs["data"].data)
    dref, dgot = ref.backward(diffs=["ip2"]), net.backward(diffs=["ip2"])
    np.testing.assert_array_equal(dgot["ip2"], dref["ip2"])
    np.testing.assert_array_equal(net.param_diff, ref.param_diff)
    # after backward the intermediates are freed (read-only placeholders of
    # their shape); the arrays forward returned stay valid
    assert net.blobs["ip2"].data.shape == (4, 2)
    assert net.memory.is_freed(net.blobs["ip2"]) and net.memory.is_freed(net.blobs["ip1"])
    assert not net.blobs["ip2"].data.flags.writeable
    np.testing.assert_array_equal(got["ip1"], want["ip1"])
    assert not net.memory.is_freed(net.blobs["loss"]) and not net.memory.is_freed(net.blobs["data"])
    # a second backward without a forward needs freed data: a clear error
    net.forward()
    net.backward()
    with pytest.raises(CaffeError, match="freed"):
        net.backward()


def test_a_new_batch_keeps_released_blobs_released_and_the_numbers():
    """Uneven batch shares reshape every blob often: a blob the plan released
    stays released at its new shape (no zeros allocated for it), one that
    keeps its data gets zeros, and the pass gives the numbers of ``none``."""
    ref, net = make_mlp("none"), make_mlp("reuse")
    for n in (4, 3):
        x, t = np.random.RandomState(n).randn(n, 3), np.random.RandomState(n + 9).randn(n, 2)
        for m in (ref, net):
            m.blobs["data"].reshape(n, 3)
            m.blobs["target"].reshape(n, 2)
            m.blobs["data"].data[...], m.blobs["target"].data[...] = x, t
        net.reshape()
        assert net.memory.is_freed(net.blobs["ip1"]) and net.blobs["ip1"].data.shape[0] == n
        assert not net.memory.is_freed(net.blobs["data"])
        ref.forward(), net.forward()
        ref.backward(), net.backward()
        np.testing.assert_array_equal(net.param_diff, ref.param_diff)
    fresh = Blob((2, 3))
    fresh.reshape(3, 3)
    assert fresh.data.flags.writeable and not fresh.data.any()


def test_unknown_and_gpu_only_modes():
    with pytest.raises(CaffeError, match="unknown --memory"):
        Net(net_param(MLP), memory="bogus")
    with pytest.raises(CaffeError, match="GPU"):
        Net(net_param(MLP), memory="offload")


def test_defaults_solver_reuses_python_net_keeps_every_blob(tmp_path):
    """A Net built from Python keeps every blob readable (pycaffe); the
    solver's nets, which only it reads, free what a pass no longer needs."""
    assert Net(net_param(MLP)).memory.mode == "none"
    from caffempi import get_solver
    from caffempi.proto import caffe_pb2
    sp = caffe_pb2.SolverParameter(base_lr=0.01, max_iter=1, lr_policy="fixed", snapshot_prefix=str(tmp_path / "s"))
    sp.net_param.CopyFrom(net_param(MLP))
    solver = get_solver(sp)
    assert solver.net.memory.mode == "reuse"
    assert get_solver(sp, memory="none").net.memory.mode == "none"


def test_hugepage_heap_env():
    from caffempi.memory import hugepage_heap_env
    env = hugepage_heap_env({"PATH": "/bin"})
    if not sys.platform.startswith("linux"):
        assert env is None
        return
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # appended to other tunables; set once (no re-exec loop); opt-out
    assert hugepage_heap_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hugepage_heap_env(env) is None
    assert hugepage_heap_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert hugepage_heap_env({"CAFFEMPI_MALLOC_TUNE": "0"}) is None


def test_cli_reexecs_as_a_command_only(monkeypatch):
    import caffempi.cli as cli
    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("CAFFEMPI_MALLOC_TUNE", raising=False)
    monkeypatch.setattr(sys, "argv", ["caffempi", "--help"])
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "dev", "-m", "caffempi", "--help"])
    assert cli.main(["--help"]) == 0             # called from Python with argv: no exec
    assert calls == []
    assert cli.main() == 0                        # as the command: exec (stubbed here), then runs on
    if sys.platform.startswith("linux"):
        # the same command line, the interpreter's options kept
        assert calls == [(sys.executable, [sys.executable, "-X", "dev", "-m", "caffempi", "--help"],
                          calls[0][2])]
        assert "glibc.malloc.hugetlb=1" in calls[0][2]["GLIBC_TUNABLES"]


DIVERGING = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "bn" }
layer { name: "ip1" type: "InnerProduct" bottom: "bn" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_first_nonfinite_layer_after_a_pass_in_every_mode(mode):
    """After a diverged forward and backward, the layer named is the one
    whose output first went non-finite, though in-place layers and freed
    storage have changed the tops since; asking changes no parameter."""
    set_random_seed(3)
    net = Net(net_param(DIVERGING), phase=TRAIN, memory=mode)
    net.blobs["data"].data[...] = np.random.RandomState(0).randn(4, 2, 6, 6)
    net.blobs["label"].data[...] = [0, 1, 2, 1]

    def run():
        net.clear_param_diffs()
        loss = net.forward_range()
        net.backward_range()
        return loss
    assert np.isfinite(run()) and net.first_nonfinite_layer() is None
    net.params["ip1"][0].data[0, 0] = np.inf          # ip1's outputs become infinite
    assert not np.isfinite(run())
    before, rng_before = net.param_data.copy(), get_rng_state()
    assert net.first_nonfinite_layer() == "ip1"
    np.testing.assert_array_equal(net.param_data, before)      # BatchNorm's sums untouched
    assert str(get_rng_state()) == str(rng_before)            # nor Dropout's random state
    net.params["ip1"][0].data[0, 0] = 0
    net.blobs["data"].data[0, 0, 0, 0] = np.nan       # bad input: the data layer is named
    run()
    assert net.first_nonfinite_layer() == "data"
