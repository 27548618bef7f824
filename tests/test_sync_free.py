"""A training step with no host read of a device value: the GPU's rule,
checked on the CPU with caffempi.testing.strict, whose arrays raise on
float(), .item(), .get() and bool() inside the step."""
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.data import lmdb_io
from caffempi.data.datum import array_to_datum
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver
from caffempi.testing import strict
from google.protobuf import text_format

# every common layer type of Caffe's image nets, both fused chains included
NET = """
layer { name: "data" type: "Data" top: "data" top: "label"
        transform_param { scale: 0.0039 mirror: true crop_size: 10 }
        data_param { source: "%s" batch_size: 8 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "conv1" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool1" type: "Pooling" bottom: "sum" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 } }
layer { name: "pool2" type: "Pooling" bottom: "sum" top: "pool2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "cat" type: "Concat" bottom: "norm1" bottom: "pool2" top: "cat" }
layer { name: "ip1" type: "InnerProduct" bottom: "cat" top: "ip1"
        inner_product_param { num_output: 12 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "tanh" type: "TanH" bottom: "ip1" top: "ip1" }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "sig" type: "Sigmoid" bottom: "ip2" top: "sig" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" }
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "lmdb"
    rs = np.random.RandomState(0)
    with lmdb_io.LMDBWriter(str(path)) as w:
        for i in range(32):
            label = i % 4
            im = rs.randint(0, 80, (2, 12, 12)).astype(np.uint8)
            im[label % 2, 3 * label:3 * label + 4] = 250
            w.put("%08d" % i, array_to_datum(im, label).SerializeToString())
    return str(path)


def solver(source, xp, **kw):
    net = text_format.Merge(NET % source, caffe_pb2.NetParameter())
    sp = caffe_pb2.SolverParameter(net_param=net, base_lr=0.05, momentum=0.9, weight_decay=1e-3,
                                   lr_policy="step", stepsize=3, gamma=0.5, max_iter=100, display=0,
                                   random_seed=5, **kw)
    return get_solver(sp, xp=xp)


def test_trap_catches_a_host_read():
    a = strict.module.ones(3)
    with strict.refusing_reads():
        for read in (lambda: float(a.sum()), lambda: a.max().item(), lambda: bool((a > 0).all()),
                     lambda: a.get(), lambda: int(a[0:1].sum()), lambda: float(strict.module.dot(a, a))):
            with pytest.raises(strict.HostRead):
                read()
    assert float(a.sum()) == 3.0                 # outside the block reads are free


@pytest.mark.parametrize("kw", [{}, {"iter_size": 2}, {"clip_gradients": 0.2}])
def test_training_steps_read_nothing_from_the_device(source, kw, caplog):
    s = solver(source, strict.module, **kw)
    caplog.set_level("INFO")
    with strict.refusing_reads():
        s.step(6)
    assert s.iter == 6 and np.isfinite(s.smoothed_loss)
    assert isinstance(s.net.param_data, strict.StrictArray)      # the step ran on the strict arrays
    deferred_log = [r.getMessage() for r in caplog.records if "clipping" in r.getMessage()]
    caplog.clear()
    # the same numbers and messages as on NumPy, whose reads are immediate
    reference = solver(source, np, **kw)
    reference.step(6)
    assert s.smoothed_loss == reference.smoothed_loss
    assert np.array_equal(np.asarray(s.net.param_data), reference.net.param_data)
    assert deferred_log == [r.getMessage() for r in caplog.records if "clipping" in r.getMessage()]
    if "clip_gradients" in kw:
        assert len(deferred_log) >= 3             # the threshold binds


def test_a_forward_that_reads_its_loss_is_caught(source):
    """pycaffe's net.forward() returns the loss as a float: a host read."""
    s = solver(source, strict.module)
    with strict.refusing_reads(), pytest.raises(strict.HostRead):
        s.net.forward()


# more layer types, each a branch from x flattened into one product, and
# every loss at once: none of them reads a device value in the step
BRANCHES = [
    'type: "Deconvolution" bottom: "x" convolution_param { num_output: 3 kernel_size: 2 stride: 2 '
    'weight_filler { type: "gaussian" std: 0.1 } }',
    'type: "Bias" bottom: "x"', 'type: "Power" bottom: "x" power_param { power: 2 scale: 0.5 shift: 1 }',
    'type: "Exp" bottom: "x"', 'type: "ELU" bottom: "x"', 'type: "PReLU" bottom: "x"', 'type: "AbsVal" bottom: "x"',
    'type: "BNLL" bottom: "x"', 'type: "Swish" bottom: "x"', 'type: "Clip" bottom: "x" clip_param { min: -0.5 max: 0.5 }',
    'type: "Log" bottom: "xp"', 'type: "MVN" bottom: "x"', 'type: "Softmax" bottom: "x"',
    'type: "Eltwise" bottom: "x" bottom: "x2" eltwise_param { operation: MAX }',
    'type: "Eltwise" bottom: "x" bottom: "x2" eltwise_param { operation: PROD }',
    'type: "SPP" bottom: "x" spp_param { pyramid_height: 2 }', 'type: "Crop" bottom: "x" bottom: "x3" crop_param { axis: 2 offset: 1 }',
    'type: "Tile" bottom: "x" tile_param { axis: 1 tiles: 2 }', 'type: "Im2col" bottom: "x" convolution_param { kernel_size: 2 }',
    'type: "LRN" bottom: "x" lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 }',
    'type: "BatchReindex" bottom: "x" bottom: "pick"',
    'type: "Embed" bottom: "label" embed_param { num_output: 3 input_dim: 4 weight_filler { type: "gaussian" } }',
    'type: "Reshape" bottom: "x" reshape_param { shape { dim: 0 dim: -1 } }',
]
WIDE = """
layer { name: "in" type: "Input" top: "x0" top: "x2" top: "x3" top: "label" top: "pick" top: "target" top: "binary"
        input_param { shape { dim: 2 dim: 2 dim: 4 dim: 4 } shape { dim: 2 dim: 2 dim: 4 dim: 4 }
                      shape { dim: 2 dim: 2 dim: 2 dim: 2 } shape { dim: 2 } shape { dim: 2 } shape { dim: 2 dim: 4 }
                      shape { dim: 2 dim: 4 } } }
layer { name: "c" type: "Convolution" bottom: "x0" top: "x"
        convolution_param { num_output: 2 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "pos" type: "Power" bottom: "x" top: "xp" power_param { power: 2 shift: 0.5 } }
%s
layer { name: "cat" type: "Concat" %s top: "cat" }
layer { name: "f" type: "InnerProduct" bottom: "cat" top: "f"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "p" type: "Softmax" bottom: "f" top: "p" }
layer { name: "l1" type: "EuclideanLoss" bottom: "f" bottom: "target" top: "l1" }
layer { name: "l2" type: "SigmoidCrossEntropyLoss" bottom: "f" bottom: "binary" top: "l2" }
layer { name: "l3" type: "HingeLoss" bottom: "f" bottom: "label" top: "l3" }
layer { name: "l4" type: "SoftmaxWithLoss" bottom: "f" bottom: "label" top: "l4"
        loss_param { ignore_label: 1 normalization: VALID } }
layer { name: "l5" type: "MultinomialLogisticLoss" bottom: "p" bottom: "label" top: "l5" }
layer { name: "l6" type: "ContrastiveLoss" bottom: "f" bottom: "target" bottom: "pick" top: "l6" }
"""


def wide_solver(xp):
    branches, flat = [], []
    for k, text in enumerate(BRANCHES):
        branches.append('layer { name: "b%d" %s top: "b%d" }' % (k, text, k))
        branches.append('layer { name: "fl%d" type: "Flatten" bottom: "b%d" top: "fl%d" }' % (k, k, k))
        flat.append('bottom: "fl%d"' % k)
    net = text_format.Merge(WIDE % ("\n".join(branches), " ".join(flat)), caffe_pb2.NetParameter())
    sp = caffe_pb2.SolverParameter(net_param=net, base_lr=0.01, momentum=0.9, lr_policy="fixed",
                                   max_iter=100, display=0, random_seed=4)
    s = get_solver(sp, xp=xp)
    rs = np.random.RandomState(3)
    for name in ("x0", "x2", "x3", "target"):
        s.net.blobs[name].data[...] = xp.asarray(rs.randn(*s.net.blobs[name].shape))
    s.net.blobs["label"].data[...] = xp.asarray([0., 2.])
    s.net.blobs["pick"].data[...] = xp.asarray([1., 0.])
    s.net.blobs["binary"].data[...] = xp.asarray(rs.randint(0, 2, (2, 4)).astype(float))
    return s


def test_more_layer_types_and_every_loss_read_nothing():
    s = wide_solver(strict.module)
    with strict.refusing_reads():
        s.step(3)
    reference = wide_solver(np)
    reference.step(3)
    assert np.isfinite(s.smoothed_loss) and s.smoothed_loss == reference.smoothed_loss
    assert np.array_equal(np.asarray(s.net.param_data), reference.net.param_data)


def test_bad_indices_stop_the_step_with_the_layers_error():
    """Embed's and BatchReindex's index checks wait for the loss's read, as
    the label check does, and still stop the step before the update."""
    for blob, value, message in (("label", [0., 7.], r"layer 'b21' \(Embed\): bottom \(2,\) holds indices"),
                                 ("pick", [0., 5.], r"layer 'b20' \(BatchReindex\): index 5 \(entry 1")):
        s = wide_solver(strict.module)
        s.net.blobs[blob].data[...] = value
        before = np.asarray(s.net.param_data).copy()
        with strict.refusing_reads(), pytest.raises(CaffeError, match=message):
            s.step(1)
        assert np.array_equal(np.asarray(s.net.param_data), before)
