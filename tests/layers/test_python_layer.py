"""The Python layer: layers written against pycaffe's caffe.Layer (with
``import caffe``) in a module on sys.path run in a Net: BVLC's
test_python_layer cases (forward, backward, reshape, parameters, phase,
exceptions), a finite-difference gradient check of a layer with learnable
parameters, a Python loss that gives native EuclideanLoss's gradients for any
loss weight and trains a net with SGDSolver, and clear errors."""
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi
from caffempi import CaffeError, Net, TEST, TRAIN
from caffempi.common import captured_log, set_random_seed
from caffempi.layer_types.python import PYCAFFE_ALIASES
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver
from caffempi.testing.gradient_check import check_gradient, run_layer

MODULE = "cm_test_pylayers"
SOURCE = '''
import numpy as np

import caffe
import pyloss


class TimesTen(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 10 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 10 * top[0].diff


class ScaleShift(caffe.Layer):
    """y = w[c] * x + b: w (one per channel) and b learnable; param_str "w0 b"
    sets w = w0 * (1, 2, ...) and b."""

    def setup(self, bottom, top):
        w0, b = map(float, self.param_str.split())
        self.blobs.add_blob(bottom[0].channels)
        self.blobs.add_blob(1)
        self.blobs[0].data[...] = w0 * np.arange(1, bottom[0].channels + 1)
        self.blobs[1].data[...] = b

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def weights(self, x):
        return self.blobs[0].data.reshape((1, -1) + (1,) * (x.ndim - 2))

    def forward(self, bottom, top):
        x = bottom[0].data
        top[0].data[...] = self.weights(x) * x + self.blobs[1].data[0]

    def backward(self, top, propagate_down, bottom):
        x, dy = bottom[0].data, top[0].diff
        self.blobs[0].diff[...] += (dy * x).sum(axis=tuple(i for i in range(x.ndim) if i != 1))
        self.blobs[1].diff[...] += dy.sum()
        if propagate_down[0]:
            bottom[0].diff[...] = self.weights(x) * dy


class ParameterLayer(caffe.Layer):
    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[0] = 0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[0] = 1


class PhaseLayer(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape()

    def forward(self, bottom, top):
        top[0].data[()] = self.phase


class ExceptionLayer(caffe.Layer):
    def setup(self, bottom, top):
        raise RuntimeError("setup failed on purpose")


class NotALayer(object):
    pass


class RegressionData(caffe.Layer):
    """Tops x (N x D) and y = x W for a fixed W; param_str "N D seed"."""

    def setup(self, bottom, top):
        n, d, seed = map(int, self.param_str.split())
        rs = np.random.RandomState(seed)
        self.x = rs.randn(n, d)
        self.y = self.x @ rs.randn(d, 2)

    def reshape(self, bottom, top):
        top[0].reshape(*self.x.shape)
        top[1].reshape(*self.y.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.x
        top[1].data[...] = self.y

    def backward(self, top, propagate_down, bottom):
        pass


class EuclideanLoss(pyloss.EuclideanLossLayer):
    """BVLC's pyloss.py (examples/pycaffe/layers), scaled by the top's diff
    (the loss weight) as Caffe's EuclideanLossLayer is."""

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * top[0].diff[0] * self.diff / bottom[i].num
'''


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pylayers")
    (d / (MODULE + ".py")).write_text(SOURCE)
    return str(d)


EXAMPLE_LAYERS = str(Path(__file__).resolve().parents[2] / "examples" / "pycaffe" / "layers")


@pytest.fixture
def pylayers(module_dir):
    """The module and the example's pyloss on sys.path and no `caffe` in
    sys.modules, for one test."""
    modules = PYCAFFE_ALIASES + (MODULE, "pyloss")
    saved = {name: sys.modules.pop(name) for name in modules if name in sys.modules}
    sys.path[:0] = [module_dir, EXAMPLE_LAYERS]
    yield
    sys.path.remove(module_dir)
    sys.path.remove(EXAMPLE_LAYERS)
    for name in modules:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def python_layer(layer, param_str="", name="py"):
    return ('name: "%s" type: "Python" python_param { module: "%s" layer: "%s" param_str: "%s" }'
            % (name, MODULE, layer, param_str))


def net_param(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


TIMES_TEN_NET = """name: 'pythonnet' force_backward: true
input: 'data' input_shape { dim: 10 dim: 9 dim: 8 }
layer { type: 'Python' name: 'one' bottom: 'data' top: 'one'
  python_param { module: '%(m)s' layer: 'TimesTen' } }
layer { type: 'Python' name: 'two' bottom: 'one' top: 'two'
  python_param { module: '%(m)s' layer: 'TimesTen' } }
layer { type: 'Python' name: 'three' bottom: 'two' top: 'three'
  python_param { module: '%(m)s' layer: 'TimesTen' } }""" % {"m": MODULE}


def test_import_caffe_gives_caffempi_and_says_so(pylayers):
    with captured_log() as messages:
        Net(net_param(TIMES_TEN_NET), TRAIN)
        Net(net_param(TIMES_TEN_NET), TRAIN)
    assert sys.modules["caffe"] is caffempi and sys.modules["caffe.proto.caffe_pb2"] is caffe_pb2
    assert sys.modules["caffe.io"] is caffempi.io
    assert sum("'import caffe' in Python layers gives caffempi" in m for m in messages) == 1
    assert sys.modules[MODULE].TimesTen.__mro__[1] is caffempi.Layer


@pytest.mark.parametrize("memory", ["none", "reuse"])
def test_forward_backward_reshape(pylayers, memory):
    """BVLC's test_python_layer, twice over (the memory plan frees the
    intermediate tops between passes; the layers write them in place)."""
    net = Net(net_param(TIMES_TEN_NET), TRAIN, memory=memory)
    for x, dy in ((8, 7), (3, 2)):
        net.blobs["data"].data[...] = x
        net.forward()
        assert np.all(net.blobs["three"].data == 10 ** 3 * x)
        net.blobs["three"].diff[...] = dy
        net.backward()
        assert np.all(net.blobs["data"].diff == 10 ** 3 * dy)
    net.blobs["data"].reshape(4, 4, 4, 4)
    net.forward()
    assert all(blob.data.shape == (4, 4, 4, 4) for blob in net.blobs.values())
    assert net.layers[1].type == "Python" and isinstance(net.layers[1].python_layer, caffempi.Layer)


def test_scale_shift_forward_and_gradient(pylayers):
    x = np.random.RandomState(0).randn(2, 3, 2, 2)
    layer, _, top = run_layer(python_layer("ScaleShift", "0.5 0.25"), [x])
    w = 0.5 * np.arange(1, 4)
    np.testing.assert_allclose(top[0].data, w[None, :, None, None] * x + 0.25, rtol=1e-12)
    assert [b.shape for b in layer.blobs] == [(3,), (1,)] and layer.blobs[0].data.dtype == np.float64
    check_gradient(python_layer("ScaleShift", "0.5 0.25"), [x])


def test_parameters_train_save_load_and_share(pylayers, tmp_path):
    """BVLC's test_parameter: the layer's blobs are the net's params."""
    text = """name: 'pythonnet' force_backward: true
      input: 'data' input_shape { dim: 10 dim: 9 dim: 8 }
      layer { type: 'Python' name: 'layer' bottom: 'data' top: 'top'
        python_param { module: '%s' layer: 'ParameterLayer' } }""" % MODULE
    net = Net(net_param(text), TRAIN)
    net.forward()
    net.backward()
    layer = net.layers[list(net._layer_names).index("layer")]
    assert layer.blobs[0].data[0] == 0 and layer.blobs[0].diff[0] == 1
    assert net.params["layer"] is layer.blobs and net.param_data.size == 1     # in the flat buffers
    layer.blobs[0].data[0] += layer.blobs[0].diff[0]
    assert net.param_data[0] == 1
    path = str(tmp_path / "p.caffemodel")
    net.save(path)
    layer.blobs[0].data[0] = -1
    net.copy_from(path)
    assert layer.blobs[0].data[0] == 1
    net2 = Net(net_param(text), TRAIN)
    net2.share_with(net)
    assert net2.layers[list(net2._layer_names).index("layer")].blobs[0].data[0] == 1


def test_phase(pylayers):
    """The layer sees the net's phase (share_in_parallel, which has no
    meaning here, is accepted)."""
    text = """name: 'pythonnet'
      layer { type: 'Python' name: 'layer' top: 'phase'
        python_param { module: '%s' layer: 'PhaseLayer' share_in_parallel: true } }""" % MODULE
    for phase in (TRAIN, TEST):
        assert Net(net_param(text), phase).forward()["phase"] == phase


def regression_net(loss_type, loss_weight):
    """loss_type: native, python (reads its top's diff) or pyloss (does not)."""
    loss = ("type: 'EuclideanLoss'" if loss_type == "native" else
            "type: 'Python' python_param { module: '%s' layer: '%s' }"
            % (("pyloss", "EuclideanLossLayer") if loss_type == "pyloss" else (MODULE, "EuclideanLoss")))
    return net_param("""name: 'reg'
      layer { name: 'data' type: 'Python' top: 'x' top: 'y'
              python_param { module: '%s' layer: 'RegressionData' param_str: '8 3 5' } }
      layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'p'
              inner_product_param { num_output: 2 weight_filler { type: 'gaussian' std: 0.5 } } }
      layer { name: 'loss' bottom: 'p' bottom: 'y' top: 'loss' loss_weight: %g %s }"""
                     % (MODULE, loss_weight, loss))


@pytest.mark.parametrize("loss_weight", [1, 2.5])
def test_python_loss_matches_native_euclidean_loss(pylayers, loss_weight):
    grads, losses = [], []
    for kind in ("python", "native"):
        set_random_seed(7)
        net = Net(regression_net(kind, loss_weight), TRAIN, dtype=np.float64)
        losses.append(net.forward_backward())
        grads.append(net.param_diff.copy())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
    assert np.abs(grads[0]).max() > 0.1


@pytest.mark.parametrize("kind", ["python", "pyloss"])
def test_python_loss_under_data_parallel_gradient_scale(pylayers, kind):
    """On N ranks the reducer multiplies the summed gradients by 1/N after
    backward, so a pycaffe loss that ignores its top's diff (BVLC's
    pyloss.py) still gives native EuclideanLoss's averaged gradients."""
    from caffempi.parallel.comm import SingleWorld
    from caffempi.parallel.sync import BucketedAllreduce
    from caffempi.parallel.transports.base import LocalTransport

    class FourRanks(SingleWorld):
        size = 4          # the reducer's mean is 1/4 of the (here local) sum

    grads = []
    for k in (kind, "native"):
        set_random_seed(7)
        net = Net(regression_net(k, 1), TRAIN, dtype=np.float64)
        sync = BucketedAllreduce(FourRanks(), transport=LocalTransport())
        sync.start_iteration(net, 1)
        net.forward_backward()
        sync.finish(net)
        grads.append(net.param_diff.copy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
    set_random_seed(7)
    unscaled = Net(regression_net("native", 1), TRAIN, dtype=np.float64)
    unscaled.forward_backward()
    np.testing.assert_allclose(grads[1], 0.25 * unscaled.param_diff, rtol=1e-6)


def test_python_loss_trains_with_sgd(pylayers):
    sp = text_format.Parse('base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 max_iter: 100 display: 0 '
                           'snapshot: 0 random_seed: 3 solver_mode: CPU', caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(regression_net("python", 1))
    solver = get_solver(sp)
    assert type(solver).__name__ == "SGDSolver"
    before = float(solver.net.forward()["loss"][0])
    solver.step(80)
    after = float(solver.net.forward()["loss"][0])
    assert before > 0.5 and after < 1e-3 * before


def test_errors(pylayers):
    def build(layer, module=MODULE):
        return Net(net_param("""input: 'data' input_shape { dim: 2 dim: 3 }
          layer { name: 'py' type: 'Python' bottom: 'data' top: 'out'
                  python_param { module: '%s' layer: '%s' } }""" % (module, layer)), TEST)
    with pytest.raises(CaffeError, match=r"layer 'py' \(Python\): python_param.module 'no_such_mod' is not "
                                         r"importable from sys.path .*PYTHONPATH"):
        build("TimesTen", "no_such_mod")
    with pytest.raises(CaffeError, match=r"module '%s' \(.*%s.py\) has no class 'Nope'" % (MODULE, MODULE)):
        build("Nope")
    with pytest.raises(CaffeError, match=r"%s.NotALayer is not a subclass of caffempi.Layer" % MODULE):
        build("NotALayer")
    with pytest.raises(CaffeError, match="python_param needs both module and layer"):
        build("")
    with pytest.raises(RuntimeError, match="setup failed on purpose"):       # the layer's own exception
        build("ExceptionLayer")
