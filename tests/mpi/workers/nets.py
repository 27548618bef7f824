"""Small deterministic nets and data for the MPI tests (no DummyData)."""
import numpy as np
from google.protobuf import text_format

from caffempi.proto import caffe_pb2

MLP = """
name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: %(b)d dim: 3 dim: 6 dim: 6 } shape { dim: %(b)d } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 20 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 16 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.0 } } }
layer { name: "relu2" type: "ReLU" bottom: "ip2" top: "ip2" }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip3" bottom: "label" top: "accuracy" }
"""


def net_param(batch):
    p = caffe_pb2.NetParameter()
    text_format.Merge(MLP % {"b": batch}, p)
    return p


def global_batch(it, batch, seed=5):
    """The it-th global batch (records it*batch .. it*batch+batch-1)."""
    r = np.random.RandomState(seed + it)
    x = r.randn(batch, 3, 6, 6).astype(np.float32)
    y = r.randint(0, 5, size=batch).astype(np.float32)
    return x, y


def shard(x, rank, size):
    """Records i with i % size == rank (the data layers' sharding)."""
    return x[rank::size]
