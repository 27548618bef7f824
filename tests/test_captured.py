"""CUDA graph replay's refusals (solvers/captured.py), checked on the CPU:
each setting that would make a replay a different step names itself, and
a solver whose net is not on a GPU trains as without the setting."""
import logging

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import config
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver
from caffempi.solvers.captured import CapturedSteps, leading_data_layers

NET = """
layer { name: "in" type: "Input" top: "x" top: "label" input_param { shape { dim: 4 dim: 5 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
%s
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "l" }
"""


def solver(extra="", **kw):
    net = text_format.Merge(NET % extra, caffe_pb2.NetParameter())
    sp = caffe_pb2.SolverParameter(net_param=net, base_lr=0.1, momentum=0.9, lr_policy="fixed",
                                   max_iter=100, display=0, random_seed=2, **kw)
    s = get_solver(sp)
    rs = np.random.RandomState(0)
    s.net.blobs["x"].data[...] = rs.randn(4, 5)
    s.net.blobs["label"].data[...] = [0, 1, 2, 1]
    return s


@pytest.mark.parametrize("extra,kw,reason", [
    ("", {}, "the net is not on a GPU"),
    ("", {"iter_size": 2}, "iter_size is 2"),
    ("", {"clip_gradients": 1.0}, "clip_gradients reads the gradients' norm"),
    ('layer { name: "drop" type: "Dropout" bottom: "y" top: "y" }', {},
     "layer 'drop' (Dropout) draws its mask's seed on the host"),
    ('layer { name: "py" type: "DummyData" top: "z" dummy_data_param { shape { dim: 1 } } }', {},
     "layer 'py' (DummyData) draws its data on the host"),
])
def test_each_setting_that_changes_a_replay_refuses_it(extra, kw, reason):
    assert reason in CapturedSteps(solver(extra, **kw)).refusal()


def test_solver_callbacks_refuse_replays():
    s = solver()
    s.add_callback(lambda: None, lambda: None)
    assert "callbacks" in CapturedSteps(s).refusal()


def test_leading_data_layers():
    assert leading_data_layers(solver().net) == 1


def test_a_cpu_net_trains_as_without_the_setting(caplog):
    plain = solver()
    plain.step(5)
    caplog.set_level(logging.INFO)
    with config.using_config(cuda_graph=True):
        s = solver()
        s.step(3)
        s.step(2)
    assert s.captured is not None and s.captured.replays == 0
    assert np.array_equal(s.net.param_data, plain.net.param_data) and s.smoothed_loss == plain.smoothed_loss
    said = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert said == ["CUDA graphs off: the net is not on a GPU; training runs eagerly"]
