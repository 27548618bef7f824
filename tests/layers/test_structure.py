"""Structure layers (Concat, Slice, Split, Flatten, Reshape, Crop, Tile,
Eltwise, Silence, Reduction, ArgMax): forward values against plain NumPy,
Caffe's shape rules and error messages, finite-difference gradients."""
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def distinct(*shape, seed=0, low=0.2):
    """Random values with |x| >= low and pairwise gaps (no ties, no kinks)."""
    n = int(np.prod(shape))
    rs = np.random.RandomState(seed)
    mags = low + 0.1 * rs.permutation(n)
    return (mags * rs.choice([-1.0, 1.0], n)).reshape(shape)


def tops_of(text, n):
    return text + "".join(' top: "t%d"' % i for i in range(n))


# ------------------------------------------------------------------ Concat
@pytest.mark.parametrize("axis", [0, 1])
def test_concat_forward_and_gradient(axis):
    shapes = [(2, 3, 2), (2, 3, 2), (2, 3, 2)]
    shapes = [tuple(s[:axis]) + (k,) + tuple(s[axis + 1:]) for s, k in zip(shapes, (1, 2, 3))]
    xs = [rand(*s, seed=i) for i, s in enumerate(shapes)]
    text = 'type: "Concat" concat_param { axis: %d }' % axis
    _, _, top = run_layer(text, xs)
    np.testing.assert_array_equal(top[0].data, np.concatenate(xs, axis=axis))
    check_gradient(text, xs)


def test_concat_legacy_dim_and_default_axis():
    xs = [rand(2, 2, 3, seed=1), rand(2, 1, 3, seed=2)]
    for text in ('type: "Concat"', 'type: "Concat" concat_param { concat_dim: 1 }'):
        _, _, top = run_layer(text, xs)
        np.testing.assert_array_equal(top[0].data, np.concatenate(xs, axis=1))
    with pytest.raises(CaffeError, match="not both"):
        run_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }', xs)


def test_concat_shape_mismatch_error():
    with pytest.raises(CaffeError) as e:
        run_layer('name: "cat" type: "Concat"', [rand(2, 3, 4), rand(2, 3, 5)])
    msg = str(e.value)
    assert "cat" in msg and "(2, 3, 4)" in msg and "(2, 3, 5)" in msg


# ------------------------------------------------------------------- Slice
@pytest.mark.parametrize("param,bounds", [
    ("slice_param { axis: 1 slice_point: 1 slice_point: 4 }", [0, 1, 4, 6]),
    ("slice_param { axis: 1 }", [0, 2, 4, 6]),
    ("slice_param { slice_dim: 1 }", [0, 2, 4, 6]),
    ("slice_param { axis: 0 slice_point: 1 slice_point: 3 }", None),
])
def test_slice_forward_and_gradient(param, bounds):
    x = rand(4, 6, 2)
    axis = 0 if "axis: 0" in param else 1
    if bounds is None:
        bounds = [0, 1, 3, 4]
    text = tops_of('type: "Slice" %s' % param, 3)
    _, _, top = run_layer(text, [x])
    for t, lo, hi in zip(top, bounds[:-1], bounds[1:]):
        np.testing.assert_array_equal(t.data, np.take(x, range(lo, hi), axis=axis))
    check_gradient(text, [x])


def test_slice_single_top_and_errors():
    x = rand(2, 4)
    _, bottom, top = run_layer('type: "Slice"', [x])
    np.testing.assert_array_equal(top[0].data, x)
    with pytest.raises(CaffeError, match="equal parts"):
        run_layer(tops_of('type: "Slice"', 3), [x])
    with pytest.raises(CaffeError, match="slice_point"):
        run_layer(tops_of('type: "Slice" slice_param { slice_point: 1 }', 3), [x])


# ------------------------------------------------------------------- Split
def test_split_shares_data_and_sums_gradient():
    x = rand(2, 3, 2)
    text = tops_of('type: "Split"', 3)
    _, bottom, top = run_layer(text, [x])
    for t in top:
        assert t.data is bottom[0].data  # no copy in forward
        assert t.shape == x.shape
    check_gradient(text, [x])
    check_gradient(tops_of('type: "Split"', 1), [x])


# ----------------------------------------------------------------- Flatten
@pytest.mark.parametrize("param,shape", [
    ("", (2, 24)),
    ("flatten_param { axis: 2 }", (2, 3, 8)),
    ("flatten_param { axis: 1 end_axis: 2 }", (2, 12, 2)),
    ("flatten_param { axis: 0 end_axis: -2 }", (24, 2)),
])
def test_flatten(param, shape):
    x = rand(2, 3, 4, 2)
    text = 'type: "Flatten" %s' % param
    _, _, top = run_layer(text, [x])
    assert top[0].shape == shape
    np.testing.assert_array_equal(top[0].data, x.reshape(shape))
    check_gradient(text, [x])


# ----------------------------------------------------------------- Reshape
@pytest.mark.parametrize("param,shape", [
    ("shape { dim: 0 dim: -1 }", (2, 24)),
    ("shape { dim: 0 dim: 2 dim: -1 dim: 0 }", (2, 2, 6, 2)),
    ("shape { dim: -1 dim: 4 }", (12, 4)),
    ("shape { dim: 2 dim: 2 } axis: 1 num_axes: 1", (2, 2, 2, 3, 2)),
    ("shape { dim: 1 } axis: 0 num_axes: 0", (1, 2, 4, 3, 2)),
    ("shape { dim: -1 } axis: -3", (2, 4, 6)),
    ("shape { dim: 12 } axis: 1 num_axes: 2", (2, 12, 2)),
])
def test_reshape(param, shape):
    x = rand(2, 4, 3, 2)
    text = 'type: "Reshape" reshape_param { %s }' % param
    _, bottom, top = run_layer(text, [x])
    assert top[0].shape == shape
    np.testing.assert_array_equal(top[0].data, x.reshape(shape))
    assert np.shares_memory(top[0].data, bottom[0].data)  # same data, no copy
    check_gradient(text, [x])


def test_reshape_errors():
    x = rand(2, 4, 3)
    with pytest.raises(CaffeError, match="more than one -1"):
        run_layer('type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }', [x])
    with pytest.raises(CaffeError, match="divisible"):
        run_layer('type: "Reshape" reshape_param { shape { dim: 5 dim: -1 } }', [x])
    with pytest.raises(CaffeError, match="24 elements"):
        run_layer('type: "Reshape" reshape_param { shape { dim: 5 dim: 5 } }', [x])


# -------------------------------------------------------------------- Crop
@pytest.mark.parametrize("param,slices", [
    ("", (slice(None), slice(None), slice(0, 3), slice(0, 2))),
    ("crop_param { offset: 1 }", (slice(None), slice(None), slice(1, 4), slice(1, 3))),
    ("crop_param { axis: 1 offset: 1 offset: 2 offset: 0 }", (slice(None), slice(1, 3), slice(2, 5), slice(0, 2))),
    ("crop_param { axis: -1 offset: 2 }", (slice(None), slice(None), slice(None), slice(2, 4))),
])
def test_crop(param, slices):
    x = rand(2, 4, 5, 4)
    ref = np.zeros((2, 2, 3, 2))  # only its shape matters
    text = 'type: "Crop" %s' % param
    _, _, top = run_layer(text, [x, ref])
    expected = x[slices]
    assert top[0].shape == expected.shape
    np.testing.assert_array_equal(top[0].data, expected)
    check_gradient(text, [x, ref], check_bottoms=[0])


def test_crop_errors():
    with pytest.raises(CaffeError, match="cannot crop"):
        run_layer('type: "Crop" crop_param { offset: 3 }', [rand(1, 1, 4, 4), rand(1, 1, 2, 2)])
    with pytest.raises(CaffeError, match="crop offsets"):
        run_layer('type: "Crop" crop_param { offset: 0 offset: 0 offset: 0 }', [rand(1, 1, 4, 4), rand(1, 1, 2, 2)])


# -------------------------------------------------------------------- Tile
@pytest.mark.parametrize("axis,tiles", [(1, 3), (0, 2), (-1, 2)])
def test_tile(axis, tiles):
    x = rand(2, 3, 2)
    text = 'type: "Tile" tile_param { axis: %d tiles: %d }' % (axis, tiles)
    _, _, top = run_layer(text, [x])
    reps = [1, 1, 1]
    reps[axis] = tiles
    # np.tile repeats the whole block of axes >= axis, as Caffe does.
    ax = axis % 3
    expected = np.concatenate([x] * tiles, axis=ax)
    np.testing.assert_array_equal(top[0].data, expected)
    np.testing.assert_array_equal(top[0].data, np.tile(x, reps))
    check_gradient(text, [x])


# ----------------------------------------------------------------- Eltwise
def test_eltwise_sum_with_coeff():
    xs = [rand(2, 3, 2, seed=i) for i in range(3)]
    text = 'type: "Eltwise" eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }'
    _, _, top = run_layer(text, xs)
    np.testing.assert_allclose(top[0].data, xs[0] - 0.5 * xs[1] + 2 * xs[2])
    check_gradient(text, xs)
    _, _, top = run_layer('type: "Eltwise"', xs[:2])  # default SUM, coeff 1
    np.testing.assert_allclose(top[0].data, xs[0] + xs[1])
    check_gradient('type: "Eltwise"', xs[:2])


@pytest.mark.parametrize("stable", ["true", "false"])
def test_eltwise_prod(stable):
    xs = [distinct(2, 3, 2, seed=i) for i in range(3)]
    text = 'type: "Eltwise" eltwise_param { operation: PROD stable_prod_grad: %s }' % stable
    _, _, top = run_layer(text, xs)
    np.testing.assert_allclose(top[0].data, xs[0] * xs[1] * xs[2])
    check_gradient(text, xs)


def test_eltwise_max():
    xs = list(distinct(3, 2, 3, 2, seed=4))  # no ties across bottoms
    text = 'type: "Eltwise" eltwise_param { operation: MAX }'
    _, _, top = run_layer(text, xs)
    np.testing.assert_array_equal(top[0].data, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
    check_gradient(text, xs)


def test_eltwise_max_ties_follow_caffe():
    # Caffe: bottom 1 wins a tie with bottom 0; later bottoms need to be larger.
    a = np.array([1.0, 2.0, 0.0])
    b = np.array([1.0, 0.0, 2.0])
    c = np.array([1.0, 2.0, 2.0])
    layer, bottom, top = run_layer('type: "Eltwise" eltwise_param { operation: MAX }', [a, b, c])
    top[0].diff = np.array([10.0, 20.0, 30.0])
    layer.backward(top, [True] * 3, bottom)
    np.testing.assert_array_equal(bottom[0].diff, [0, 20, 0])
    np.testing.assert_array_equal(bottom[1].diff, [10, 0, 30])
    np.testing.assert_array_equal(bottom[2].diff, [0, 0, 0])


def test_eltwise_errors():
    with pytest.raises(CaffeError) as e:
        run_layer('name: "add" type: "Eltwise"', [rand(2, 3), rand(3, 2)])
    msg = str(e.value)
    assert "add" in msg and "(2, 3)" in msg and "(3, 2)" in msg
    with pytest.raises(CaffeError, match="one coeff per bottom"):
        run_layer('type: "Eltwise" eltwise_param { coeff: 1 }', [rand(2), rand(2)])
    with pytest.raises(CaffeError, match="only for operation SUM"):
        run_layer('type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 1 }', [rand(2), rand(2)])


# ----------------------------------------------------------------- Silence
def test_silence():
    xs = [rand(2, 3, seed=1), rand(4, seed=2)]
    layer, bottom, top = run_layer('type: "Silence"', xs, num_top=0)
    for b in bottom:
        b.diff = np.ones(b.shape)
    layer.backward([], [True, False], bottom)
    np.testing.assert_array_equal(bottom[0].diff, 0)
    np.testing.assert_array_equal(bottom[1].diff, 1)
    check_gradient('type: "Silence"', xs, num_top=0)


# --------------------------------------------------------------- Reduction
REDUCE = {
    "SUM": lambda x: x.sum(axis=1),
    "ASUM": lambda x: np.abs(x).sum(axis=1),
    "SUMSQ": lambda x: (x * x).sum(axis=1),
    "MEAN": lambda x: x.mean(axis=1),
}


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("coeff", [1.0, -2.5])
def test_reduction(op, axis, coeff):
    x = distinct(2, 3, 2, seed=3)
    text = 'type: "Reduction" reduction_param { operation: %s axis: %d coeff: %g }' % (op, axis, coeff)
    _, _, top = run_layer(text, [x])
    ax = axis % 3
    assert top[0].shape == x.shape[:ax]
    expected = coeff * REDUCE[op](x.reshape(int(np.prod(x.shape[:ax])), -1))
    np.testing.assert_allclose(top[0].data, expected.reshape(x.shape[:ax]))
    check_gradient(text, [x])


def test_reduction_default_is_sum_over_everything():
    x = rand(2, 3)
    _, _, top = run_layer('type: "Reduction"', [x])
    assert top[0].shape == ()
    np.testing.assert_allclose(top[0].data, x.sum())


# ------------------------------------------------------------------ ArgMax
def ref_topk(values, k):
    """(indices, values) of the k largest, ties to the larger index."""
    pairs = sorted(((v, i) for i, v in enumerate(values)), reverse=True)[:k]
    return [i for v, i in pairs], [v for v, i in pairs]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("out_max_val", [False, True])
def test_argmax_without_axis(k, out_max_val):
    x = rand(3, 2, 2, 2)
    x[1, 0, 1, 0] = x[1, 1, 1, 1] = 10.0  # a tie for the maximum
    text = 'type: "ArgMax" argmax_param { top_k: %d out_max_val: %s }' % (k, str(out_max_val).lower())
    _, _, top = run_layer(text, [x])
    assert top[0].shape == (3, 2 if out_max_val else 1, k, 1)
    for n in range(3):
        idx, vals = ref_topk(list(x[n].ravel()), k)
        np.testing.assert_array_equal(top[0].data[n, 0, :, 0], idx)
        if out_max_val:
            np.testing.assert_array_equal(top[0].data[n, 1, :, 0], vals)
    assert top[0].data[1, 0, 0, 0] == 7  # Caffe puts the larger index first


def test_argmax_2d_bottom_gets_three_axes():
    x = rand(4, 5)
    _, _, top = run_layer('type: "ArgMax"', [x])
    assert top[0].shape == (4, 1, 1)
    np.testing.assert_array_equal(top[0].data[:, 0, 0], x.argmax(axis=1))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("out_max_val", [False, True])
def test_argmax_with_axis(axis, k, out_max_val):
    x = rand(3, 4, 2)
    text = 'type: "ArgMax" argmax_param { axis: %d top_k: %d out_max_val: %s }' % (
        axis, k, str(out_max_val).lower())
    _, _, top = run_layer(text, [x])
    ax = axis % 3
    shape = list(x.shape)
    shape[ax] = k
    assert top[0].shape == tuple(shape)
    xm = np.moveaxis(x, ax, -1)
    ym = np.moveaxis(top[0].data, ax, -1)
    for pos in np.ndindex(xm.shape[:-1]):
        idx, vals = ref_topk(list(xm[pos]), k)
        np.testing.assert_array_equal(ym[pos], vals if out_max_val else idx)


def test_argmax_errors_and_no_backward():
    with pytest.raises(CaffeError, match="top_k"):
        run_layer('type: "ArgMax" argmax_param { top_k: 5 axis: 1 }', [rand(2, 3)])
    with pytest.raises(CaffeError, match="top_k"):
        run_layer('type: "ArgMax" argmax_param { top_k: 7 }', [rand(2, 3)])
    layer, bottom, top = run_layer('type: "ArgMax"', [rand(2, 3)])
    with pytest.raises(CaffeError):
        layer.backward(top, [True], bottom)


def test_float32_forward_dtypes():
    xs = [rand(2, 3, 4, seed=i).astype(np.float32) for i in range(2)]
    for text, n in [('type: "Concat"', 2), ('type: "Eltwise" eltwise_param { coeff: 2 coeff: 1 }', 2),
                    ('type: "Reduction" reduction_param { operation: MEAN axis: 1 }', 1),
                    ('type: "Tile" tile_param { tiles: 2 }', 1), ('type: "ArgMax"', 1),
                    ('type: "Crop" crop_param { axis: 1 offset: 0 }', 2)]:
        layer = make_layer(text, dtype=np.float32)
        _, _, top = run_layer(layer, xs[:n], dtype=np.float32)
        assert top[0].data.dtype == np.float32, text


# ------------------------------------------------ Eltwise SUM → ReLU, fused
def eltwise_relu_net(coeffs, propagate=(True, True)):
    """Two inputs (each through a convolution unless its gradient is not
    wanted), their Eltwise SUM and a ReLU in place, an InnerProduct whose
    output is the loss."""
    from caffempi.proto import caffe_pb2
    from google.protobuf import text_format
    text = ""
    for k, wanted in enumerate(propagate):
        text += 'layer { name: "in%d" type: "Input" top: "x%d" input_param { shape { dim: 4 dim: 3 dim: 30 dim: 40 } } }\n' % (k, k)
        source = "x%d" % k
        if wanted:
            text += ('layer { name: "c%d" type: "Convolution" bottom: "x%d" top: "c%d" '
                     'convolution_param { num_output: 3 kernel_size: 1 } }\n' % (k, k, k))
            source = "c%d" % k
        text += 'layer { name: "id%d" type: "Power" bottom: "%s" top: "b%d" }\n' % (k, source, k)
    text += 'layer { name: "sum" type: "Eltwise" bottom: "b0" bottom: "b1" top: "s" eltwise_param { %s } }\n' % \
        " ".join("coeff: %g" % c for c in coeffs)
    text += 'layer { name: "r" type: "ReLU" bottom: "s" top: "s" }\n'
    text += ('layer { name: "ip" type: "InnerProduct" bottom: "s" top: "y" loss_weight: 1 '
             'inner_product_param { num_output: 2 } }\n')
    return text_format.Merge(text, caffe_pb2.NetParameter())


def run_eltwise_relu(fuse, coeffs=(), propagate=(True, True), ranges=None):
    from caffempi import config
    from caffempi.common import TRAIN
    from caffempi.net import Net
    with config.using_config(fuse=fuse):
        net = Net(eltwise_relu_net(coeffs, propagate), TRAIN)
    for k, name in enumerate(net.params):
        for j, blob in enumerate(net.params[name]):
            blob.data[...] = rand(*blob.data.shape, seed=10 * k + j)
    for k in range(2):
        net.blobs["x%d" % k].data[...] = rand(4, 3, 30, 40, seed=k + 1)
    if ranges is None:
        net.forward()
    else:
        net.forward(end="sum")
        net.forward(start="r")
    if ranges is None:
        net.backward()
    else:
        net.backward(end="r")
        net.backward(start="sum")
    seen = {"y": net.blobs["y"].data.copy()}
    for k in range(2):
        seen["b%d diff" % k] = net.blobs["b%d" % k].diff.copy()
    for name in net.params:
        for j, blob in enumerate(net.params[name]):
            seen["%s %d diff" % (name, j)] = blob.diff.copy()
    return seen


@pytest.mark.parametrize("kw", [{}, {"coeffs": (1, -0.5)}, {"coeffs": (2, 1)}, {"propagate": (False, True)},
                                {"ranges": True}])
def test_fused_eltwise_relu_gives_the_layers_numbers_bitwise(kw, monkeypatch):
    from caffempi.layer_types.neuron import ReLULayer
    alone = run_eltwise_relu(False, **kw)
    if "ranges" not in kw:      # whole passes: the ReLU never runs by itself
        monkeypatch.setattr(ReLULayer, "forward", lambda *a: pytest.fail("ReLU ran by itself"))
        monkeypatch.setattr(ReLULayer, "backward", lambda *a: pytest.fail("ReLU ran by itself"))
    fused = run_eltwise_relu(True, **kw)
    assert fused.keys() == alone.keys()
    for key in alone:
        assert np.array_equal(fused[key], alone[key]), key
