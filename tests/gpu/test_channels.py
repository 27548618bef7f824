"""The GPU's per-channel kernels (backend/gpu_channels.py) against float64
NumPy, and nets whose BatchNorm → Scale → ReLU and Eltwise → ReLU chains
run fused on the GPU against the same nets unfused and on the CPU."""
import itertools

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import config
from caffempi.backend import channels, to_numpy
from caffempi.common import TEST, TRAIN
from caffempi.net import Net
from caffempi.proto import caffe_pb2

pytestmark = pytest.mark.gpu

# (planes, C, S): many chunks per channel, one value per channel's plane,
# rows shorter than a warp, ResNet's last stage
SHAPES = [(4, 3, 1000), (7, 5, 1), (3, 6, 20), (2, 64, 49), (1, 2, 70001)]


def reference_forward(x, stats, mean, std, scale, bias, relu, eps):
    if stats == channels.BATCH_STATS:
        mean = x.mean(axis=(0, 2))
        var = ((x - mean[:, None]) ** 2).mean(axis=(0, 2))
        std = np.sqrt(var + eps)
    else:
        var = None
    y = (x - mean[:, None]) / std[:, None]
    out = y
    if scale is not None:
        out = out * scale[:, None] + (0 if bias is None else bias[:, None])
    if relu:
        out = np.maximum(out, 0)
    return y, out, mean, var, std


def reference_backward(dy, y, stats, std, scale, with_bias, out):
    g = dy * (out > 0) if out is not None else dy
    sums = {}
    if scale is not None:
        sums["dscale"] = (g * y).sum(axis=(0, 2))
        if with_bias:
            sums["dbias"] = g.sum(axis=(0, 2))
        g = g * scale[:, None]
    if stats == channels.BATCH_STATS:
        dx = (g - g.mean(axis=(0, 2))[:, None] - (g * y).mean(axis=(0, 2))[:, None] * y) / std[:, None]
    elif stats == channels.GIVEN_STATS:
        dx = g / std[:, None]
    else:
        dx = g
    return dx, sums


def close(got, want, what, rtol):
    got = to_numpy(got).astype(np.float64)
    assert np.isfinite(got).all(), "%s: not every value written" % what
    err = np.abs(got - want).max()
    assert err <= rtol * max(1.0, np.abs(want).max()), "%s: max error %.3g" % (what, err)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_kernels_match_float64(cupy, shape, dtype):
    rs = np.random.RandomState(sum(shape))
    x = rs.randn(*shape) * 2 + 1.5
    c = shape[1]
    given_mean, given_std = rs.randn(c), np.abs(rs.randn(c)) + 0.5
    scale, bias = rs.randn(c), rs.randn(c)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for stats, affine, relu in itertools.product((channels.BATCH_STATS, channels.GIVEN_STATS), (0, 1, 2), (False, True)):
        sc = scale if affine else None
        bi = bias if affine == 2 else None
        want_y, want_out, want_mean, want_var, want_std = reference_forward(
            x, stats, given_mean, given_std, sc, bi, relu, 1e-5)
        d = lambda a: None if a is None else cupy.asarray(a, dtype)
        gx = d(x)
        y, out = cupy.full(shape, cupy.nan, dtype), cupy.full(shape, cupy.nan, dtype)
        running = None
        if stats == channels.BATCH_STATS:
            mean, var, std = (cupy.full(c, cupy.nan, dtype) for _ in range(3))
            sums, squares = rs.randn(c), np.abs(rs.randn(c))
            running = (d(sums), d(squares), 0.9, 1.25)
        else:
            mean, var, std = d(given_mean), None, d(given_std)
        stored = out if affine or relu else None
        assert channels.available(*(a for a in (gx, y, out, mean, std, d(sc), d(bi)) if a is not None))
        channels.forward(gx, y, stored, stats, mean, var, std, d(sc), d(bi), relu, 1e-5, running=running)
        what = "stats %d affine %d relu %d" % (stats, affine, relu)
        close(y, want_y, what + " y", rtol)
        if stored is not None:
            close(out, want_out, what + " out", rtol)
        if stats == channels.BATCH_STATS:
            close(mean, want_mean, what + " mean", rtol)
            close(var, want_var, what + " var", rtol)
            close(std, want_std, what + " std", rtol)
            close(running[0], sums * 0.9 + want_mean, what + " running mean sum", rtol)
            close(running[1], squares * 0.9 + 1.25 * want_var, what + " running variance sum", rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_kernels_match_float64(cupy, shape, dtype):
    rs = np.random.RandomState(sum(shape) + 1)
    c = shape[1]
    y = rs.randn(*shape)
    dy = rs.randn(*shape)
    out = rs.randn(*shape)
    std, scale = np.abs(rs.randn(c)) + 0.5, rs.randn(c)
    rtol = 2e-5 if dtype == np.float32 else 1e-11
    cases = itertools.product((channels.NO_STATS, channels.BATCH_STATS, channels.GIVEN_STATS),
                              (0, 1, 2), (False, True), (False, True))
    for stats, affine, relu, write_dx in cases:
        if not write_dx and not affine:
            continue
        sc = scale if affine else None
        want_dx, want_sums = reference_backward(dy, y, stats, std, sc, affine == 2, out if relu else None)
        d = lambda a: None if a is None else cupy.asarray(a, dtype)
        dx = cupy.full(shape, cupy.nan, dtype) if write_dx else None
        dscale = cupy.full(c, cupy.nan, dtype) if affine else None
        dbias = cupy.full(c, cupy.nan, dtype) if affine == 2 else None
        gdy = d(dy)
        channels.backward(gdy, d(y), dx, stats, None if stats == channels.NO_STATS else d(std), d(sc),
                          dscale, dbias, d(out) if relu else None)
        what = "stats %d affine %d relu %d dx %d" % (stats, affine, relu, write_dx)
        close(gdy, dy.astype(dtype), what + " dy untouched", 0)
        if write_dx:
            close(dx, want_dx, what + " dx", rtol)
        if affine:
            close(dscale, want_sums["dscale"], what + " dscale", rtol)
        if affine == 2:
            close(dbias, want_sums["dbias"], what + " dbias", rtol)


# A ResNet block in Caffe's spelling: both chains, a shortcut, statistics.
BLOCK = """force_backward: true
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 8 dim: 9 dim: 9 } } }
layer { name: "c1" type: "Convolution" bottom: "x" top: "c1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" %(stats)s }
layer { name: "sc1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
        convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "c2" top: "c2" %(stats)s }
layer { name: "sc2" type: "Scale" bottom: "c2" top: "c2" scale_param { bias_term: false } }
layer { name: "sum" type: "Eltwise" bottom: "c2" bottom: "x" top: "s" }
layer { name: "r2" type: "ReLU" bottom: "s" top: "s" }
layer { name: "ip" type: "InnerProduct" bottom: "s" top: "y"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
"""


def run_block(xp, fuse, compiled, global_stats):
    param = text_format.Merge(BLOCK % {"stats": "batch_norm_param { use_global_stats: true }"
                                       if global_stats else ""}, caffe_pb2.NetParameter())
    rs = np.random.RandomState(3)
    with config.using_config(fuse=fuse, compiled_channels=compiled):
        net = Net(param, TEST if global_stats else TRAIN, xp=xp, dtype=np.float32)
        for name, blobs in net.params.items():
            for j, blob in enumerate(blobs):
                values = rs.randn(*blob.shape)
                blob.data[...] = xp.asarray(np.abs(values) + 0.5 if name.startswith("bn") else values)
        net.blobs["x"].data[...] = xp.asarray(rs.randn(4, 8, 9, 9) + 0.5)
        net.forward()
        net.blobs["y"].diff[...] = xp.asarray(rs.randn(4, 5))
        net.backward(diffs=["x"])
    seen = {"y": net.blobs["y"].data, "x diff": net.blobs["x"].diff}
    for name, blobs in net.params.items():
        for j, blob in enumerate(blobs):
            seen["%s %d" % (name, j)], seen["%s %d diff" % (name, j)] = blob.data, blob.diff
    return net, {k: to_numpy(v).astype(np.float64) for k, v in seen.items()}


@pytest.mark.parametrize("global_stats", [False, True])
def test_fused_chains_on_gpu_match_the_layers_and_the_cpu(cupy, global_stats):
    net, fused = run_block(cupy, True, True, global_stats)
    assert net._chain_last, "no chain fused on the GPU"
    _, alone = run_block(cupy, False, False, global_stats)
    _, cpu = run_block(np, False, False, global_stats)
    for key in fused:
        scale = max(1.0, np.abs(cpu[key]).max())
        for other, name in ((alone, "GPU unfused"), (cpu, "CPU")):
            err = np.abs(fused[key] - other[key]).max()
            assert err <= 1e-4 * scale, "%s: fused GPU against %s: %.3g" % (key, name, err)


@pytest.mark.parametrize("name,outputs", [("relu_gradient", 1), ("relu_gradient", 2), ("sum", 1), ("sum_relu", 1)])
def test_fused_elementwise_kernels_equal_their_cupy_calls(cupy, name, outputs):
    """kernels.elementwise's one-launch kernels against the layers' CuPy
    calls, NaN, infinities and signed zeros included."""
    from caffempi.backend import kernels
    rs = np.random.RandomState(5)
    a, b = (rs.randn(3, 7, 11).astype(np.float32) for _ in range(2))
    a.flat[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0]
    b.flat[:6] = [1.0, -1.0, 2.0, -0.0, np.nan, -1.0]
    a, b = cupy.asarray(a), cupy.asarray(b)
    calls = {"relu_gradient": lambda dy, y, out: [cupy.multiply(dy, y > 0, out=o)
                                                  for o in (out if outputs > 1 else (out,))],
             "sum": lambda x, y, out: cupy.add(x, y, out=out),
             "sum_relu": lambda x, y, out: cupy.maximum(cupy.add(x, y, out=out), 0, out=out)}
    fused = kernels.elementwise(cupy, calls[name], a, b, outputs=outputs, fused=name)
    alone = kernels.elementwise(cupy, calls[name], a, b, outputs=outputs)
    for f, u in zip(fused if outputs > 1 else (fused,), alone if outputs > 1 else (alone,)):
        np.testing.assert_array_equal(cupy.asnumpy(f), cupy.asnumpy(u))
