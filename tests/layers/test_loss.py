import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.blob import Blob
from caffempi.proto import caffe_pb2
from caffempi.testing.gradient_check import check_gradient, make_layer, run_layer

NORMS = ["VALID", "BATCH_SIZE", "FULL", "NONE"]


def rs(seed):
    return np.random.RandomState(seed)


def scalar(top):
    assert top.shape == ()
    return float(top.data)


# ----------------------------------------------------------------- references
def ref_normalizer(mode, outer, inner, valid):
    n = {"VALID": valid, "BATCH_SIZE": outer, "FULL": outer * inner, "NONE": 1}[mode]
    return max(1.0, float(n))


def ref_probs(x, axis):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        e = np.exp(x[idx] - x[idx].max())
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, axis)


def ref_softmax_loss(x, label, axis=1, ignore=None, mode="VALID"):
    p = np.moveaxis(ref_probs(x, axis), axis, -1).reshape(-1, x.shape[axis])
    outer = int(np.prod(x.shape[:axis]))
    inner = int(np.prod(x.shape[axis + 1:]))
    loss, count = 0.0, 0
    for i, l in enumerate(label.reshape(-1).astype(int)):
        if ignore is not None and l == ignore:
            continue
        loss -= np.log(max(p[i, l], np.finfo(np.float32).tiny))
        count += 1
    return loss / ref_normalizer(mode, outer, inner, count)


def ref_accuracy(x, label, top_k=1, axis=1, ignore=None):
    c = x.shape[axis]
    s = np.moveaxis(x, axis, -1).reshape(-1, c)
    hits, count = 0, 0
    per_hit, per_num = np.zeros(c), np.zeros(c)
    for i, l in enumerate(label.reshape(-1).astype(int)):
        if ignore is not None and l == ignore:
            continue
        better = sum(1 for k in range(c) if k != l and s[i, k] >= s[i, l])
        ok = better < top_k
        hits += ok
        count += 1
        per_num[l] += 1
        per_hit[l] += ok
    per = np.where(per_num > 0, per_hit / np.maximum(per_num, 1), 0)
    return (hits / count if count else 0.0), per


def labels(seed, shape, c, ignore=None, n_ignore=0):
    lab = rs(seed).randint(0, c, shape).astype(np.float64)
    if ignore is not None:
        lab.reshape(-1)[:n_ignore] = ignore
    return lab


# ------------------------------------------------------------ SoftmaxWithLoss
def swl(extra="", loss=""):
    return 'type: "SoftmaxWithLoss" %s loss_param { %s }' % (extra, loss)


@pytest.mark.parametrize("mode", NORMS)
def test_softmax_loss_forward_normalization(mode):
    x = rs(0).randn(3, 4, 2, 2)
    lab = labels(1, (3, 1, 2, 2), 4, ignore=255, n_ignore=3)
    _, _, tops = run_layer(swl(loss="ignore_label: 255 normalization: %s" % mode), [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_softmax_loss(x, lab, ignore=255, mode=mode), rel=1e-12)


def test_softmax_loss_default_is_valid_and_legacy_normalize():
    x = rs(2).randn(4, 3)
    lab = labels(3, (4,), 3, ignore=1, n_ignore=1)
    for loss, mode in [("", "VALID"), ("normalize: false", "BATCH_SIZE"),
                       ("normalize: true", "VALID"),
                       ("normalize: false normalization: FULL", "FULL")]:
        _, _, tops = run_layer(swl(loss="ignore_label: 1 " + loss), [x, lab])
        assert scalar(tops[0]) == pytest.approx(ref_softmax_loss(x, lab, ignore=1, mode=mode))


def test_softmax_loss_axis_and_prob_top():
    x = rs(4).randn(2, 3, 5)
    lab = labels(5, (2, 3), 5)
    text = 'type: "SoftmaxWithLoss" softmax_param { axis: 2 } top: "loss" top: "prob"'
    layer, _, tops = run_layer(text, [x, lab])
    assert layer.is_loss and not layer.allow_force_backward(1)
    assert scalar(tops[0]) == pytest.approx(ref_softmax_loss(x, lab, axis=2))
    assert tops[1].shape == x.shape
    np.testing.assert_allclose(tops[1].data, ref_probs(x, 2), rtol=1e-12)


def test_softmax_loss_all_ignored_gives_zero():
    x = rs(6).randn(2, 3)
    lab = np.array([7.0, 7.0])
    _, _, tops = run_layer(swl(loss="ignore_label: 7"), [x, lab])
    assert scalar(tops[0]) == 0.0


@pytest.mark.parametrize("bad", [3.0, -1.0])
def test_softmax_loss_label_out_of_range(bad):
    x = rs(7).randn(2, 3)
    with pytest.raises(CaffeError, match=r"label value %d .*3 classes" % int(bad)):
        run_layer(swl(), [x, np.array([0.0, bad])])


def test_softmax_loss_label_count_mismatch():
    with pytest.raises(CaffeError, match="number of labels"):
        run_layer(swl(), [np.zeros((2, 3, 2)), np.zeros((2, 3))])


@pytest.mark.parametrize("loss", ["", "ignore_label: 2", "ignore_label: 2 normalization: BATCH_SIZE",
                                  "ignore_label: 2 normalization: FULL", "normalization: NONE",
                                  "normalize: false"])
def test_softmax_loss_gradient(loss):
    x = rs(8).randn(3, 4, 2)
    lab = labels(9, (3, 2), 4, ignore=2 if "ignore" in loss else None, n_ignore=2)
    check_gradient(swl(loss=loss), [x, lab], check_bottoms=[0])


def test_softmax_loss_gradient_axis2():
    x = rs(10).randn(2, 3, 4)
    lab = labels(11, (2, 3), 4)
    check_gradient(swl(extra="softmax_param { axis: 2 }"), [x, lab], check_bottoms=[0])


def test_loss_backward_to_labels_raises():
    layer, bottoms, tops = run_layer(swl(), [rs(0).randn(2, 3), np.array([0.0, 1.0])])
    tops[0].diff = np.ones((), np.float64)
    with pytest.raises(CaffeError, match="backpropagate"):
        layer.backward(tops, [True, True], bottoms)


# ------------------------------------------------------------------- Accuracy
def test_accuracy_top1_and_topk():
    x = rs(12).randn(20, 6)
    lab = labels(13, (20,), 6)
    for k in (1, 2, 3):
        _, _, tops = run_layer('type: "Accuracy" accuracy_param { top_k: %d }' % k, [x, lab])
        assert scalar(tops[0]) == pytest.approx(ref_accuracy(x, lab, top_k=k)[0])


def test_accuracy_ignore_label_and_per_class():
    x = rs(14).randn(12, 4)
    lab = labels(15, (12,), 4, ignore=-1, n_ignore=3)
    text = 'type: "Accuracy" accuracy_param { ignore_label: -1 } top: "acc" top: "per_class"'
    layer, _, tops = run_layer(text, [x, lab])
    assert not layer.is_loss
    acc, per = ref_accuracy(x, lab, ignore=-1)
    assert scalar(tops[0]) == pytest.approx(acc)
    assert tops[1].shape == (4,)
    np.testing.assert_allclose(tops[1].data, per)


def test_accuracy_per_class_missing_class_is_zero():
    x = np.array([[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [0.7, 0.3, 0.0]])
    lab = np.array([0.0, 0.0, 1.0])
    _, _, tops = run_layer('type: "Accuracy" top: "a" top: "b"', [x, lab])
    assert scalar(tops[0]) == pytest.approx(1 / 3)
    np.testing.assert_allclose(tops[1].data, [0.5, 0.0, 0.0])


def test_accuracy_ties_count_against_true_class():
    # true class 1 ties with class 0: one other class scores >= it
    x = np.array([[0.5, 0.5, 0.0], [0.2, 0.5, 0.5], [0.1, 0.6, 0.3]])
    lab = np.array([1.0, 1.0, 1.0])
    _, _, tops = run_layer('type: "Accuracy"', [x, lab])
    assert scalar(tops[0]) == pytest.approx(1 / 3)
    _, _, tops = run_layer('type: "Accuracy" accuracy_param { top_k: 2 }', [x, lab])
    assert scalar(tops[0]) == pytest.approx(1.0)
    # three-way tie: needs top_k 3
    x3 = np.array([[0.3, 0.3, 0.3]])
    for k, want in ((1, 0.0), (2, 0.0), (3, 1.0)):
        _, _, tops = run_layer('type: "Accuracy" accuracy_param { top_k: %d }' % k, [x3, np.array([2.0])])
        assert scalar(tops[0]) == want


def test_accuracy_axis():
    x = rs(16).randn(2, 3, 5)
    lab = labels(17, (2, 3), 5)
    _, _, tops = run_layer('type: "Accuracy" accuracy_param { axis: 2 }', [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_accuracy(x, lab, axis=2)[0])
    x = rs(18).randn(2, 4, 3)
    lab = labels(19, (2, 3), 4)
    _, _, tops = run_layer('type: "Accuracy"', [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_accuracy(x, lab, axis=1)[0])


def test_accuracy_errors():
    with pytest.raises(CaffeError, match="top_k"):
        run_layer('type: "Accuracy" accuracy_param { top_k: 4 }', [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(CaffeError, match="label value 3"):
        run_layer('type: "Accuracy"', [np.zeros((2, 3)), np.array([0.0, 3.0])])
    layer, bottoms, tops = run_layer('type: "Accuracy"', [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(CaffeError):
        layer.backward(tops, [True, False], bottoms)


# -------------------------------------------------------------- EuclideanLoss
def test_euclidean_forward_and_gradient():
    a, b = rs(20).randn(4, 3, 2), rs(21).randn(4, 6)
    layer, _, tops = run_layer('type: "EuclideanLoss"', [a, b])
    ref = sum((a.reshape(4, -1)[i, j] - b[i, j]) ** 2 for i in range(4) for j in range(6)) / 4 / 2
    assert scalar(tops[0]) == pytest.approx(ref)
    assert layer.allow_force_backward(1)
    check_gradient('type: "EuclideanLoss"', [a, b], check_bottoms=[0, 1])


def test_euclidean_shape_mismatch():
    with pytest.raises(CaffeError, match=r"\(4, 3\).*\(4, 2\)"):
        run_layer('type: "EuclideanLoss"', [np.zeros((4, 3)), np.zeros((4, 2))])
    with pytest.raises(CaffeError, match="first dimension"):
        run_layer('type: "EuclideanLoss"', [np.zeros((4, 3)), np.zeros((3, 3))])


# ---------------------------------------------------- SigmoidCrossEntropyLoss
def ref_sigmoid_ce(x, t, ignore=None, mode="BATCH_SIZE"):
    loss, count = 0.0, 0
    for xi, ti in zip(x.reshape(-1), t.reshape(-1)):
        if ignore is not None and int(ti) == ignore:
            continue
        p = 1 / (1 + np.exp(-xi))
        loss -= ti * np.log(p) + (1 - ti) * np.log(1 - p)
        count += 1
    return loss / ref_normalizer(mode, x.shape[0], x[0].size, count)


def sce_inputs(seed, ignore=False):
    x = rs(seed).randn(3, 4) * 2
    t = rs(seed + 1).uniform(0, 1, (3, 4))
    if ignore:
        t.reshape(-1)[[1, 5, 6]] = -1
    return x, t


@pytest.mark.parametrize("loss,mode", [("", "BATCH_SIZE"), ("normalization: VALID", "VALID"),
                                       ("normalization: FULL", "FULL"), ("normalization: NONE", "NONE"),
                                       ("normalize: true", "VALID")])
def test_sigmoid_ce_forward(loss, mode):
    x, t = sce_inputs(22, ignore=True)
    _, _, tops = run_layer('type: "SigmoidCrossEntropyLoss" loss_param { ignore_label: -1 %s }' % loss,
                           [x, t])
    assert scalar(tops[0]) == pytest.approx(ref_sigmoid_ce(x, t, -1, mode), rel=1e-10)


def test_sigmoid_ce_stable_for_large_logits():
    x = np.array([[800.0, -800.0, 30.0]])
    t = np.array([[1.0, 0.0, 1.0]])
    _, _, tops = run_layer('type: "SigmoidCrossEntropyLoss"', [x, t], dtype=np.float32)
    assert np.isfinite(scalar(tops[0])) and scalar(tops[0]) < 1e-6


@pytest.mark.parametrize("loss", ["", "ignore_label: -1 normalization: VALID",
                                  "ignore_label: -1 normalization: FULL"])
def test_sigmoid_ce_gradient(loss):
    x, t = sce_inputs(24, ignore="ignore" in loss)
    check_gradient('type: "SigmoidCrossEntropyLoss" loss_param { %s }' % loss, [x, t], check_bottoms=[0])


# ------------------------------------------------------------------ HingeLoss
def ref_hinge(x, lab, norm):
    n = x.shape[0]
    x = x.reshape(n, -1)
    loss = 0.0
    for i in range(n):
        for j in range(x.shape[1]):
            s = -1.0 if j == int(lab[i]) else 1.0
            t = max(0.0, 1 + s * x[i, j])
            loss += t if norm == "L1" else t * t
    return loss / n


def hinge_inputs(seed):
    x = rs(seed).uniform(-2, 2, (4, 5))
    lab = labels(seed + 1, (4,), 5)
    s = np.where(np.arange(5)[None, :] == lab[:, None], -1.0, 1.0)
    near = np.abs(1 + s * x) < 0.1        # keep away from the hinge's kink
    x[near] += 0.3
    return x, lab


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_forward_and_gradient(norm):
    x, lab = hinge_inputs(26)
    text = 'type: "HingeLoss" hinge_loss_param { norm: %s }' % norm
    _, _, tops = run_layer(text, [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_hinge(x, lab, norm))
    check_gradient(text, [x, lab], check_bottoms=[0])


def test_hinge_default_norm_is_l1():
    x, lab = hinge_inputs(28)
    _, _, tops = run_layer('type: "HingeLoss"', [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_hinge(x, lab, "L1"))


# ------------------------------------------------------------ ContrastiveLoss
def ref_contrastive(a, b, y, margin, legacy):
    n = a.shape[0]
    loss = 0.0
    for i in range(n):
        d2 = float(((a[i] - b[i]) ** 2).sum())
        if int(y[i]):
            loss += d2
        elif legacy:
            loss += max(margin - d2, 0.0)
        else:
            loss += max(margin - np.sqrt(d2), 0.0) ** 2
    return loss / n / 2


def contrastive_inputs(seed, margin, legacy):
    r = rs(seed)
    while True:
        a, b = r.uniform(-0.5, 0.5, (6, 3)), r.uniform(-0.5, 0.5, (6, 3))
        d2 = ((a - b) ** 2).sum(axis=1)
        gap = np.abs(margin - (d2 if legacy else np.sqrt(d2)))
        if gap.min() > 0.05 and (d2 > 0.01).all():
            break
    y = np.array([1, 0, 0, 1, 0, 0], np.float64)
    return a, b, y


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_forward_and_gradient(legacy):
    margin = 0.7
    a, b, y = contrastive_inputs(30, margin, legacy)
    d = np.sqrt(((a - b) ** 2).sum(axis=1))
    assert (d[y == 0] < margin).any() and (d[y == 0] > margin).any() or legacy
    text = ('type: "ContrastiveLoss" contrastive_loss_param { margin: %g legacy_version: %s }'
            % (margin, "true" if legacy else "false"))
    layer, _, tops = run_layer(text, [a, b, y])
    assert scalar(tops[0]) == pytest.approx(ref_contrastive(a, b, y, margin, legacy))
    assert layer.allow_force_backward(1) and not layer.allow_force_backward(2)
    # Caffe divides by (d + 1e-4) instead of d in the non-legacy gradient
    check_gradient(text, [a, b, y], check_bottoms=[0, 1], rtol=1e-3 if not legacy else 1e-4)


def test_contrastive_default_margin():
    a, b, y = contrastive_inputs(32, 1.0, False)
    _, _, tops = run_layer('type: "ContrastiveLoss"', [a, b, y])
    assert scalar(tops[0]) == pytest.approx(ref_contrastive(a, b, y, 1.0, False))


# --------------------------------------------------------------- InfogainLoss
def ref_infogain(x, lab, H, axis=1, ignore=None, mode="VALID"):
    c = x.shape[axis]
    p = np.moveaxis(ref_probs(x, axis), axis, -1).reshape(-1, c)
    outer = int(np.prod(x.shape[:axis]))
    inner = int(np.prod(x.shape[axis + 1:]))
    loss, count = 0.0, 0
    for i, l in enumerate(lab.reshape(-1).astype(int)):
        if ignore is not None and l == ignore:
            continue
        for k in range(c):
            loss -= H[l, k] * np.log(max(p[i, k], 1e-20))
        count += 1
    return loss / ref_normalizer(mode, outer, inner, count)


def infogain_H(c, seed=34):
    return rs(seed).uniform(0, 1, (c, c)) + np.eye(c)


def write_h(tmp_path, H):
    bp = caffe_pb2.BlobProto()
    bp.num, bp.channels, bp.height, bp.width = 1, 1, H.shape[0], H.shape[1]
    bp.data.extend(H.astype(np.float32).reshape(-1).tolist())
    path = tmp_path / "H.binaryproto"
    path.write_bytes(bp.SerializeToString())
    return str(path)


def test_infogain_from_source(tmp_path):
    H = infogain_H(4).astype(np.float32).astype(np.float64)
    src = write_h(tmp_path, H)
    x = rs(35).randn(3, 4)
    lab = labels(36, (3,), 4)
    text = 'type: "InfogainLoss" infogain_loss_param { source: "%s" }' % src
    _, _, tops = run_layer(text, [x, lab])
    assert scalar(tops[0]) == pytest.approx(ref_infogain(x, lab, H))
    check_gradient(text, [x, lab], check_bottoms=[0])


@pytest.mark.parametrize("mode", NORMS)
def test_infogain_bottom_matrix_ignore_and_normalization(mode):
    H = infogain_H(3)
    x = rs(37).randn(2, 3, 4)
    lab = labels(38, (2, 4), 3, ignore=5, n_ignore=2)
    text = ('type: "InfogainLoss" loss_param { ignore_label: 5 normalization: %s } '
            'top: "loss" top: "prob"' % mode)
    _, _, tops = run_layer(text, [x, lab, H])
    assert scalar(tops[0]) == pytest.approx(ref_infogain(x, lab, H, ignore=5, mode=mode))
    np.testing.assert_allclose(tops[1].data, ref_probs(x, 1), rtol=1e-12)
    check_gradient(text, [x, lab, H], check_bottoms=[0], num_top=1)


def test_infogain_axis():
    H = infogain_H(4)
    x = rs(39).randn(2, 3, 4)
    lab = labels(40, (2, 3), 4)
    text = 'type: "InfogainLoss" infogain_loss_param { axis: 2 }'
    _, _, tops = run_layer(text, [x, lab, H])
    assert scalar(tops[0]) == pytest.approx(ref_infogain(x, lab, H, axis=2))
    check_gradient(text, [x, lab, H], check_bottoms=[0])


def test_infogain_errors():
    x, lab = np.zeros((2, 3)), np.zeros(2)
    with pytest.raises(CaffeError, match="source"):
        run_layer('type: "InfogainLoss"', [x, lab])
    with pytest.raises(CaffeError, match="3 classes"):
        run_layer('type: "InfogainLoss"', [x, lab, np.eye(4)])
    with pytest.raises(CaffeError, match="normalize"):
        run_layer('type: "InfogainLoss" loss_param { normalize: true }', [x, lab, np.eye(3)])


# ---------------------------------------------------- MultinomialLogisticLoss
def test_multinomial_logistic_forward_and_gradient():
    p = rs(41).uniform(0.1, 1.0, (4, 5))
    p[0, 2] = 0.0                      # clamped at kLOG_THRESHOLD
    lab = np.array([2.0, 0.0, 4.0, 1.0])
    text = 'type: "MultinomialLogisticLoss"'
    _, _, tops = run_layer(text, [p, lab])
    ref = -sum(np.log(max(p[i, int(lab[i])], 1e-20)) for i in range(4)) / 4
    assert scalar(tops[0]) == pytest.approx(ref)
    p[0, 2] = 0.5
    check_gradient(text, [p, lab], check_bottoms=[0])


def test_multinomial_logistic_label_out_of_range():
    with pytest.raises(CaffeError, match="label value 5"):
        run_layer('type: "MultinomialLogisticLoss"', [np.ones((2, 5)), np.array([0.0, 5.0])])


# ------------------------------------------------------------ common behaviour
def test_loss_weight_scales_backward_float32():
    layer = make_layer('type: "SoftmaxWithLoss"', dtype=np.float32)
    x = Blob((2, 3), np, np.float32)
    x.data = rs(42).randn(2, 3).astype(np.float32)
    lab = Blob((2,), np, np.float32)
    lab.data = np.array([0, 2], np.float32)
    top = Blob((), np, np.float32)
    layer.setup([x, lab], [top])
    layer.reshape([x, lab], [top])
    layer.forward([x, lab], [top])
    assert top.shape == () and top.data.dtype == np.float32
    top.diff = np.asarray(1.0, np.float32)
    layer.backward([top], [True, False], [x, lab])
    g1 = x.diff.copy()
    top.diff = np.asarray(3.0, np.float32)
    layer.backward([top], [True, False], [x, lab])
    assert x.diff.dtype == np.float32
    np.testing.assert_allclose(x.diff, 3 * g1, rtol=1e-6)
