"""Pooling: Caffe's output size (ceil, clipped last window), MAX/AVE values
and argmax mask against Caffe-style loops, finite-difference gradients."""
import math

import numpy as np
import pytest

from caffempi.backend import cpu, pooling
from caffempi.common import CaffeError
from caffempi.config import using_config
from caffempi.testing.gradient_check import check_gradient, run_layer


def distinct(*shape, seed=0):
    """Values without ties (max pooling is differentiable there), spaced well
    beyond the finite-difference step."""
    r = np.random.RandomState(seed)
    n = int(np.prod(shape))
    return (r.permutation(n) * 0.01 - n * 0.005 + r.uniform(-0.002, 0.002, n)).reshape(shape)


def pool_text(extra):
    return 'type: "Pooling" pooling_param { %s }' % extra


def ref_out(size, k, s, p):
    out = int(math.ceil((size + 2 * p - k) / float(s))) + 1
    if p > 0 and (out - 1) * s >= size + p:
        out -= 1
    return out


def ref_pool(x, kh, kw, sh, sw, ph, pw, method):
    """Caffe's CPU loops: MAX over the window clipped to the image (first max
    in raster order), AVE dividing by the window clipped to the padded image."""
    n, c, h, w = x.shape
    oh, ow = ref_out(h, kh, sh, ph), ref_out(w, kw, sw, pw)
    y = np.zeros((n, c, oh, ow))
    mask = np.full((n, c, oh, ow), -1.0)
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph, j * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        hs, ws = max(hs, 0), max(ws, 0)
                        best = -np.inf
                        for yy in range(hs, he):
                            for xx in range(ws, we):
                                if x[a, b, yy, xx] > best:
                                    best = x[a, b, yy, xx]
                                    mask[a, b, i, j] = yy * w + xx
                        y[a, b, i, j] = best
                    else:
                        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                        size = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                        y[a, b, i, j] = x[a, b, hs:he, ws:we].sum() / size
    return y, mask


# (text, shape, kh, kw, sh, sw, ph, pw)
CASES = [
    ("kernel_size: 2 stride: 2", (2, 3, 6, 6), 2, 2, 2, 2, 0, 0),
    ("kernel_size: 3 stride: 2", (2, 2, 7, 8), 3, 3, 2, 2, 0, 0),          # ceil: overhanging last window
    ("kernel_size: 3 stride: 2 pad: 1", (1, 2, 6, 6), 3, 3, 2, 2, 1, 1),   # clipping rule fires
    ("kernel_size: 3 stride: 1 pad: 1", (1, 2, 5, 4), 3, 3, 1, 1, 1, 1),
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", (2, 2, 5, 5), 3, 2, 2, 1, 1, 0),
    ("kernel_size: 4 stride: 3 pad: 2", (1, 2, 9, 7), 4, 4, 3, 3, 2, 2),
    ("kernel_size: 2 stride: 2 pad: 1", (1, 2, 5, 5), 2, 2, 2, 2, 1, 1),   # clipping rule fires
    # over 64 outputs per plane: AVE by separable sums instead of the GEMM
    ("kernel_size: 3 stride: 1 pad: 1", (1, 1, 9, 9), 3, 3, 1, 1, 1, 1),
    ("kernel_size: 3 stride: 2", (1, 1, 19, 17), 3, 3, 2, 2, 0, 0),
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("text,shape,kh,kw,sh,sw,ph,pw", CASES)
def test_forward_matches_loops(method, text, shape, kh, kw, sh, sw, ph, pw):
    x = distinct(*shape)
    num_top = 2 if method == "MAX" else 1
    _, _, top = run_layer(pool_text("pool: %s %s" % (method, text)), [x], num_top=num_top)
    y, mask = ref_pool(x, kh, kw, sh, sw, ph, pw, method)
    assert top[0].shape == y.shape
    np.testing.assert_allclose(top[0].data, y, rtol=1e-12, atol=1e-12)
    if method == "MAX":
        np.testing.assert_array_equal(top[1].data, mask)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("text,shape,kh,kw,sh,sw,ph,pw", CASES)
def test_gradient(method, text, shape, kh, kw, sh, sw, ph, pw):
    check_gradient(pool_text("pool: %s %s" % (method, text)), [distinct(*shape, seed=1)])


def test_output_size_clipping_rule():
    # H=5, k=2, s=2, p=1: ceil(5/2)+1 = 4, but the 4th window would start at
    # 3*2-1 = 5, in the right padding ((4-1)*2 >= H+p), so it is dropped -> 3
    assert ref_out(5, 2, 2, 1) == 3
    _, _, top = run_layer(pool_text("pool: MAX kernel_size: 2 stride: 2 pad: 1"), [distinct(1, 1, 5, 5)])
    assert top[0].shape == (1, 1, 3, 3)
    # H=6, k=3, s=2, p=1: ceil(5/2)+1 = 4 windows; the last starts at
    # 3*2-1 = 5, inside the image ((4-1)*2 < H+p), so the rule keeps it
    _, _, top = run_layer(pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"), [distinct(1, 1, 6, 6)])
    assert top[0].shape == (1, 1, 4, 4)
    # no padding: ceil, last window overhangs the image
    _, _, top = run_layer(pool_text("pool: MAX kernel_size: 3 stride: 2"), [distinct(2, 3, 32, 32)])
    assert top[0].shape == (2, 3, 16, 16)
    _, _, top = run_layer(pool_text("pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR"), [distinct(2, 3, 32, 32)])
    assert top[0].shape == (2, 3, 15, 15)


def test_clipped_last_window_values():
    # H=5, k=2, s=2, p=1 -> 3 windows: [-1,1), [1,3), [3,5); the dropped 4th would be [5,7)
    x = distinct(1, 1, 5, 5)
    for method in ("MAX", "AVE"):
        _, _, top = run_layer(pool_text("pool: %s kernel_size: 2 stride: 2 pad: 1" % method), [x])
        y, _ = ref_pool(x, 2, 2, 2, 2, 1, 1, method)
        np.testing.assert_allclose(top[0].data, y, atol=1e-12)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    x = distinct(2, 3, 4, 5)
    _, _, top = run_layer(pool_text("pool: %s global_pooling: true" % method), [x])
    assert top[0].shape == (2, 3, 1, 1)
    want = x.max(axis=(2, 3)) if method == "MAX" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(top[0].data[:, :, 0, 0], want, atol=1e-12)
    check_gradient(pool_text("pool: %s global_pooling: true" % method), [x])


def test_max_ties_go_to_first_in_raster_order():
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 0] = x[0, 0, 0, 1] = 1.0     # tie within the first 2x2 window
    layer, bottom, top = run_layer(pool_text("pool: MAX kernel_size: 2 stride: 2"), [x], num_top=2)
    assert top[1].data[0, 0, 0, 0] == 1      # (0, 1) comes before (1, 0)
    top[0].diff = np.ones(top[0].shape)
    layer.backward(top, [True], bottom)
    assert bottom[0].diff[0, 0, 0, 1] == 1 and bottom[0].diff[0, 0, 1, 0] == 0
    assert bottom[0].diff.sum() == 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lanes_across_planes_give_the_one_plane_kernels_bits(dtype):
    """Rows of fewer than 8 outputs run 8 planes at a time: the same
    maxima and argmax as the kernel of one plane at a time, bitwise, with
    ties (the first in raster order), NaN passed over and clipped windows."""
    if not pooling.available(dtype):
        pytest.skip("the compiled kernels need x86-64 and llvmlite")
    x = np.random.RandomState(0).standard_normal((2, 13, 9, 9)).astype(dtype)
    x[0, 1, :3, :3] = 1.0                      # ties
    x[1, 4, 2, 2] = x[0, 9, 0, 0] = np.nan
    geom = (3, 3, 2, 2, 1, 1, 1, 1)
    y, idx = (np.empty((2, 13, 5, 5), t) for t in (dtype, np.int32))
    pooling.max_forward(x, geom, y, idx)
    one = pooling._kernel("forward", pooling._TYPES[np.dtype(dtype)])
    y1, idx1 = (np.empty_like(a) for a in (y, idx))
    one(x.ctypes.data, y1.ctypes.data, idx1.ctypes.data, 26, 9, 9, 5, 5, *geom[:6])
    np.testing.assert_array_equal(y, y1)
    np.testing.assert_array_equal(idx, idx1)


def test_max_pool_float32():
    x = distinct(2, 3, 9, 9).astype(np.float32)
    _, _, top = run_layer(pool_text("pool: MAX kernel_size: 3 stride: 2 pad: 1"), [x], num_top=2,
                          dtype=np.float32)
    y, mask = ref_pool(x.astype(np.float64), 3, 3, 2, 2, 1, 1, "MAX")
    assert top[0].data.dtype == np.float32 and top[1].data.dtype == np.float32
    np.testing.assert_array_equal(top[0].data, y.astype(np.float32))
    np.testing.assert_array_equal(top[1].data, mask)


@pytest.mark.parametrize("text,shape,ntop", [
    ("pool: STOCHASTIC kernel_size: 2", (1, 1, 4, 4), 1),
    ("pool: MAX", (1, 1, 4, 4), 1),                                       # no kernel
    ("pool: MAX kernel_size: 2 pad: 2", (1, 1, 4, 4), 1),                 # pad >= kernel
    ("pool: AVE kernel_size: 2", (1, 1, 4, 4), 2),                        # mask top with AVE
    ("pool: MAX global_pooling: true kernel_size: 2", (1, 1, 4, 4), 1),
    ("pool: MAX global_pooling: true stride: 2", (1, 1, 4, 4), 1),
    ("pool: MAX kernel_size: 2", (4, 4, 4), 1),                           # not 4-D
])
def test_errors(text, shape, ntop):
    with pytest.raises(CaffeError):
        run_layer(pool_text(text), [np.zeros(shape)], num_top=ntop)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,geom", [(case[1], case[2:]) for case in CASES] + [
    ((2, 3, 32, 32), (3, 3, 2, 2, 0, 0)),       # 3x3/2, overlapping windows
    ((1, 2, 13, 13), (3, 3, 2, 2, 0, 0)),       # odd sides (CaffeNet's pools)
    ((2, 3, 8, 8), (2, 2, 2, 2, 0, 0)),         # windows that tile the image exactly
    ((2, 2, 5, 6), (5, 6, 1, 1, 0, 0)),         # one window: global
    ((3, 7, 8, 8), (3, 3, 2, 2, 1, 1)),         # rows of 4 outputs, 21 planes: lanes across planes and a rest
    ((2, 8, 7, 7), (3, 3, 1, 1, 1, 1)),         # rows of 7 (GoogLeNet's 7x7 pools), 16 planes
])
def test_max_pool_kernels_match_loops(compiled, dtype, shape, geom):
    """The compiled kernels (backend/pooling.py) and the NumPy forms give
    Caffe's maxima, argmax and routed gradient, bitwise."""
    with using_config(compiled_pooling=compiled):
        if compiled and not pooling.available(dtype):
            pytest.skip("the compiled kernels need x86-64 and llvmlite")
        x = distinct(*shape).astype(dtype)
        y_ref, mask = ref_pool(x.astype(np.float64), *geom, "MAX")
        y, idx = cpu.max_pool_forward(x, geom + (1, 1), *y_ref.shape[2:])
        dy = distinct(*y.shape, seed=2).astype(dtype)
        dx = cpu.max_pool_backward(dy, idx, geom + (1, 1), shape)
    np.testing.assert_array_equal(y, y_ref.astype(dtype))
    np.testing.assert_array_equal(idx, mask)
    dx_ref = np.zeros(shape, dtype)
    n, c = shape[:2]
    for a, b in np.ndindex(n, c):
        np.add.at(dx_ref[a, b].reshape(-1), idx[a, b].ravel(), dy[a, b].ravel())
    np.testing.assert_array_equal(dx, dx_ref)
