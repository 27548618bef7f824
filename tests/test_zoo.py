"""Real Caffe prototxts from ../shared/caffe-zoo build with Caffe's blob shapes
and run forward and backward at batch 1."""
import subprocess
import sys

import numpy as np
import pytest

from caffempi import Net, TEST, TRAIN
from caffempi.common import set_random_seed
from caffempi.io import proto_io
from caffempi.timing import randomize_inputs, substitute_data_layers, time_net

# Per-image shape of the data layers whose prototxt does not say it (no crop).
DATA_SHAPES = {
    "lenet_train_test": (1, 28, 28), "mnist_autoencoder": (1, 28, 28),
    "mnist_siamese_train_test": (2, 28, 28), "hdf5_classification/train_val": (4,),
    "cifar10_quick_train_test": (3, 32, 32), "cifar10_full_train_test": (3, 32, 32),
    "cifar10_full_sigmoid_train_test": (3, 32, 32), "cifar10_full_sigmoid_train_test_bn": (3, 32, 32),
    "nonlinear_auto_train": (4,), "nonlinear_auto_test": (4,), "nonlinear_train_val": (4,),
}

# Nets whose TEST phase needs a stage (their solver's test_state gives it).
TEST_STAGES = {"mnist_autoencoder": ["test-on-test"]}

# (file, blob, shape Caffe gives at batch 1)
KNOWN_SHAPES = [
    ("bvlc/models/bvlc_alexnet/deploy.prototxt", "pool5", (1, 256, 6, 6)),
    ("bvlc/models/bvlc_alexnet/train_val.prototxt", "pool5", (1, 256, 6, 6)),
    ("bvlc/models/bvlc_reference_caffenet/deploy.prototxt", "pool5", (1, 256, 6, 6)),
    ("bvlc/models/bvlc_googlenet/deploy.prototxt", "inception_5b/output", (1, 1024, 7, 7)),
    ("bvlc/models/bvlc_googlenet/deploy.prototxt", "pool5/7x7_s1", (1, 1024, 1, 1)),
    ("resnet/ResNet-50-deploy.prototxt", "pool5", (1, 2048, 1, 1)),
    ("resnet/ResNet-50-deploy.prototxt", "res2a", (1, 256, 56, 56)),
    ("resnet/ResNet-101-deploy.prototxt", "pool5", (1, 2048, 1, 1)),
    ("resnet/ResNet-152-deploy.prototxt", "pool5", (1, 2048, 1, 1)),
    ("squeezenet/v1.0/deploy.prototxt", "pool10", (1, 1000, 1, 1)),
    ("squeezenet/v1.1/deploy.prototxt", "pool10", (1, 1000, 1, 1)),
    ("bvlc/examples/cifar10/cifar10_quick.prototxt", "pool3", (1, 64, 4, 4)),
    ("bvlc/examples/mnist/lenet.prototxt", "pool2", (1, 50, 4, 4)),
]


def net_files(zoo):
    return sorted(p for p in zoo.rglob("*.prototxt") if "solver" not in p.name)


def batch1_param(path):
    """The net with data layers replaced by random input and batch size 1."""
    param = proto_io.read_net_param(str(path))
    shape = DATA_SHAPES.get(path.stem, DATA_SHAPES.get(path.parent.name + "/" + path.stem))
    param = substitute_data_layers(param, shape, only_unreadable=False, warn=False, batch_size=1)
    for lp in param.layer:
        if lp.type == "Input":
            for s in lp.input_param.shape:
                s.dim[0] = 1
    return param


def build(zoo, rel, phase=TEST):
    path = zoo / rel
    return Net(batch1_param(path), phase=phase, source_name=str(path))


@pytest.mark.parametrize("rel,blob,shape", KNOWN_SHAPES, ids=[f"{r}:{b}" for r, b, _ in KNOWN_SHAPES])
def test_blob_shapes_match_caffe(zoo, rel, blob, shape):
    net = build(zoo, rel)
    assert net.blobs[blob].shape == shape


def test_every_zoo_net_runs_forward_backward(zoo):
    """Every net in both phases: forward and backward at batch 1, finite,
    with gradients reaching the first learnable layer.  The weights are
    drawn from a fixed seed: at batch 1 a loss can be zero by chance (the
    siamese net's one pair, labelled dissimilar, farther apart than the
    margin), and the draws must not depend on the tests run before."""
    ran = []
    for path in net_files(zoo):
        for phase in (TRAIN, TEST):
            stages = TEST_STAGES.get(path.stem, []) if phase == TEST else []
            set_random_seed(1)
            net = Net(batch1_param(path), phase=phase, stages=stages, source_name=str(path))
            randomize_inputs(net)
            loss = net.forward_range()
            net.clear_param_diffs()
            net.backward_range()
            assert np.isfinite(loss), (path, phase)
            assert net.first_nonfinite_layer() is None, (path, phase)
            assert np.isfinite(net.param_diff).all(), (path, phase)
            if phase == TRAIN and net.param_diff.size and any(w for w in net.loss_weights):
                assert np.abs(net.param_diff).sum() > 0, path
                lines = []
                result = time_net(net, 1, report=lambda *a: lines.append(a[0] % a[1:]))
                assert len(result["layers"]) == len(net.layers)
                # one step: its median is that step, which spans both passes
                assert result["median_forward_backward_ms"] >= result["forward_backward_ms"] > 0
                assert any(l.startswith("Average Forward-Backward") for l in lines)
            ran.append((path.name, phase))
    assert len(ran) >= 2 * 26


@pytest.mark.parametrize("rel,extra", [
    ("bvlc/examples/cifar10/cifar10_quick_train_test.prototxt", ["--data_shape=3,32,32"]),
    ("squeezenet/v1.1/deploy.prototxt", []),
])
def test_time_command_on_zoo_nets(zoo, rel, extra):
    """`caffempi time` on a train_val net with unreadable data (random input
    with a warning) and on a deploy net."""
    out = subprocess.run([sys.executable, "-m", "caffempi", "time", "--model=%s" % (zoo / rel),
                          "--iterations=1"] + extra, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Average Forward pass" in out.stderr and "Average Backward pass" in out.stderr
    assert "Average Forward-Backward" in out.stderr
    if extra:
        assert "random input" in out.stderr


def test_time_command_needs_image_size(zoo):
    rel = "bvlc/examples/cifar10/cifar10_quick_train_test.prototxt"
    out = subprocess.run([sys.executable, "-m", "caffempi", "time", "--model=%s" % (zoo / rel),
                          "--iterations=1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "--data_shape" in out.stderr and "Traceback" not in out.stderr
