"""BatchNorm and MVN: forward values and running statistics against plain
NumPy, parameter shapes, finite-difference gradients."""
import numpy as np
import pytest

from caffempi.blob import Blob
from caffempi.common import TEST, TRAIN
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def ref_batch_norm_train(x, blobs, maf, eps):
    """Loops over channels: output and updated running blobs."""
    c = x.shape[1]
    y = np.empty_like(x)
    mean_sum, var_sum, factor = (b.copy() for b in blobs)
    for ch in range(c):
        v = x[:, ch].reshape(-1)
        m = v.size
        mu = v.sum() / m
        var = ((v - mu) ** 2).sum() / m
        y[:, ch] = (x[:, ch] - mu) / np.sqrt(var + eps)
        mean_sum[ch] = mean_sum[ch] * maf + mu
        var_sum[ch] = var_sum[ch] * maf + var * m / (m - 1)
    factor = factor * maf + 1
    return y, [mean_sum, var_sum, factor]


def set_blobs(layer, values):
    for blob, v in zip(layer.blobs, values):
        blob.data = np.asarray(v, float).copy()


def test_batch_norm_blob_shapes():
    layer, _, _ = run_layer('type: "BatchNorm"', [rand(2, 3, 2, 2)])
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    layer, _, _ = run_layer('type: "BatchNorm"', [rand(5)])
    assert [b.shape for b in layer.blobs] == [(1,), (1,), (1,)]


def test_batch_norm_train_forward_and_running_stats():
    x = rand(3, 2, 2, 3) * 2 + 1
    layer = make_layer('type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 }')
    start = [np.array([0.5, -1.0]), np.array([2.0, 3.0]), np.array([1.7])]
    _, bottom, top = run_layer(layer, [x])  # first pass from zeros
    maf, eps = float(np.float32(0.9)), float(np.float32(0.001))
    y, blobs = ref_batch_norm_train(x, [np.zeros(2), np.zeros(2), np.zeros(1)], maf, eps)
    np.testing.assert_allclose(top[0].data, y, rtol=1e-10, atol=1e-12)
    for got, want in zip(layer.blobs, blobs):
        np.testing.assert_allclose(got.data, want, rtol=1e-10)
    # Second pass from non-zero running sums.
    set_blobs(layer, start)
    layer.forward(bottom, top)
    y, blobs = ref_batch_norm_train(x, start, maf, eps)
    np.testing.assert_allclose(top[0].data, y, rtol=1e-10, atol=1e-12)
    for got, want in zip(layer.blobs, blobs):
        np.testing.assert_allclose(got.data, want, rtol=1e-10)


def test_batch_norm_2d_input():
    x = rand(4, 3)
    layer, _, top = run_layer('type: "BatchNorm"', [x])
    y, _ = ref_batch_norm_train(x[:, :, None], [np.zeros(3)] * 2 + [np.zeros(1)], 0.999, 1e-5)
    np.testing.assert_allclose(top[0].data, y[:, :, 0], rtol=1e-5)


@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm"', TEST),
    ('type: "BatchNorm" batch_norm_param { use_global_stats: true }', TRAIN),
])
def test_batch_norm_global_stats_forward(text, phase):
    x = rand(2, 3, 2, 2)
    layer = make_layer(text, phase=phase)
    blobs = [np.array([1.0, -2.0, 0.5]), np.array([4.0, 2.0, 8.0]), np.array([2.0])]
    _, bottom, top = run_layer(layer, [x], phase=phase)
    assert layer.use_global_stats
    set_blobs(layer, blobs)
    layer.forward(bottom, top)
    eps = float(np.float32(1e-5))
    y = np.empty_like(x)
    for ch in range(3):
        y[:, ch] = (x[:, ch] - blobs[0][ch] / 2.0) / np.sqrt(blobs[1][ch] / 2.0 + eps)
    np.testing.assert_allclose(top[0].data, y, rtol=1e-10)
    # Running blobs are left alone.
    for got, want in zip(layer.blobs, blobs):
        np.testing.assert_array_equal(got.data, want)


def test_batch_norm_zero_scale_factor_means_zero_stats():
    x = rand(2, 3)
    layer, _, top = run_layer('type: "BatchNorm"', [x], phase=TEST)
    np.testing.assert_allclose(top[0].data, x / np.sqrt(float(np.float32(1e-5))), rtol=1e-10)


def test_batch_norm_train_can_be_forced_off_global():
    layer, _, _ = run_layer('type: "BatchNorm" batch_norm_param { use_global_stats: false }',
                            [rand(2, 3)], phase=TEST)
    assert not layer.use_global_stats
    assert layer.blobs[2].data[0] == 1


@pytest.mark.parametrize("shape", [(3, 2, 2, 2), (4, 3)])
def test_batch_norm_train_gradient(shape):
    check_gradient('type: "BatchNorm"', [rand(*shape)], check_params=False)


def test_batch_norm_global_gradient():
    layer = make_layer('type: "BatchNorm"', phase=TEST)
    layer.blobs = [layer.new_blob(s) for s in ((3,), (3,), (1,))]
    set_blobs(layer, [np.array([1.0, -2.0, 0.5]), np.array([4.0, 2.0, 8.0]), np.array([2.0])])
    check_gradient(layer, [rand(2, 3, 2, 2)], check_params=False, phase=TEST)


def ref_mvn(x, normalize_variance, across_channels, eps):
    y = np.empty_like(x)
    for n in range(x.shape[0]):
        groups = [slice(None)] if across_channels else range(x.shape[1])
        for g in groups:
            v = x[n, g]
            out = v - v.mean()
            if normalize_variance:
                out = out / (np.sqrt(((v - v.mean()) ** 2).mean()) + eps)
            y[n, g] = out
    return y


FLAGS = [(nv, ac) for nv in (True, False) for ac in (True, False)]


def mvn(nv, ac, extra=""):
    return 'type: "MVN" mvn_param { normalize_variance: %s across_channels: %s %s }' % (
        str(nv).lower(), str(ac).lower(), extra)


@pytest.mark.parametrize("nv,ac", FLAGS)
def test_mvn_forward(nv, ac):
    x = rand(2, 3, 2, 3) * 3 + 2
    _, _, top = run_layer(mvn(nv, ac, "eps: 0.01"), [x])
    np.testing.assert_allclose(top[0].data, ref_mvn(x, nv, ac, float(np.float32(0.01))), rtol=1e-10)


@pytest.mark.parametrize("nv,ac", FLAGS)
def test_mvn_gradient(nv, ac):
    check_gradient(mvn(nv, ac), [rand(2, 3, 2, 2)])


@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm"', TRAIN), ('type: "BatchNorm"', TEST), (mvn(True, False), TRAIN),
])
def test_in_place_matches_out_of_place(text, phase):
    x, dy = rand(2, 3, 2), rand(2, 3, 2, seed=1)
    layer, bottom, top = run_layer(text, [x], phase=phase)
    top[0].diff = dy.copy()
    layer.backward(top, [True], bottom)
    blob = Blob(x.shape, np, np.float64)
    blob.data = x.copy()
    inplace = make_layer(text, phase=phase)
    inplace.setup([blob], [blob])
    inplace.reshape([blob], [blob])
    inplace.forward([blob], [blob])
    np.testing.assert_allclose(blob.data, top[0].data)
    if layer.type == "BatchNorm":
        blob.data[...] = 0  # a later in-place layer may overwrite the output (Caffe copes)
    blob.diff = dy.copy()
    inplace.backward([blob], [True], [blob])
    np.testing.assert_allclose(blob.diff, bottom[0].diff)


@pytest.mark.parametrize("text,phase", [
    ('type: "BatchNorm"', TRAIN), ('type: "BatchNorm"', TEST), (mvn(True, True), TRAIN),
    (mvn(False, False), TRAIN),
])
def test_float32_stays_float32(text, phase):
    layer, bottom, top = run_layer(text, [rand(2, 3, 2)], phase=phase, dtype=np.float32)
    assert top[0].data.dtype == np.float32
    assert all(b.data.dtype == np.float32 for b in layer.blobs)
    top[0].diff = np.ones(top[0].shape, np.float32)
    layer.backward(top, [True], bottom)
    assert bottom[0].diff.dtype == np.float32


# ------------------------------------------------- NVCaffe's scale_bias
SCALE_BIAS = 'type: "BatchNorm" batch_norm_param { scale_bias: true eps: 0.001 }'


def test_batch_norm_scale_bias_blobs_and_fillers():
    layer, _, _ = run_layer(SCALE_BIAS, [rand(2, 3, 2, 2)])
    assert layer.scale_bias and [b.shape for b in layer.blobs] == [(3,), (3,), (1,), (3,), (3,)]
    np.testing.assert_array_equal(layer.blobs[3].data, np.ones(3))      # NVCaffe's defaults
    np.testing.assert_array_equal(layer.blobs[4].data, np.zeros(3))
    # either filler implies scale_bias, as in NVCaffe
    layer, _, _ = run_layer('type: "BatchNorm" batch_norm_param { scale_filler { type: "constant" value: 2 } '
                            'bias_filler { type: "constant" value: 0.5 } }', [rand(2, 3)])
    np.testing.assert_array_equal(layer.blobs[3].data, [2, 2, 2])
    np.testing.assert_array_equal(layer.blobs[4].data, [0.5, 0.5, 0.5])
    layer, _, _ = run_layer('type: "BatchNorm" batch_norm_param { bias_filler { type: "constant" value: 1 } }',
                            [rand(2, 3)])
    assert len(layer.blobs) == 5 and layer.blobs[3].data[0] == 1


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_batch_norm_scale_bias_forward(phase):
    x = rand(3, 2, 2, 3) * 2 + 1
    layer = make_layer(SCALE_BIAS, phase=phase)
    _, bottom, top = run_layer(layer, [x], phase=phase)
    stats = [np.array([0.5, -1.0]), np.array([2.0, 3.0]), np.array([1.7])]
    scale, bias = np.array([1.5, -0.5]), np.array([0.25, 2.0])
    set_blobs(layer, stats + [scale, bias])
    layer.forward(bottom, top)
    eps = float(np.float32(0.001))
    if phase == TRAIN:
        xhat, _ = ref_batch_norm_train(x, stats, 0.999, eps)
    else:
        xhat = np.empty_like(x)
        for ch in range(2):
            xhat[:, ch] = (x[:, ch] - stats[0][ch] / 1.7) / np.sqrt(stats[1][ch] / 1.7 + eps)
    want = np.empty_like(x)
    for ch in range(2):
        want[:, ch] = xhat[:, ch] * scale[ch] + bias[ch]
    np.testing.assert_allclose(top[0].data, want, rtol=1e-10, atol=1e-12)


def test_batch_norm_scale_bias_gradient():
    layer = make_layer(SCALE_BIAS)
    layer.blobs = [layer.new_blob(s) for s in ((3,), (3,), (1,), (3,), (3,))]
    set_blobs(layer, [np.zeros(3), np.zeros(3), np.zeros(1), np.array([1.5, -0.5, 0.8]), np.array([0.1, 0.2, -0.3])])
    check_gradient(layer, [rand(3, 3, 2, 2)])          # bottom, scale and bias (statistics: no gradient)


def test_batch_norm_scale_bias_global_gradient():
    layer = make_layer(SCALE_BIAS, phase=TEST)
    layer.blobs = [layer.new_blob(s) for s in ((2,), (2,), (1,), (2,), (2,))]
    set_blobs(layer, [np.array([1.0, -2.0]), np.array([4.0, 2.0]), np.array([2.0]), np.array([1.5, -0.5]),
                      np.array([0.1, 0.2])])
    check_gradient(layer, [rand(2, 2, 3)], check_params=False, phase=TEST)


def test_batch_norm_scale_bias_params_learn_statistics_do_not():
    from google.protobuf import text_format
    from caffempi import CaffeError, Net
    from caffempi.proto import caffe_pb2
    text = '''layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
              layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" batch_norm_param { scale_bias: true } %s }'''
    net = Net(text_format.Parse(text % "", caffe_pb2.NetParameter()), TRAIN)
    assert net.param_lr_mults == [0, 0, 0, 1, 1] and net.param_decay_mults == [0, 0, 0, 1, 1]
    net = Net(text_format.Parse(text % "param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } "
                                "param { lr_mult: 2 decay_mult: 0 } param { lr_mult: 3 }", caffe_pb2.NetParameter()),
              TRAIN)
    assert net.param_lr_mults == [0, 0, 0, 2, 3] and net.param_decay_mults[3:] == [0, 1]
    with pytest.raises(CaffeError, match="layer 'bn': cannot configure BatchNorm statistics"):
        Net(text_format.Parse(text % "param { lr_mult: 1 }", caffe_pb2.NetParameter()), TRAIN)


# ----------------------------------------------------- BatchNorm → Scale → ReLU, fused
def chain_net(relu=True, bias=True, global_stats=False, in_place=True, shape=(8, 6, 20, 20)):
    """A net with Caffe's BatchNorm → Scale → ReLU chain on a convolution's top."""
    from caffempi.proto import caffe_pb2
    from google.protobuf import text_format
    top = "c" if in_place else "b"
    text = """force_backward: true
    layer { name: "in" type: "Input" top: "x" input_param { shape { %s } } }
    layer { name: "c" type: "Convolution" bottom: "x" top: "c"
            convolution_param { num_output: 24 kernel_size: 1 } }
    layer { name: "bn" type: "BatchNorm" bottom: "c" top: "%s" %s }
    layer { name: "sc" type: "Scale" bottom: "%s" top: "%s" scale_param { bias_term: %s } }
    """ % (" ".join("dim: %d" % d for d in shape), top,
           "batch_norm_param { use_global_stats: true }" if global_stats else "",
           top, top, "true" if bias else "false")
    if relu:
        text += 'layer { name: "r" type: "ReLU" bottom: "%s" top: "%s" }\n' % (top, top)
    text += ('layer { name: "ip" type: "InnerProduct" bottom: "%s" top: "y" '
             'inner_product_param { num_output: 3 } }\n' % top)
    return text_format.Merge(text, caffe_pb2.NetParameter())


def run_chain(fuse, dtype=np.float32, memory=None, **kw):
    """(net, [output, bottom diff, every param's diff and data]) after a forward and backward."""
    from caffempi import config
    from caffempi.net import Net
    param = chain_net(**kw)
    with config.using_config(fuse=fuse):
        net = Net(param, TRAIN, dtype=dtype, memory=memory)
    for k, name in enumerate(net.params):
        for j, blob in enumerate(net.params[name]):
            values = rand(*blob.data.shape, seed=10 * k + j)
            blob.data[...] = np.abs(values) + 0.5 if name == "bn" else values
    net.blobs["x"].data[...] = rand(*net.blobs["x"].data.shape, seed=1)
    net.forward()
    net.blobs["y"].diff[...] = rand(*net.blobs["y"].data.shape, seed=2)
    net.backward(diffs=["x"])
    seen = {"y": net.blobs["y"].data.copy(), "x diff": net.blobs["x"].diff.copy()}
    for name in net.params:
        for j, blob in enumerate(net.params[name]):
            seen["%s %d diff" % (name, j)], seen["%s %d" % (name, j)] = blob.diff.copy(), blob.data.copy()
    return net, seen


@pytest.mark.parametrize("kw", [{}, {"relu": False}, {"bias": False}, {"global_stats": True},
                                {"in_place": False}, {"memory": "reuse"}, {"shape": (2, 6, 3, 5)}])
def test_fused_chain_gives_the_layers_numbers_bitwise(kw, monkeypatch):
    from caffempi.layer_types.scale import ScaleLayer
    _, alone = run_chain(False, **kw)
    # the fused net never runs Scale's own forward or backward
    monkeypatch.setattr(ScaleLayer, "forward", lambda *a: pytest.fail("Scale ran by itself"))
    monkeypatch.setattr(ScaleLayer, "backward", lambda *a: pytest.fail("Scale ran by itself"))
    _, fused = run_chain(True, **kw)
    assert fused.keys() == alone.keys()
    for key in alone:
        assert np.array_equal(fused[key], alone[key]), key


def test_fused_chain_is_not_used_under_recompute(monkeypatch):
    from caffempi.layer_types.normalization import BatchNormLayer
    _, alone = run_chain(False, memory="recompute")
    monkeypatch.setattr(BatchNormLayer, "forward_chain", lambda *a: pytest.fail("fused under recompute"))
    _, fused = run_chain(True, memory="recompute")
    for key in alone:
        assert np.array_equal(fused[key], alone[key]), key


def test_passes_that_end_or_start_inside_the_chain_run_its_layers_one_by_one():
    """Passes that cover part of the chain give the numbers of the layers
    one by one: forward to the BatchNorm, on from the Scale; backward from
    the Scale after a fused forward (whose states serve the layers alone)."""
    def passes(fuse):
        net, _ = run_chain(fuse)
        net.forward(end="bn")
        seen = [net.blobs["c"].data.copy()]
        net.forward(start="sc")
        seen.append(net.blobs["y"].data.copy())
        net.forward()
        for blob in (b for name in net.params for b in net.params[name]):
            blob.diff[...] = 0
        net.blobs["y"].diff[...] = rand(*net.blobs["y"].data.shape, seed=3)
        net.backward(end="r")
        net.backward(start="sc", diffs=["x"])
        return seen + [net.blobs["x"].diff.copy()] + [b.diff.copy() for name in net.params for b in net.params[name]]
    fused, alone = passes(True), passes(False)
    for a, b in zip(fused, alone):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("global_stats", [False, True])
def test_fused_chain_finite_differences(global_stats):
    """The fused backward against central differences of the net's output
    (float64), for the input and the Scale's params."""
    net, _ = run_chain(True, dtype=np.float64, global_stats=global_stats, shape=(3, 6, 4, 4))
    weights = rand(*net.blobs["y"].data.shape, seed=5)

    def objective():
        net.forward()
        return float((net.blobs["y"].data * weights).sum())
    objective()
    for name in net.params:
        for blob in net.params[name]:
            blob.diff[...] = 0
    net.blobs["y"].diff[...] = weights
    net.backward(diffs=["x"])
    analytic = {"x": net.blobs["x"].diff.copy(), "scale": net.params["sc"][0].diff.copy(),
                "bias": net.params["sc"][1].diff.copy()}
    bn_stats = [b.data.copy() for b in net.params["bn"]]
    h = 1e-5
    for key, array in (("x", net.blobs["x"].data), ("scale", net.params["sc"][0].data),
                       ("bias", net.params["sc"][1].data)):
        flat = array.reshape(-1)
        for k in np.random.RandomState(7).choice(flat.size, 6, replace=False):
            numeric = []
            for step in (h, -h):
                flat[k] += step
                for blob, stats in zip(net.params["bn"], bn_stats):   # the same statistics each time
                    blob.data[...] = stats
                numeric.append(objective())
                flat[k] -= step
            estimate = (numeric[0] - numeric[1]) / (2 * h)
            assert abs(analytic[key].reshape(-1)[k] - estimate) <= 1e-6 * max(1.0, abs(estimate)), (key, k)


# ------------------------------------------- compiled per-channel kernels (backend/channels.py)
def compiled_runs():
    from caffempi.backend import channels
    x = np.zeros((1, 1, 1), np.float32)
    return channels.available(x)


needs_compiled = pytest.mark.skipif(not compiled_runs(), reason="the compiled kernels do not run here")


@needs_compiled
@pytest.mark.parametrize("kw", [{}, {"relu": False}, {"bias": False}, {"global_stats": True},
                                {"shape": (3, 6, 7, 9)}, {"shape": (2, 6, 1, 1)}])
@pytest.mark.parametrize("fuse", [True, False])
def test_compiled_passes_match_numpys(kw, fuse):
    """float32 through the compiled kernels against the NumPy blocks: the
    same within float32 rounding of sums over a channel."""
    from caffempi import config
    with config.using_config(fuse=fuse):
        _, compiled = run_chain(True, **kw)
        with config.using_config(compiled_channels=False):
            _, numpy_blocks = run_chain(True, **kw)
    # not the convolution's bias gradient: the sum of dx over a channel,
    # zero but for rounding (BatchNorm's dx has a zero mean)
    del compiled["c 1 diff"]
    for key in compiled:
        np.testing.assert_allclose(compiled[key], numpy_blocks[key], rtol=2e-5,
                                   atol=2e-5 * max(1.0, float(np.abs(numpy_blocks[key]).max())), err_msg=key)


@needs_compiled
@pytest.mark.parametrize("global_stats", [False, True])
def test_compiled_batch_norm_scale_bias_matches_numpys(global_stats):
    from caffempi import config
    text = 'type: "BatchNorm" batch_norm_param { scale_bias: true use_global_stats: %s ' \
           'scale_filler { type: "gaussian" } bias_filler { type: "gaussian" } }' % str(global_stats).lower()
    x = rand(4, 5, 6, 7).astype(np.float32) * 2 + 1
    dy = rand(4, 5, 6, 7, seed=3).astype(np.float32)
    results = []
    for compiled in (True, False):
        with config.using_config(compiled_channels=compiled):
            layer, bottom, top = run_layer(text, [x], dtype=np.float32)
            if global_stats:
                set_blobs(layer, [rand(5, seed=4), np.abs(rand(5, seed=5)) + 0.5, [0.9],
                                  layer.blobs[3].data, layer.blobs[4].data])
                layer.forward(bottom, top)
            top[0].diff = dy.copy()
            layer.backward(top, [True], bottom)
            results.append([top[0].data.copy(), bottom[0].diff.copy(), layer.blobs[3].diff.copy(),
                            layer.blobs[4].diff.copy()] + [b.data.copy() for b in layer.blobs[:3]])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(b).max())))


def test_chain_on_an_input_runs_forward_fused_and_backward_alone(monkeypatch):
    """A chain whose BatchNorm runs no backward (on an input, no
    force_backward): forward fused, backward the Scale's and ReLU's own,
    bitwise the numbers of the layers one by one."""
    from caffempi import config
    from caffempi.layer_types.scale import ScaleLayer
    from caffempi.net import Net
    from caffempi.proto import caffe_pb2
    from google.protobuf import text_format
    text = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 6 dim: 5 dim: 7 dim: 3 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "b" }
    layer { name: "sc" type: "Scale" bottom: "b" top: "b" scale_param { bias_term: true } }
    layer { name: "r" type: "ReLU" bottom: "b" top: "b" }
    layer { name: "ip" type: "InnerProduct" bottom: "b" top: "y" loss_weight: 1
            inner_product_param { num_output: 2 } }
    """

    def run(fuse):
        with config.using_config(fuse=fuse):
            net = Net(text_format.Merge(text, caffe_pb2.NetParameter()), TRAIN)
        for j, blob in enumerate(net.params["sc"]):
            blob.data[...] = rand(5, seed=j)
        net.params["ip"][0].data[...] = rand(2, 105, seed=3)
        net.blobs["x"].data[...] = rand(6, 5, 7, 3, seed=4)
        net.forward()
        net.backward()
        return [blob.diff.copy() for name in ("sc", "ip") for blob in net.params[name]]
    alone = run(False)
    monkeypatch.setattr(ScaleLayer, "forward", lambda *a: pytest.fail("Scale ran by itself"))
    for a, b in zip(run(True), alone):
        assert np.array_equal(a, b)
    assert np.abs(alone[0]).max() > 0
