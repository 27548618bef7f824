"""caffempi.draw (pycaffe's caffe.draw) and tools/draw_net.py, through the
DOT source (.dot / .raw), so no Graphviz binary is needed."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from caffempi import TEST, TRAIN, draw
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]

NET = """
name: "tiny"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "x" batch_size: 16 } }
layer { name: "input" type: "Input" top: "data" top: "label" include { phase: TEST }
        input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } shape { dim: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 2 } param { lr_mult: 0 }
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" exclude { phase: TEST } }
"""


def net_param(text=NET):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def dot_text(tmp_path, name="net.dot", **kw):
    path = tmp_path / name
    draw.draw_net_to_file(net_param(), str(path), **kw)
    return path.read_text()


def edges(text):
    """(source, target, label) of every edge line of DOT text."""
    found = re.findall(r'^\s*("[^"]*"|\w+) -> ("[^"]*"|\w+) \[label=("[^"]*"|\w+)', text, re.M)
    return {(s.strip('"'), t.strip('"'), label.strip('"')) for s, t, label in found}


def test_every_layer_and_blob_is_a_node_with_edges(tmp_path):
    text = dot_text(tmp_path)
    assert text.startswith("digraph tiny {") and "rankdir=LR" in text
    layer_nodes = ["data_Data", "input_Input", "conv1_Convolution", "relu1_ReLU", "pool1_Pooling",
                   "ip_InnerProduct", "loss_SoftmaxWithLoss"]
    for node in layer_nodes + ["data_blob", "label_blob", "conv1_blob", "pool1_blob", "ip_blob", "loss_blob"]:
        assert len(re.findall(r"^%s \[" % node, text, re.M)) == 1, node
    assert edges(text) == {
        ("data_Data", "data_blob", "Batch 16"), ("data_Data", "label_blob", "Batch 16"),
        ("input_Input", "data_blob", ""), ("input_Input", "label_blob", ""),
        ("data_blob", "conv1_Convolution", ""), ("conv1_Convolution", "conv1_blob", "4"),
        ("conv1_blob", "relu1_ReLU", ""), ("relu1_ReLU", "conv1_blob", ""),
        ("conv1_blob", "pool1_Pooling", ""), ("pool1_Pooling", "pool1_blob", ""),
        ("pool1_blob", "ip_InnerProduct", ""), ("ip_InnerProduct", "ip_blob", "10"),
        ("ip_blob", "loss_SoftmaxWithLoss", ""), ("label_blob", "loss_SoftmaxWithLoss", ""),
        ("loss_SoftmaxWithLoss", "loss_blob", ""),
    }
    assert r'label="conv1\n(Convolution)\nkernel size: 3\nstride: 2\npad: 1"' in text
    assert r'label="pool1\n(Pooling AVE)\nkernel size: 2\nstride: 2\npad: 0"' in text
    assert re.search(r'^relu1_ReLU \[.*fillcolor="#90EE90"', text, re.M)        # in-place neuron style
    assert re.search(r'^conv1_Convolution \[.*fillcolor="#FF5050"', text, re.M)
    assert re.search(r'^ip_blob \[.*shape=octagon', text, re.M)


def test_phase_filter_rankdir_and_lr_mult(tmp_path):
    text = dot_text(tmp_path, "test.raw", rankdir="TB", phase=TEST, display_lrm=True)
    assert "input_Input" in text and "data_Data" not in text and "loss_SoftmaxWithLoss" not in text
    assert "rankdir=TB" in text
    assert 'label="conv1 (Convolution) kernel size: 3 stride: 2 pad: 1 lr mult: 2.0, 0.0"' in text
    assert 'label="ip (InnerProduct) lr mult: 1.0, 1.0"' in text
    train = dot_text(tmp_path, "train.dot", phase=TRAIN)
    assert "data_Data" in train and "input_Input" not in train and "loss_SoftmaxWithLoss" in train
    assert "lr mult" not in train


def test_draw_errors(tmp_path, monkeypatch):
    both = net_param('layer { name: "x" type: "ReLU" bottom: "a" top: "a" '
                     'include { phase: TRAIN } exclude { phase: TEST } }')
    with pytest.raises(CaffeError, match="layer 'x' has both include and exclude"):
        draw.get_pydot_graph(both, "LR", phase=TRAIN)
    with pytest.raises(CaffeError, match="ReLU layers do not have a learning rate multiplier"):
        draw.get_layer_lr_mult(both.layer[0])
    monkeypatch.setenv("PATH", str(tmp_path))          # no Graphviz 'dot' here
    with pytest.raises(CaffeError, match=r"\.png needs Graphviz's 'dot' program"):
        draw.draw_net(net_param(), "LR", ext="png")
    monkeypatch.setitem(sys.modules, "pydot", None)     # the 'draw' extra not installed
    with pytest.raises(CaffeError, match=r"pip install caffempi\[draw\]"):
        draw.get_pydot_graph(net_param(), "LR")


def test_draw_net_tool(tmp_path):
    proto = tmp_path / "net.prototxt"
    proto.write_text(NET)
    out = tmp_path / "net.dot"
    run = subprocess.run([sys.executable, str(REPO / "tools" / "draw_net.py"), str(proto), str(out),
                          "--phase", "TRAIN", "--rankdir", "BT"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "Drawing net to %s" % out in run.stderr
    text = out.read_text()
    assert "rankdir=BT" in text and "data_Data" in text and "input_Input" not in text
    assert ("ip_InnerProduct", "ip_blob", "10") in edges(text)
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "draw_net.py"), str(proto), str(out),
                          "--phase", "DEPLOY"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip() == "draw_net: error: unknown --phase 'DEPLOY' (TRAIN, TEST or ALL)"
