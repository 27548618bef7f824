"""SPP: Caffe's pyramid geometry (GetPoolingParam) against loops written
here, a hand-computed pyramid, rebuilding for a new H x W, finite-difference
gradients, errors."""
import math

import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, run_layer


def distinct(*shape, seed=0):
    """No ties (MAX picks one element) and gaps far above the check's eps."""
    return np.random.RandomState(seed).permutation(int(np.prod(shape))).reshape(shape) / 10.0


def spp_text(height, pool="MAX"):
    return 'type: "SPP" spp_param { pyramid_height: %d pool: %s }' % (height, pool)


def ref_level(x, bins, pool):
    """One pyramid level by loops: Caffe's kernel ceil(H/bins), stride = kernel,
    pad (kernel*bins - H + 1)/2; windows clipped to the image (AVE divides by
    the window clipped to the padded image, as Caffe's pooling)."""
    n, c, h, w = x.shape
    kh, kw = math.ceil(h / bins), math.ceil(w / bins)
    ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
    out = np.zeros((n, c, bins, bins))
    for i in range(bins):
        for j in range(bins):
            h0, w0 = i * kh - ph, j * kw - pw
            h1, w1 = min(h0 + kh, h + ph), min(w0 + kw, w + pw)
            area = (h1 - h0) * (w1 - w0)
            win = x[:, :, max(h0, 0):min(h1, h), max(w0, 0):min(w1, w)]
            out[:, :, i, j] = win.max(axis=(2, 3)) if pool == "MAX" else win.sum(axis=(2, 3)) / area
    return out


def ref_spp(x, height, pool):
    levels = [ref_level(x, 2 ** level, pool) for level in range(height)]
    if height == 1:
        return levels[0]
    return np.concatenate([a.reshape(x.shape[0], -1) for a in levels], axis=1)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("height,shape", [(1, (2, 3, 5, 4)), (2, (2, 3, 7, 6)), (3, (1, 2, 9, 11)),
                                          (3, (2, 1, 8, 8))])
def test_forward_matches_loops(pool, height, shape):
    x = distinct(*shape)
    _, _, top = run_layer(spp_text(height, pool), [x])
    want = ref_spp(x, height, pool)
    assert top[0].shape == want.shape
    np.testing.assert_allclose(top[0].data, want, rtol=1e-12)


def test_hand_computed_pyramid():
    # 4x4 per channel: level 0 is the channel's max, level 1 the maxes of
    # the four 2x2 quadrants; channels in order inside each level
    x = np.stack([np.arange(16.0), 100 - np.arange(16.0)]).reshape(1, 2, 4, 4)
    _, _, top = run_layer(spp_text(2), [x])
    np.testing.assert_array_equal(top[0].data, [[15, 100, 5, 7, 13, 15, 100, 98, 92, 90]])


def test_height_one_is_the_unflattened_global_pooling():
    x = distinct(2, 3, 5, 4)
    _, _, top = run_layer(spp_text(1, "AVE"), [x])
    assert top[0].shape == (2, 3, 1, 1)
    np.testing.assert_allclose(top[0].data[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-12)


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("height,shape", [(1, (2, 2, 5, 4)), (2, (2, 2, 7, 6)), (3, (1, 2, 9, 8))])
def test_gradient(pool, height, shape):
    check_gradient(spp_text(height, pool), [distinct(*shape)])


def test_new_bottom_size_rebuilds_the_levels():
    layer, bottom, top = run_layer(spp_text(3), [distinct(1, 2, 8, 8)])
    x = distinct(1, 2, 13, 10, seed=1)
    bottom[0].reshape(x.shape)
    bottom[0].data = x
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, ref_spp(x, 3, "MAX"), rtol=1e-12)


@pytest.mark.parametrize("text,shape,match", [
    (spp_text(3), (1, 1, 3, 8), "too small for pyramid level 2"),      # 4 bins of 3 rows: pad 1, kernel 1
    (spp_text(2, "STOCHASTIC"), (1, 1, 4, 4), "MAX and AVE"),
    (spp_text(0), (1, 1, 4, 4), "pyramid_height"),
    (spp_text(2), (1, 4, 4), "4-D"),
])
def test_errors(text, shape, match):
    with pytest.raises(CaffeError, match=match):
        run_layer(text, [np.zeros(shape)])
