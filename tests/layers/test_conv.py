"""Convolution and Deconvolution: forward values against plain loops, Caffe's
output-size formulas and parameter shapes, finite-difference gradients."""
import numpy as np
import pytest

from caffempi.blob import Blob
from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer

FILL = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "uniform" min: -1 max: 1 }'


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def conv_text(extra, kind="Convolution"):
    return 'type: "%s" convolution_param { %s %s }' % (kind, extra, FILL)


def ref_conv(x, w, b, stride, pad, dil, group):
    """Direct convolution: y[n,o,y,x] = sum_{c,i,j} w * x at dilated taps."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    og = o // group
    y = np.zeros((n, o, oh, ow))
    for nn in range(n):
        for oo in range(o):
            g = oo // og
            for yy in range(oh):
                for xx in range(ow):
                    s = 0.0
                    for cc in range(cg):
                        for i in range(kh):
                            for j in range(kw):
                                hy = yy * sh - ph + i * dh
                                wx = xx * sw - pw + j * dw
                                if 0 <= hy < h and 0 <= wx < wd:
                                    s += w[oo, cc, i, j] * x[nn, g * cg + cc, hy, wx]
                    y[nn, oo, yy, xx] = s + (b[oo] if b is not None else 0.0)
    return y


def ref_deconv(x, w, b, stride, pad, dil, group):
    """Scatter form of the transposed convolution (Caffe's weight layout
    (C_in, num_output/group, kh, kw))."""
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    oh = (h - 1) * sh + dh * (kh - 1) + 1 - 2 * ph
    ow = (wd - 1) * sw + dw * (kw - 1) + 1 - 2 * pw
    o = og * group
    cg = c // group
    y = np.zeros((n, o, oh, ow))
    for nn in range(n):
        for cc in range(c):
            g = cc // cg
            for yy in range(h):
                for xx in range(wd):
                    for oo in range(og):
                        for i in range(kh):
                            for j in range(kw):
                                ty = yy * sh - ph + i * dh
                                tx = xx * sw - pw + j * dw
                                if 0 <= ty < oh and 0 <= tx < ow:
                                    y[nn, g * og + oo, ty, tx] += x[nn, cc, yy, xx] * w[cc, oo, i, j]
    if b is not None:
        y += b.reshape(1, -1, 1, 1)
    return y


# (param text, stride, pad, dilation, group, bias)
CASES = [
    ("num_output: 4 kernel_size: 3", (1, 1), (0, 0), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 3 pad: 1 stride: 2", (2, 2), (1, 1), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 3 group: 2 bias_term: false", (1, 1), (0, 0), (1, 1), 2, False),
    ("num_output: 2 kernel_size: 2 dilation: 2 pad: 1", (1, 1), (1, 1), (2, 2), 1, True),
    ("num_output: 4 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 group: 2",
     (2, 1), (1, 0), (1, 1), 2, True),
    ("num_output: 4 kernel_size: 1", (1, 1), (0, 0), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 1 group: 2 bias_term: false", (1, 1), (0, 0), (1, 1), 2, False),
    ("num_output: 2 kernel_size: 3 kernel_size: 2 stride: 2 stride: 1 dilation: 1 dilation: 2",
     (2, 1), (0, 0), (1, 2), 1, True),
    ("num_output: 2 kernel_size: 2 dilation: 2", (1, 1), (0, 0), (2, 2), 1, True),
]


@pytest.fixture(params=["row_taps_per_image", "row_taps_batch", "columns_per_image", "columns_batch"])
def conv_path(request, monkeypatch):
    """Runs a test with convolution forward and weight gradient either as
    products per kernel row (where the stride allows; the weight gradient
    with per-image partials or one batch product) or through the full column
    matrix (the forward's product per image or per chunk of images).  The
    kernels pick by shape and a test's tiny shapes would see only one."""
    from caffempi.backend.cpu import conv
    row_taps = request.param.startswith("row_taps")
    monkeypatch.setattr(conv, "PER_IMAGE_MAX_K", 1 << 30 if request.param == "columns_per_image" else 0)
    monkeypatch.setattr(conv, "by_row_taps", lambda geom, cg, p: row_taps and geom[2] == 1)
    monkeypatch.setattr(conv, "dw_per_image", lambda geom, cg, og, p: request.param == "row_taps_per_image")
    return request.param


@pytest.mark.parametrize("text,stride,pad,dil,group,bias", CASES)
def test_conv_forward_matches_loops(text, stride, pad, dil, group, bias, conv_path):
    x = rand(2, 4, 7, 6)
    layer, _, top = run_layer(conv_text(text), [x])
    w = layer.blobs[0].data
    b = layer.blobs[1].data if bias else None
    assert len(layer.blobs) == (2 if bias else 1)
    assert w.shape[1] == 4 // group
    np.testing.assert_allclose(top[0].data, ref_conv(x, w, b, stride, pad, dil, group), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("text,stride,pad,dil,group,bias", CASES)
def test_deconv_forward_matches_loops(text, stride, pad, dil, group, bias, conv_path):
    x = rand(2, 4, 4, 5)
    layer, _, top = run_layer(conv_text(text, "Deconvolution"), [x])
    w = layer.blobs[0].data
    b = layer.blobs[1].data if bias else None
    num_output = int(text.split()[1])
    assert w.shape[:2] == (4, num_output // group)      # Caffe's deconv layout
    np.testing.assert_allclose(top[0].data, ref_deconv(x, w, b, stride, pad, dil, group), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("text,stride,pad,dil,group,bias", CASES)
def test_conv_gradient(text, stride, pad, dil, group, bias, conv_path):
    check_gradient(conv_text(text), [rand(2, 4, 5, 4)])


@pytest.mark.parametrize("text,stride,pad,dil,group,bias", CASES)
def test_deconv_gradient(text, stride, pad, dil, group, bias, conv_path):
    check_gradient(conv_text(text, "Deconvolution"), [rand(2, 4, 3, 3)])


def test_shapes_and_param_shapes():
    layer, _, top = run_layer(conv_text("num_output: 6 kernel_size: 5 pad: 2 stride: 3 group: 3"), [rand(2, 3, 11, 9)])
    assert layer.blobs[0].shape == (6, 1, 5, 5) and layer.blobs[1].shape == (6,)
    assert top[0].shape == (2, 6, (11 + 4 - 5) // 3 + 1, (9 + 4 - 5) // 3 + 1)
    layer, _, top = run_layer(conv_text("num_output: 2 kernel_size: 3 dilation: 3"), [rand(1, 1, 10, 8)])
    assert top[0].shape == (1, 2, 10 - 7 + 1, 8 - 7 + 1)
    layer, _, top = run_layer(conv_text("num_output: 6 kernel_size: 4 pad: 1 stride: 2 group: 3", "Deconvolution"),
                              [rand(2, 3, 5, 4)])
    assert layer.blobs[0].shape == (3, 2, 4, 4)
    assert top[0].shape == (2, 6, (5 - 1) * 2 + 4 - 2, (4 - 1) * 2 + 4 - 2)


def test_two_bottoms_share_weights():
    x1, x2 = rand(2, 2, 5, 5, seed=1), rand(2, 2, 5, 5, seed=2)
    layer, _, top = run_layer(conv_text("num_output: 3 kernel_size: 3"), [x1, x2], num_top=2)
    w, b = layer.blobs[0].data, layer.blobs[1].data
    np.testing.assert_allclose(top[1].data, ref_conv(x2, w, b, (1, 1), (0, 0), (1, 1), 1), atol=1e-10)
    check_gradient(conv_text("num_output: 3 kernel_size: 3"), [x1, x2], num_top=2)


@pytest.mark.parametrize("text", [
    "num_output: 6 kernel_size: 3 pad: 1 group: 2",      # dx as a flipped convolution
    "num_output: 6 kernel_size: 3 group: 2",             # dx by GEMM + col2im (wide rows)
    "num_output: 6 kernel_size: 3 stride: 2 group: 2",   # dx by GEMM + strided col2im
])
def test_large_batch_uses_chunks_consistently(text, conv_path):
    # a batch big enough to be cut into several im2col chunks
    from caffempi.backend import cpu
    from caffempi.backend.cpu import chunking
    x = rand(64, 8, 12, 12)
    layer, bottom, top = run_layer(conv_text(text), [x])
    w = layer.blobs[0].data
    old = chunking.COL_CHUNK_BYTES
    try:
        chunking.COL_CHUNK_BYTES = 1 << 10
        y_small = cpu.conv2d_forward(x, w, layer.geom, 2)
        dy = rand(*top[0].shape, seed=3)
        gx_s, gw_s = cpu.conv2d_backward(x, w, dy, layer.geom, 2)
        chunking.COL_CHUNK_BYTES = 1 << 30
        y_big = cpu.conv2d_forward(x, w, layer.geom, 2)
        gx_b, gw_b = cpu.conv2d_backward(x, w, dy, layer.geom, 2)
    finally:
        chunking.COL_CHUNK_BYTES = old
    np.testing.assert_allclose(y_small, y_big, atol=1e-10)
    np.testing.assert_allclose(gx_s, gx_b, atol=1e-10)
    np.testing.assert_allclose(gw_s, gw_b, atol=1e-9)
    np.testing.assert_allclose(y_big, top[0].data - layer.blobs[1].data.reshape(1, -1, 1, 1), atol=1e-10)
    # and against the loops on a few images
    w, b = layer.blobs[0].data, layer.blobs[1].data
    kh, kw, sh, sw, ph, pw, dh, dw = layer.geom
    np.testing.assert_allclose(top[0].data[:2], ref_conv(x[:2], w, b, (sh, sw), (ph, pw), (dh, dw), 2), atol=1e-10)
    # dx is the adjoint of the forward: <conv(x'), dy> == <x', dx>
    xr = rand(*x.shape, seed=4)
    np.testing.assert_allclose((cpu.conv2d_forward(xr, w, layer.geom, 2) * dy).sum(), (xr * gx_b).sum(), rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_gradient_with_4k_rows(dtype, conv_path):
    # output planes of exactly 4 KiB (rows that alias in the L1 cache) in
    # the column path; dw must equal the plain correlation sum
    from caffempi.backend import cpu
    h = 32 if dtype == np.float32 else 16      # 32x32 float32 or 16x32 float64 rows
    x = rand(3, 2, h, 32).astype(dtype)
    w = rand(4, 2, 3, 3, seed=1).astype(dtype)
    dy = rand(3, 4, h, 32, seed=2).astype(dtype)
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    assert (h * 32 * np.dtype(dtype).itemsize) % 4096 == 0
    gx, gw = cpu.conv2d_backward(x, w, dy, geom, 1)
    xpad = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros(w.shape)
    for i in range(3):
        for j in range(3):
            ref[:, :, i, j] = np.einsum("noyx,ncyx->oc", dy, xpad[:, :, i:i + h, j:j + 32])
    tol = 1e-3 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(gw, ref, rtol=tol, atol=tol)
    xr = rand(*x.shape, seed=4).astype(dtype)
    np.testing.assert_allclose((cpu.conv2d_forward(xr, w, geom, 1) * dy).sum(), (xr * gx).sum(),
                               rtol=tol)


def test_float32_forward():
    x = rand(2, 3, 6, 6).astype(np.float32)
    layer, _, top = run_layer(conv_text("num_output: 4 kernel_size: 3 pad: 1"), [x], dtype=np.float32)
    assert top[0].data.dtype == np.float32
    ref = ref_conv(x.astype(np.float64), layer.blobs[0].data.astype(np.float64),
                   layer.blobs[1].data.astype(np.float64), (1, 1), (1, 1), (1, 1), 1)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("text,shape", [
    ("num_output: 4 kernel_size: 3 group: 3", (1, 4, 5, 5)),          # group does not divide C
    ("num_output: 4", (1, 4, 5, 5)),                                    # no kernel
    ("num_output: 4 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 4, 5, 5)),
    ("num_output: 4 kernel_size: 3", (1, 4, 5, 5, 5)),                  # 3-D
    ("num_output: 4 kernel_size: 3 kernel_size: 3 kernel_size: 3", (1, 4, 5, 5)),
    ("num_output: 4 kernel_size: 7", (1, 4, 5, 5)),                     # too small input
])
def test_errors(text, shape):
    with pytest.raises(CaffeError):
        run_layer(conv_text(text), [np.zeros(shape)])


def test_loaded_blob_shape_is_checked():
    layer = make_layer(conv_text("num_output: 4 kernel_size: 3"))
    layer.blobs = [Blob((4, 2, 3, 3), np, np.float64), Blob((4,), np, np.float64)]
    with pytest.raises(CaffeError):
        run_layer(layer, [np.zeros((1, 3, 5, 5))])


def test_every_dispatched_kernel_has_both_implementations():
    """kernels.py forwards by name: each name must exist in the NumPy module
    and in the CuPy module (read without importing it: CI has no CuPy)."""
    import ast
    import inspect
    import re
    from pathlib import Path
    from caffempi.backend import cpu, kernels
    names = set(re.findall(r'_impl\(xp, "(\w+)"\)', inspect.getsource(kernels)))
    assert {"conv2d_forward", "max_pool_forward", "channel_window_sum"} <= names
    tree = ast.parse((Path(kernels.__file__).parent / "gpu.py").read_text())
    gpu_defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in sorted(names):
        assert callable(getattr(cpu, name)), name
        assert name in gpu_defs, name


ENGINES = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
layer { name: "caffe" type: "Convolution" bottom: "x" top: "a"
        convolution_param { num_output: 2 kernel_size: 3 engine: CAFFE } }
layer { name: "cudnn" type: "Convolution" bottom: "x" top: "b"
        convolution_param { num_output: 2 kernel_size: 3 engine: CUDNN } }
layer { name: "default" type: "Deconvolution" bottom: "x" top: "c"
        convolution_param { num_output: 2 kernel_size: 3 } }
"""


@pytest.mark.parametrize("cudnn", [True, False])
def test_engine_is_resolved_per_layer_at_setup(cudnn):
    from google.protobuf import text_format
    from caffempi import Net
    from caffempi.config import using_config
    from caffempi.proto import caffe_pb2
    with using_config(cudnn=cudnn):
        net = Net(text_format.Parse(ENGINES, caffe_pb2.NetParameter()))
    # outside the block: the value resolved at setup stays
    resolved = {name: layer.use_cudnn for name, layer in zip(net.layer_names, net.layers)
                if layer.type in ("Convolution", "Deconvolution")}
    assert resolved == {"caffe": False, "cudnn": True, "default": cudnn}


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("engine,expected", [("CAFFE", False), ("CUDNN", True)])
def test_layer_passes_its_engine_to_every_kernel_call(kind, engine, expected, monkeypatch):
    from caffempi.backend import kernels
    seen = []
    for name in ("conv2d_forward", "conv2d_backward"):
        def spy(*args, _real=getattr(kernels, name), **kw):
            seen.append(kw["use_cudnn"])
            return _real(*args, **kw)
        monkeypatch.setattr(kernels, name, spy)
    check_gradient(conv_text("num_output: 2 kernel_size: 3 engine: %s" % engine, kind), [rand(1, 2, 5, 5)])
    assert seen and set(seen) == {expected}


def load_gpu_module(monkeypatch):
    """caffempi/backend/gpu.py run against a stand-in cupy, to check its
    Python-level dispatch on a machine without CUDA."""
    import importlib.util
    import sys
    from pathlib import Path
    from unittest import mock
    from caffempi.backend import kernels
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock())
    monkeypatch.setitem(sys.modules, "cupyx", mock.MagicMock())
    path = Path(kernels.__file__).parent / "gpu.py"
    spec = importlib.util.spec_from_file_location("caffempi.backend.gpu_under_test", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    return gpu


@pytest.mark.parametrize("use_cudnn,loads,expected", [
    (True, True, "cudnn"), (True, False, "ours"), (False, True, "ours")])
def test_gpu_convolution_uses_cudnn_only_when_asked_and_loaded(use_cudnn, loads, expected, monkeypatch):
    from caffempi.backend import kernels
    gpu = load_gpu_module(monkeypatch)
    monkeypatch.setattr(kernels, "_impl", lambda xp, name: getattr(gpu, name))
    calls = []
    monkeypatch.setattr(gpu.cudnn, "available", lambda: loads)
    for name in ("conv2d_forward", "conv2d_backward"):
        monkeypatch.setattr(gpu.cudnn, name, lambda *a, _n=name: calls.append(("cudnn", _n)))
        monkeypatch.setattr(gpu, "im2col_" + name, lambda *a, _n=name: calls.append(("ours", _n)))
    x, w, geom = rand(1, 2, 5, 5), rand(2, 2, 3, 3), (3, 3, 1, 1, 0, 0, 1, 1)
    gpu_xp = object()              # anything but numpy dispatches to the GPU module
    kernels.conv2d_forward(gpu_xp, x, w, geom, 1, use_cudnn=use_cudnn)
    kernels.conv2d_backward(gpu_xp, x, w, rand(1, 2, 3, 3), geom, 1, use_cudnn=use_cudnn)
    assert calls == [(expected, "conv2d_forward"), (expected, "conv2d_backward")]
