"""The loss and the layers' value checks read after backward is issued
(backend/reads.py, Net.PendingLoss): what a GPU net does, forced here on
NumPy.  The numbers are those of the immediate reads, and a bad label
still stops the step before any update with the layer's error."""
import numpy as np
import pytest
from google.protobuf import text_format

import caffempi.net
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver

NET = """
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 6 dim: 5 } shape { dim: 6 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "l" }
layer { name: "l2" type: "EuclideanLoss" bottom: "y" bottom: "y2" top: "e" loss_weight: 0.5 }
layer { name: "in2" type: "Input" top: "y2" input_param { shape { dim: 6 dim: 4 } } }
"""


def solver(iter_size=1, labels=(0, 1, 2, 3, 1, 2)):
    net = text_format.Merge(NET, caffe_pb2.NetParameter())
    # the second input first: layers in order
    net.layer.insert(1, net.layer.pop())
    sp = caffe_pb2.SolverParameter(net_param=net, base_lr=0.1, momentum=0.9, lr_policy="fixed",
                                   max_iter=100, display=0, random_seed=3, iter_size=iter_size)
    s = get_solver(sp)
    rs = np.random.RandomState(0)
    s.net.blobs["x"].data[...] = rs.randn(6, 5)
    s.net.blobs["y2"].data[...] = rs.randn(6, 4)
    s.net.blobs["label"].data[...] = labels
    return s


def deferred(monkeypatch):
    monkeypatch.setattr(caffempi.net, "defers_reads", lambda xp: True)


def train(s, iters):
    losses = []
    for _ in range(iters):
        s.step(1)
        losses.append(s.smoothed_loss)
    return losses, s.net.param_data.copy()


@pytest.mark.parametrize("iter_size", [1, 2])
def test_deferred_reads_give_the_same_losses_and_weights(monkeypatch, iter_size):
    now = train(solver(iter_size), 6)
    deferred(monkeypatch)
    s = solver(iter_size)
    assert all(layer.deferred_checks == [] for layer in s.net.layers)
    later = train(s, 6)
    assert now[0] == later[0]
    assert np.array_equal(now[1], later[1])


def test_a_bad_label_stops_the_step_before_the_update(monkeypatch):
    deferred(monkeypatch)
    s = solver(labels=(0, 1, 7, 3, 1, 2))
    before = s.net.param_data.copy()
    with pytest.raises(CaffeError, match=r"layer 'loss' \(SoftmaxWithLoss\): label value 7 is outside \[0, 4\)"):
        s.step(1)
    assert np.array_equal(s.net.param_data, before)
    assert s.iter == 0


def test_a_forward_that_reads_its_loss_checks_at_once(monkeypatch):
    """pycaffe's net.forward() reads the loss, so the checks run there."""
    deferred(monkeypatch)
    s = solver(labels=(0, 1, -1, 3, 1, 2))
    with pytest.raises(CaffeError, match="label value -1"):
        s.net.forward()
    assert all(layer.deferred_checks == [] for layer in s.net.layers)
