"""Tests of the elementwise neuron layers (caffempi/layer_types/neuron.py)."""
import numpy as np
import pytest

from caffempi.blob import Blob
from caffempi.common import TEST, TRAIN, CaffeError, set_random_seed
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer

SHAPE = (2, 3, 3, 2)


def away_from(x, points, gap=0.05):
    """Push values within ``gap`` of any kink in ``points`` out by ``gap``."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def rand(shape=SHAPE, lo=-2.0, hi=2.0, seed=0, kinks=()):
    x = np.random.RandomState(seed).uniform(lo, hi, shape)
    return away_from(x, kinks) if kinks else x


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ----------------------------------------------------------- forward values
FORWARD_CASES = [
    ('type: "ReLU"', rand(), lambda x: np.maximum(x, 0)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', rand(),
     lambda x: np.where(x > 0, x, 0.1 * x)),
    ('type: "ELU"', rand(), lambda x: np.where(x > 0, x, np.exp(x) - 1)),
    ('type: "ELU" elu_param { alpha: 0.5 }', rand(),
     lambda x: np.where(x > 0, x, 0.5 * (np.exp(x) - 1))),
    ('type: "Sigmoid"', rand(lo=-30, hi=30), _sigmoid),
    ('type: "TanH"', rand(), np.tanh),
    ('type: "AbsVal"', rand(), np.abs),
    ('type: "BNLL"', rand(lo=-50, hi=50), lambda x: np.log1p(np.exp(x))),
    ('type: "Power" power_param { power: 3 scale: 0.5 shift: 1 }', rand(),
     lambda x: (1 + 0.5 * x) ** 3),
    ('type: "Power" power_param { power: 0.5 scale: 2 shift: 5 }', rand(),
     lambda x: np.sqrt(5 + 2 * x)),
    ('type: "Power" power_param { power: 0 scale: 2 }', rand(), lambda x: np.ones_like(x)),
    ('type: "Power"', rand(), lambda x: x),
    ('type: "Exp"', rand(), np.exp),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 1 }', rand(),
     lambda x: 2.0 ** (1 + 0.5 * x)),
    ('type: "Log"', rand(lo=0.1, hi=3), np.log),
    ('type: "Log" log_param { base: 10 scale: 2 shift: 5 }', rand(),
     lambda x: np.log10(5 + 2 * x)),
    ('type: "Threshold" threshold_param { threshold: 0.3 }', rand(),
     lambda x: (x > 0.3).astype(float)),
    ('type: "Clip" clip_param { min: -0.5 max: 1 }', rand(), lambda x: np.clip(x, -0.5, 1)),
    ('type: "Swish"', rand(), lambda x: x * _sigmoid(x)),
    ('type: "Swish" swish_param { beta: 2.5 }', rand(), lambda x: x * _sigmoid(2.5 * x)),
]


@pytest.mark.parametrize("text,x,ref", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_matches_numpy(text, x, ref):
    _, bottoms, tops = run_layer(text, [x])
    assert tops[0].shape == x.shape
    # proto parameters are float32 (0.1 is 0.10000000149), hence rtol 1e-7
    np.testing.assert_allclose(tops[0].data, ref(x), rtol=1e-7, atol=1e-12)
    np.testing.assert_array_equal(bottoms[0].data, x)  # bottom untouched


def test_float32_stays_float32():
    for text, x, _ in FORWARD_CASES:
        _, _, tops = run_layer(text, [x], dtype=np.float32)
        assert tops[0].data.dtype == np.float32, text


def test_bnll_and_sigmoid_extreme_inputs_are_finite():
    x = np.array([[-1000.0, -60.0, 0.0, 60.0, 1000.0]])
    _, _, tops = run_layer('type: "BNLL"', [x], dtype=np.float32)
    np.testing.assert_allclose(tops[0].data[0], np.logaddexp(0, x[0]), rtol=1e-6, atol=1e-30)
    _, _, tops = run_layer('type: "Sigmoid"', [x], dtype=np.float32)
    np.testing.assert_allclose(tops[0].data[0], [0, 0, 0.5, 1, 1], atol=1e-7)


def test_prelu_forward_per_channel_and_shared():
    x = rand()
    layer, _, tops = run_layer('type: "PReLU"', [x])
    assert layer.blobs[0].shape == (3,)
    np.testing.assert_array_equal(layer.blobs[0].data, 0.25)
    np.testing.assert_allclose(tops[0].data, np.where(x > 0, x, 0.25 * x))

    slopes = np.array([0.1, -0.3, 2.0])
    layer = make_layer('type: "PReLU"')
    layer.blobs = [Blob((3,), np, np.float64)]
    layer.blobs[0].data = slopes.copy()
    _, _, tops = run_layer(layer, [x])
    ref = np.empty_like(x)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            v = x[n, c]
            ref[n, c] = np.where(v > 0, v, slopes[c] * v)
    np.testing.assert_allclose(tops[0].data, ref)

    layer, _, tops = run_layer(
        'type: "PReLU" prelu_param { channel_shared: true filler { type: "constant" value: 0.7 } }',
        [x])
    assert layer.blobs[0].shape == () and layer.blobs[0].count == 1
    np.testing.assert_allclose(tops[0].data, np.where(x > 0, x, 0.7 * x))


def test_prelu_rejects_bad_shapes():
    with pytest.raises(CaffeError, match="2 axes"):
        run_layer('type: "PReLU"', [np.ones(4)])
    layer = make_layer('type: "PReLU"')
    layer.blobs = [Blob((2,), np, np.float64)]
    with pytest.raises(CaffeError, match="slopes"):
        run_layer(layer, [rand()])


def test_threshold_refuses_backward():
    layer, bottoms, tops = run_layer('type: "Threshold" threshold_param { threshold: 0.3 }', [rand()])
    tops[0].diff = np.ones(SHAPE)
    layer.backward(tops, [False], bottoms)  # nothing asked: fine
    with pytest.raises(CaffeError, match="Threshold"):
        layer.backward(tops, [True], bottoms)


def test_absval_refuses_in_place():
    layer = make_layer('type: "AbsVal"')
    b = Blob(SHAPE, np, np.float64)
    with pytest.raises(CaffeError, match="in place"):
        layer.setup([b], [b])


def test_bad_exp_log_base():
    for t in ("Exp", "Log"):
        with pytest.raises(CaffeError, match="base"):
            run_layer('type: "%s" %s_param { base: -2 }' % (t, t.lower()), [rand()])


# ---------------------------------------------------------------- dropout
def _dropout(x, scale_train, phase, seed=5):
    """A set-up and forwarded Dropout layer (ratio 0.3; inverted dropout)."""
    layer = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', phase)
    b, t = Blob(x.shape, np, np.float64), Blob((), np, np.float64)
    b.data = x.copy()
    layer.setup([b], [t])
    layer.reshape([b], [t])
    set_random_seed(seed)
    layer.forward([b], [t])
    return layer, [b], [t]


@pytest.mark.parametrize("scale_train", [True])
def test_dropout_train_and_test(scale_train):
    x = rand(shape=(4, 50, 5), lo=0.5, hi=2)
    dy = rand(shape=x.shape, seed=3)
    layer, bottoms, tops = _dropout(x, scale_train, TRAIN)
    y = tops[0].data
    kept = y != 0
    # the mask is uniform > ratio, drawn from the (reseeded) process RNG
    set_random_seed(5)
    from caffempi.common import rng
    ref_mask = rng().random_sample(x.shape) > 0.3
    np.testing.assert_array_equal(kept, ref_mask)
    scale = 1 / 0.7 if scale_train else 1.0
    np.testing.assert_allclose(y[kept], x[kept] * scale)
    assert 0.6 < kept.mean() < 0.8
    tops[0].diff = dy
    layer.backward(tops, [True], bottoms)
    np.testing.assert_allclose(bottoms[0].diff, dy * ref_mask * scale)

    layer, bottoms, tops = _dropout(x, scale_train, TEST)
    test_scale = 1.0 if scale_train else 0.7
    np.testing.assert_allclose(tops[0].data, x * test_scale)
    assert tops[0].data is not bottoms[0].data
    tops[0].diff = dy
    layer.backward(tops, [True], bottoms)
    np.testing.assert_allclose(bottoms[0].diff, dy * test_scale)


def test_dropout_default_ratio_and_bad_ratio():
    layer, _, _ = run_layer('type: "Dropout"', [rand()])
    assert layer.ratio == 0.5
    with pytest.raises(CaffeError, match="dropout_ratio"):
        run_layer('type: "Dropout" dropout_param { dropout_ratio: 1 }', [rand()])


def test_dropout_gradient():
    check_gradient('type: "Dropout" dropout_param { dropout_ratio: 0.4 }', [rand()])
    check_gradient('type: "Dropout"', [rand()], phase=TEST)


# ----------------------------------------------------------- gradient checks
GRADIENT_CASES = [
    ('type: "ReLU"', (0,)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', (0,)),
    ('type: "ReLU" relu_param { negative_slope: -0.5 }', (0,)),
    ('type: "PReLU"', (0,)),
    ('type: "PReLU" prelu_param { filler { type: "uniform" min: -0.5 max: 0.5 } }', (0,)),
    ('type: "PReLU" prelu_param { channel_shared: true }', (0,)),
    ('type: "ELU"', (0,)),
    ('type: "ELU" elu_param { alpha: 0.3 }', (0,)),
    ('type: "ELU" elu_param { alpha: -0.7 }', (0,)),
    ('type: "Sigmoid"', ()),
    ('type: "TanH"', ()),
    ('type: "AbsVal"', (0,)),
    ('type: "BNLL"', ()),
    ('type: "Power" power_param { power: 3 scale: 0.5 shift: 1 }', ()),
    ('type: "Power" power_param { power: 2 scale: -1.5 shift: 0.5 }', ()),
    ('type: "Power" power_param { power: 0.37 scale: 0.5 shift: 3 }', ()),
    ('type: "Power" power_param { power: 1 scale: 1.7 shift: 1 }', ()),
    ('type: "Power" power_param { power: 0 scale: 2 shift: 1 }', ()),
    ('type: "Exp"', ()),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 1 }', ()),
    ('type: "Log" log_param { scale: 0.5 shift: 3 }', ()),
    ('type: "Log" log_param { base: 2 scale: 2 shift: 5 }', ()),
    ('type: "Clip" clip_param { min: -0.5 max: 1 }', (-0.5, 1)),
    ('type: "Swish"', ()),
    ('type: "Swish" swish_param { beta: 2.5 }', ()),
]


@pytest.mark.parametrize("text,kinks", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_gradient(text, kinks):
    kinks = kinks if "ReLU" in text or "ELU" in text or "AbsVal" in text or "Clip" in text else ()
    check_gradient(text, [rand(kinks=kinks)])


# ------------------------------------------------------------------ in place
def _run(text, x, dy, in_place, phase=TRAIN, seed=7):
    layer = make_layer(text, phase)
    b = Blob(x.shape, np, np.float64)
    b.data = x.copy()
    t = b if in_place else Blob((), np, np.float64)
    set_random_seed(seed)
    layer.setup([b], [t])
    layer.reshape([b], [t])
    set_random_seed(seed)
    layer.forward([b], [t])
    y = t.data.copy()
    t.diff = dy.copy()
    for p in layer.blobs:
        p.diff = np.zeros(p.shape)
    layer.backward([t], [True], [b])
    return y, b.diff.copy(), [p.diff.copy() for p in layer.blobs]


IN_PLACE_CASES = [c[0] for c in GRADIENT_CASES if "AbsVal" not in c[0]] + [
    'type: "Dropout" dropout_param { dropout_ratio: 0.4 }']


@pytest.mark.parametrize("text", IN_PLACE_CASES)
@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_in_place_matches_out_of_place(text, phase):
    x = rand(kinks=(0, -0.5, 1))
    dy = rand(seed=1)
    y0, dx0, dp0 = _run(text, x, dy, False, phase)
    y1, dx1, dp1 = _run(text, x, dy, True, phase)
    np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-14)
    for a, b in zip(dp1, dp0):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_threshold_in_place_forward():
    x = rand()
    layer = make_layer('type: "Threshold" threshold_param { threshold: -0.2 }')
    b = Blob(x.shape, np, np.float64)
    b.data = x.copy()
    layer.setup([b], [b])
    layer.reshape([b], [b])
    layer.forward([b], [b])
    np.testing.assert_array_equal(b.data, (x > -0.2).astype(float))


def test_prelu_param_gradient_accumulates():
    x, dy = rand(), rand(seed=1)
    layer, bottoms, tops = run_layer('type: "PReLU"', [x])
    tops[0].diff = dy
    layer.blobs[0].diff = np.zeros(3)
    layer.backward(tops, [False], bottoms)
    once = layer.blobs[0].diff.copy()
    ref = np.array([(dy[:, c] * np.minimum(x[:, c], 0)).sum() for c in range(3)])
    np.testing.assert_allclose(once, ref)
    layer.backward(tops, [False], bottoms)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * ref)
