"""Loss layers (Caffe's LossLayer family) and the Accuracy layer.

Every loss writes a scalar (shape ``()``) into top 0 and scales its bottom
gradient by ``top[0].diff``, which holds the loss weight the net assigns
(1 for the first top of a loss layer unless ``loss_weight`` says otherwise).
The weight is used as a device scalar, so backward needs no host sync.

Under uneven batch shares (--balance) a loss says through ``share_scale``
how its gradient must be weighted so that the ranks' mean is the global
batch's: share / batch where it normalises by the batch (or by all its
outputs), 1 where it does not normalise (a sum over samples), and None
where it normalises by a count of this rank's own (VALID with an
ignore_label), which no weight makes exact.
"""
import numpy as np

from ..proto import caffe_pb2
from .base import Layer, register
from .softmax import softmax

_LP = caffe_pb2.LossParameter
VALID, BATCH_SIZE, FULL, NONE = _LP.VALID, _LP.BATCH_SIZE, _LP.FULL, _LP.NONE
KLOG_THRESHOLD = 1e-20                        # Caffe's kLOG_THRESHOLD
FLT_MIN = float(np.finfo(np.float32).tiny)    # Caffe clamps softmax probs at FLT_MIN


# ------------------------------------------------------------------- helpers
def _split_axis(layer, blob, axis):
    """(outer, channels, inner) sizes of ``blob`` around ``axis``."""
    if blob.num_axes == 0:
        raise layer.error("needs a bottom with at least one axis, got shape %s", blob.shape)
    try:
        axis = blob.canonical_axis(axis)
    except ValueError:
        raise layer.error("axis %d out of range for bottom shape %s", axis, blob.shape) from None
    return blob.count_range(0, axis), blob.shape[axis], blob.count_range(axis + 1)


def _num(blob):
    """Caffe's num(): the first dimension (1 for a 0-axis blob)."""
    return blob.shape[0] if blob.num_axes else 1


def _class_labels(layer, data, num_classes, ignore_label):
    """Integer class labels (C++ int cast: truncation toward zero) and the
    valid mask (None when there is no ignore_label).  Ignored entries are
    replaced by class 0 so they can be used as indices; the caller masks them.
    One min/max reduction checks the range (Layer.check_values: at once, or
    in a net on the GPU when it reads the loss, the labels clipped to the
    classes meanwhile, so a bad one reads no memory outside them)."""
    xp = layer.xp
    lab = data.astype(np.int64)
    valid = None
    if ignore_label is not None:
        valid = lab != ignore_label
        lab = xp.where(valid, lab, 0)
    if lab.size:
        def check(lo_hi):
            lo, hi = (int(v) for v in lo_hi)
            if lo < 0 or hi >= num_classes:
                raise layer.error("label value %d is outside [0, %d): the bottom has %d classes%s",
                                  lo if lo < 0 else hi, num_classes, num_classes,
                                  "" if ignore_label is None else
                                  " (ignore_label is %d)" % ignore_label)
        layer.check_values(xp.stack([lab.min(), lab.max()]), check)
        if layer.deferred_checks is not None:
            lab = xp.clip(lab, 0, num_classes - 1)
    return lab, valid


def _onehot(xp, lab, num_classes, dtype):
    """(outer, C, inner) one-hot of labels shaped (outer, inner)."""
    return (lab[:, None, :] == xp.arange(num_classes)[None, :, None]).astype(dtype)


class LossLayer(Layer):
    """Common base: two bottoms (prediction, label/target) with equal first
    dimension, a scalar top 0, and no gradient to the labels."""

    is_loss = True
    exact_num_bottom = 2
    exact_num_top = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def share_scale(self, share, batch):
        """Normalised by its batch (the first axis): share / batch."""
        return share / batch

    def _normalized_share_scale(self, share, batch):
        """share_scale of a loss with ``normalization`` and ``ignore_label``."""
        if self.normalization == NONE:
            return 1.0
        if self.normalization == VALID and self.ignore_label is not None:
            return None
        return share / batch

    def reshape(self, bottom, top):
        if _num(bottom[0]) != _num(bottom[1]):
            raise self.error("the data and label should have the same first dimension; "
                             "got bottom shapes %s and %s", bottom[0].shape, bottom[1].shape)
        top[0].reshape(())

    # -- shared pieces
    def _read_ignore_label(self, param):
        return param.ignore_label if param.HasField("ignore_label") else None

    def _read_normalization(self, default):
        """The explicit ``normalization``, else legacy ``normalize`` (true:
        VALID, false: BATCH_SIZE), else the layer's default."""
        lp = self.param.loss_param
        if lp.HasField("normalization"):
            return lp.normalization
        if lp.HasField("normalize"):
            return VALID if lp.normalize else BATCH_SIZE
        return default

    def _normalizer(self, mode, outer, inner, valid_count=None):
        """Caffe's get_normalizer, at least 1.  ``valid_count`` is a device
        scalar (None: every output is valid)."""
        if mode == VALID and valid_count is not None:
            return self.xp.maximum(valid_count.astype(self.dtype), 1)
        if mode in (FULL, VALID):
            n = outer * inner
        elif mode == BATCH_SIZE:
            n = outer
        elif mode == NONE:
            n = 1
        else:
            raise self.error("unknown normalization mode %d", mode)
        return float(max(1, n))

    def _set_loss(self, top, value):
        top[0].data = self.xp.asarray(value, dtype=self.dtype).reshape(())

    def _scale(self, top, norm):
        """loss weight / normalizer, as a device scalar."""
        return top[0].diff / norm

    def _no_label_backward(self, propagate_down, first_label=1):
        for i in range(first_label, len(propagate_down)):
            if propagate_down[i]:
                raise self.error("cannot backpropagate to bottom %d (labels or fixed inputs)", i)


class _ProbLossLayer(LossLayer):
    """Losses over a softmax of bottom 0 along an axis, with class labels of
    shape outer x inner, ignore_label, normalization and an optional second
    top holding the probabilities (SoftmaxWithLoss, InfogainLoss)."""

    exact_num_top = None
    min_top = 1
    max_top = 2

    def _axis(self):
        raise NotImplementedError

    def share_scale(self, share, batch):
        """Over a softmax along the batch axis the samples mix."""
        return self._normalized_share_scale(share, batch) if self._batch_outer else None

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        self.outer, self.channels, self.inner = _split_axis(self, bottom[0], self._axis())
        self._batch_outer = bottom[0].canonical_axis(self._axis()) > 0
        if self.outer * self.inner != bottom[1].count:
            raise self.error("number of labels must match number of predictions: prediction shape "
                             "%s with axis %d needs %d labels, label shape %s has %d",
                             bottom[0].shape, self._axis(), self.outer * self.inner,
                             bottom[1].shape, bottom[1].count)
        if len(top) > 1:
            top[1].reshape(bottom[0].shape)

    def _forward_prob(self, bottom, top):
        """Softmax probabilities (outer, C, inner), labels and valid mask."""
        x = bottom[0].data.reshape(self.outer, self.channels, self.inner)
        prob = softmax(self.xp, x, 1)
        lab, valid = _class_labels(self, bottom[1].data.reshape(self.outer, self.inner),
                                   self.channels, self.ignore_label)
        if len(top) > 1:
            top[1].data = prob.reshape(bottom[0].shape)
        self._prob, self._lab, self._valid = prob, lab, valid
        return prob, lab, valid

    def _finish(self, top, per_item):
        """Sum the per-position losses (outer, inner) over the valid ones."""
        count = None
        if self._valid is not None:
            per_item = per_item * self._valid
            count = self._valid.sum()
        self._norm = self._normalizer(self.normalization, self.outer, self.inner, count)
        self._set_loss(top, per_item.sum() / self._norm)

    def _finish_backward(self, top, bottom, grad):
        if self._valid is not None:
            grad = grad * self._valid[:, None, :]
        grad = grad * self._scale(top, self._norm)
        bottom[0].diff = grad.astype(self.dtype, copy=False).reshape(bottom[0].shape)


# --------------------------------------------------------------------- losses
@register("SoftmaxWithLoss")
class SoftmaxWithLossLayer(_ProbLossLayer):
    """Multinomial logistic loss of a softmax (Caffe's SoftmaxWithLossLayer)."""

    def _axis(self):
        return self.param.softmax_param.axis

    def setup(self, bottom, top):
        self.ignore_label = self._read_ignore_label(self.param.loss_param)
        self.normalization = self._read_normalization(VALID)

    def forward(self, bottom, top):
        xp = self.xp
        prob, lab, _ = self._forward_prob(bottom, top)
        p = xp.take_along_axis(prob, lab[:, None, :], axis=1)[:, 0, :]
        self._finish(top, -xp.log(xp.maximum(p, FLT_MIN)))

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if propagate_down[0]:
            grad = self._prob - _onehot(self.xp, self._lab, self.channels, self.dtype)
            self._finish_backward(top, bottom, grad)


@register("InfogainLoss")
class InfogainLossLayer(_ProbLossLayer):
    """Infogain-weighted log loss of a softmax of bottom 0 (current BVLC:
    raw scores in, softmax along infogain_loss_param.axis inside).  H comes
    from infogain_loss_param.source or from a third bottom (C x C values)."""

    exact_num_bottom = None
    min_bottom = 2
    max_bottom = 3

    def _axis(self):
        return self.param.infogain_loss_param.axis

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom, top):
        lp = self.param.loss_param
        self.ignore_label = self._read_ignore_label(lp)
        if lp.HasField("normalize"):
            raise self.error('loss_param.normalize is deprecated for this layer; use "normalization"')
        self.normalization = lp.normalization
        self._H = None
        if len(bottom) < 3:
            ip = self.param.infogain_loss_param
            if not ip.HasField("source"):
                raise self.error("the infogain matrix source (infogain_loss_param.source) must be "
                                 "given when there is no third bottom")
            from ..io.proto_io import blob_proto_to_array, read_binary_proto
            H = blob_proto_to_array(read_binary_proto(ip.source, caffe_pb2.BlobProto))
            self._H = self.xp.asarray(H, self.dtype)

    def _matrix(self, bottom):
        return self._H if len(bottom) < 3 else bottom[2].data

    def reshape(self, bottom, top):
        _ProbLossLayer.reshape(self, bottom, top)
        H = self._matrix(bottom)
        if H.size != self.channels * self.channels:
            raise self.error("the infogain matrix has shape %s (%d values) but the bottom shape %s "
                             "has %d classes, so it needs %d x %d", tuple(H.shape), H.size,
                             bottom[0].shape, self.channels, self.channels, self.channels)

    def forward(self, bottom, top):
        xp = self.xp
        prob, lab, _ = self._forward_prob(bottom, top)
        H = self._matrix(bottom).reshape(self.channels, self.channels)
        rows = H[lab].transpose(0, 2, 1)          # row H[label] per position: (outer, C, inner)
        logp = xp.log(xp.maximum(prob, KLOG_THRESHOLD))
        self._finish(top, -(rows * logp).sum(axis=1))

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if propagate_down[0]:
            H = self._matrix(bottom).reshape(self.channels, self.channels)
            lab = self._lab
            # d/dx of -sum_l H[y,l] log p_l = p * sum_l H[y,l] - H[y,:]
            grad = self._prob * H.sum(axis=1)[lab][:, None, :] - H[lab].transpose(0, 2, 1)
            self._finish_backward(top, bottom, grad)


class _OneLabelPerItemLoss(LossLayer):
    """A loss whose second bottom holds exactly one class label per item."""

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        if bottom[1].count != _num(bottom[0]):
            raise self.error("needs one label per item: prediction shape %s, label shape %s",
                             bottom[0].shape, bottom[1].shape)


@register("MultinomialLogisticLoss")
class MultinomialLogisticLossLayer(_OneLabelPerItemLoss):
    """-log p[label] averaged over the batch; bottom 0 holds probabilities."""

    def forward(self, bottom, top):
        xp = self.xp
        n = _num(bottom[0])
        x = bottom[0].data.reshape(n, -1)
        lab, _ = _class_labels(self, bottom[1].data.reshape(n), x.shape[1], None)
        p = xp.maximum(xp.take_along_axis(x, lab[:, None], axis=1)[:, 0], KLOG_THRESHOLD)
        self._lab, self._p = lab, p
        self._set_loss(top, -xp.log(p).sum() / n)

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if propagate_down[0]:
            n = _num(bottom[0])
            dim = bottom[0].count // max(n, 1)
            onehot = _onehot(self.xp, self._lab[:, None], dim, self.dtype)[:, :, 0]
            grad = onehot * (-1.0 / n / self._p)[:, None] * top[0].diff
            bottom[0].diff = grad.astype(self.dtype, copy=False).reshape(bottom[0].shape)


@register("EuclideanLoss")
class EuclideanLossLayer(LossLayer):
    """sum((a - b)^2) / (2 N); gradients to both bottoms."""

    def allow_force_backward(self, bottom_index):
        return True

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        if bottom[0].count_range(1) != bottom[1].count_range(1):
            raise self.error("inputs must have the same dimension: bottom shapes %s and %s",
                             bottom[0].shape, bottom[1].shape)

    def forward(self, bottom, top):
        self._diff = bottom[0].data - bottom[1].data.reshape(bottom[0].shape)
        self._set_loss(top, (self._diff * self._diff).sum() / _num(bottom[0]) / 2)

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                grad = self._diff * (top[0].diff * (sign / _num(bottom[i])))
                bottom[i].diff = grad.astype(self.dtype, copy=False).reshape(bottom[i].shape)


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLossLayer(LossLayer):
    """Cross-entropy of sigmoid(bottom 0) against targets in [0, 1], computed
    stably from the logits; ignore_label and normalization (default
    BATCH_SIZE, as in BVLC)."""

    def setup(self, bottom, top):
        self.ignore_label = self._read_ignore_label(self.param.loss_param)
        self.normalization = self._read_normalization(BATCH_SIZE)

    def share_scale(self, share, batch):
        return self._normalized_share_scale(share, batch)

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.error("inputs must have the same count: bottom shapes %s and %s",
                             bottom[0].shape, bottom[1].shape)
        self.outer = _num(bottom[0])
        self.inner = bottom[0].count_range(1)

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        t = bottom[1].data.reshape(x.shape)
        # log(1 + exp(x - 2x[x>=0])) == log1p(exp(-|x|)): never overflows
        e = xp.exp(-xp.abs(x))
        loss = -(x * (t - (x >= 0)) - xp.log1p(e))
        count = None
        self._valid = None
        if self.ignore_label is not None:
            self._valid = (t.astype(np.int64) != self.ignore_label).astype(self.dtype)
            loss = loss * self._valid
            count = self._valid.sum()
        self._norm = self._normalizer(self.normalization, self.outer, self.inner, count)
        # sigmoid from the same exp(-|x|), again without overflow
        self._sigmoid = xp.where(x >= 0, 1, e) / (1 + e)
        self._set_loss(top, loss.sum() / self._norm)

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if propagate_down[0]:
            grad = self._sigmoid - bottom[1].data.reshape(bottom[0].shape)
            if self._valid is not None:
                grad = grad * self._valid
            grad = grad * self._scale(top, self._norm)
            bottom[0].diff = grad.astype(self.dtype, copy=False)


@register("HingeLoss")
class HingeLossLayer(_OneLabelPerItemLoss):
    """One-vs-all hinge loss: t = max(0, 1 - s x) with s = +1 at the label
    and -1 elsewhere; sum(t) / N (L1) or sum(t^2) / N (L2)."""

    def forward(self, bottom, top):
        xp = self.xp
        n = _num(bottom[0])
        x = bottom[0].data.reshape(n, -1)
        lab, _ = _class_labels(self, bottom[1].data.reshape(n), x.shape[1], None)
        # sign: -1 at the true class, +1 elsewhere (Caffe flips the label entry)
        sign = 1 - 2 * _onehot(xp, lab[:, None], x.shape[1], self.dtype)[:, :, 0]
        t = xp.maximum(1 + sign * x, 0)
        self._sign, self._t = sign, t
        norm = self.param.hinge_loss_param.norm
        if norm == caffe_pb2.HingeLossParameter.L1:
            loss = t.sum()
        elif norm == caffe_pb2.HingeLossParameter.L2:
            loss = (t * t).sum()
        else:
            raise self.error("unknown hinge_loss_param.norm %d", norm)
        self._set_loss(top, loss / n)

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if propagate_down[0]:
            n = _num(bottom[0])
            if self.param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L1:
                grad = self._sign * (self._t > 0)
            else:
                grad = 2 * self._sign * self._t
            grad = grad * (top[0].diff / n)
            bottom[0].diff = grad.astype(self.dtype, copy=False).reshape(bottom[0].shape)


@register("ContrastiveLoss")
class ContrastiveLossLayer(LossLayer):
    """Contrastive loss of feature pairs (a, b) with similarity labels y:
    y d^2 + (1-y) max(margin - d, 0)^2, summed and divided by 2N
    (legacy_version: max(margin - d^2, 0) for dissimilar pairs)."""

    exact_num_bottom = 3

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        if bottom[0].shape != bottom[1].shape:
            raise self.error("the two feature bottoms must have the same shape, got %s and %s",
                             bottom[0].shape, bottom[1].shape)
        if bottom[2].count != _num(bottom[0]):
            raise self.error("needs one similarity label per pair: feature shape %s, label shape %s",
                             bottom[0].shape, bottom[2].shape)

    def forward(self, bottom, top):
        xp = self.xp
        n = _num(bottom[0])
        cp = self.param.contrastive_loss_param
        self._diff = (bottom[0].data - bottom[1].data).reshape(n, -1)
        self._dist_sq = (self._diff * self._diff).sum(axis=1)
        self._similar = bottom[2].data.reshape(n).astype(np.int64) != 0
        if cp.legacy_version:
            dissimilar = xp.maximum(cp.margin - self._dist_sq, 0)
        else:
            dissimilar = xp.maximum(cp.margin - xp.sqrt(self._dist_sq), 0) ** 2
        loss = xp.where(self._similar, self._dist_sq, dissimilar).sum()
        self._set_loss(top, loss / n / 2)

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        if propagate_down[2]:
            raise self.error("cannot backpropagate to the similarity labels (bottom 2)")
        cp = self.param.contrastive_loss_param
        if cp.legacy_version:
            mdist = cp.margin - self._dist_sq
            beta = -1.0
        else:
            dist = xp.sqrt(self._dist_sq)
            mdist = cp.margin - dist
            # Caffe's 1e-4 keeps the gradient finite at d == 0
            beta = -mdist / (dist + 1e-4)
        coef = xp.where(self._similar, 1.0, xp.where(mdist > 0, beta, 0.0)).astype(self.dtype)
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = top[0].diff * (sign / _num(bottom[i]))
                grad = (coef * alpha)[:, None] * self._diff
                bottom[i].diff = grad.astype(self.dtype, copy=False).reshape(bottom[i].shape)


# ------------------------------------------------------------------- accuracy
@register("Accuracy")
class AccuracyLayer(Layer):
    """Top-k accuracy along accuracy_param.axis.  As in BVLC, a prediction
    is correct when fewer than top_k other classes score >= the true class,
    so ties count against the true class.  Optional top 1: per-class
    accuracy (0 for classes without examples)."""

    exact_num_bottom = 2
    min_top = 1
    max_top = 2
    # no gradient: under uneven shares it is this rank's share's accuracy
    samplewise = True

    def setup(self, bottom, top):
        ap = self.param.accuracy_param
        self.top_k = ap.top_k
        self.ignore_label = ap.ignore_label if ap.HasField("ignore_label") else None

    def reshape(self, bottom, top):
        ap = self.param.accuracy_param
        self.outer, self.channels, self.inner = _split_axis(self, bottom[0], ap.axis)
        if self.top_k > self.channels:
            raise self.error("top_k (%d) must be at most the number of classes (%d, bottom shape %s)",
                             self.top_k, self.channels, bottom[0].shape)
        if self.outer * self.inner != bottom[1].count:
            raise self.error("number of labels must match number of predictions: prediction shape "
                             "%s with axis %d needs %d labels, label shape %s has %d",
                             bottom[0].shape, ap.axis, self.outer * self.inner,
                             bottom[1].shape, bottom[1].count)
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.channels,))

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data.reshape(self.outer, self.channels, self.inner)
        lab, valid = _class_labels(self, bottom[1].data.reshape(self.outer, self.inner),
                                   self.channels, self.ignore_label)
        true_score = xp.take_along_axis(x, lab[:, None, :], axis=1)
        num_better = (x >= true_score).sum(axis=1) - 1       # the true class counts itself
        correct = num_better < self.top_k
        if valid is not None:
            correct = correct & valid
            count = xp.maximum(valid.sum(), 1)
        else:
            count = max(self.outer * self.inner, 1)
        # no valid labels: hits is 0, so the accuracy is 0 as in Caffe
        top[0].data = (correct.sum() / count).astype(self.dtype).reshape(())
        if len(top) > 1:
            flat = lab.reshape(-1)
            weights = (valid.reshape(-1) if valid is not None
                       else xp.ones(flat.shape, bool)).astype(self.dtype)
            nums = xp.bincount(flat, weights=weights, minlength=self.channels)
            per_hits = xp.bincount(flat, weights=correct.reshape(-1).astype(self.dtype),
                                   minlength=self.channels)
            top[1].data = xp.where(nums > 0, per_hits / xp.maximum(nums, 1), 0).astype(self.dtype)
