"""Elementwise "neuron" layers: one bottom, one top of the same shape.

All but AbsVal may run in place (top[0] is bottom[0]), as in Caffe.  When a
layer's gradient needs the original input and it runs in place, forward keeps
the input array (the top gets a freshly computed array, so holding on to the
old one costs no copy); gradients that the output alone determines are taken
from the output, so in-place and out-of-place runs give the same results.
"""
import math

from ..backend import kernels
from ..common import TRAIN
from ..proto import caffe_pb2
from .base import Layer, register


def relu_gradient(xp, dy, y, out=None):
    """dy where the ReLU's output ``y`` is positive, else zero: dy * (y > 0),
    the bits of ReLU's own gradient (slope 0), which the layers that absorb
    a ReLU (Layer.absorb) must reproduce."""
    return xp.multiply(dy, y > 0, out=out)


class _Neuron(Layer):
    """Shared plumbing.  Subclasses define ``compute(x) -> y`` (a new array)
    and ``gradient(x, y, dy) -> dx``; ``x`` is None in an in-place run of a
    layer whose ``needs_input()`` is False."""

    # memory planner annotations (see Layer)
    backward_reads_bottom_data = lambda self: self.needs_input()
    in_place_keeps_input = True
    backward_state = ("_saved_input",)
    recompute_cheap = True
    samplewise = True

    exact_num_bottom = 1
    exact_num_top = 1
    in_place_ok = True
    _saved_input = None

    def needs_input(self):
        return True

    def setup(self, bottom, top):
        if top[0] is bottom[0] and not self.in_place_ok:
            raise self.error("cannot run in place (top and bottom are the same blob)")

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        y = self.compute(x)
        if top[0] is bottom[0] and self.needs_input():
            # A bound blob copies on assignment, overwriting x: keep a copy then.
            self._saved_input = x.copy() if top[0].bound else x
        else:
            self._saved_input = None
        top[0].data = y

    def _input(self, top, bottom):
        return self._saved_input if top[0] is bottom[0] else bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff = self.gradient(self._input(top, bottom), top[0].data, top[0].diff)


def sigmoid(xp, x):
    """1 / (1 + exp(-x)) in the tanh form: no overflow for large |x| (as
    Caffe computes it)."""
    return 0.5 * xp.tanh(0.5 * x) + 0.5


def _log_base(layer, base):
    """ln(base) for Exp/Log, with Caffe's -1 meaning e."""
    if base == -1:
        return 1.0
    if not base > 0:
        raise layer.error("base must be strictly positive (or -1 for e), got %g", base)
    return math.log(base)


@register("ReLU")
class ReLULayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.slope = float(self.param.relu_param.negative_slope)

    def needs_input(self):
        # With slope >= 0 the output has the input's sign.
        return self.slope < 0

    def compute(self, x):
        xp = self.xp
        if self.slope == 0:
            return kernels.elementwise(xp, lambda x, out: xp.maximum(x, 0, out=out), x)
        return xp.where(x > 0, x, x * self.slope)

    def gradient(self, x, y, dy):
        xp = self.xp
        if self.slope == 0:
            return kernels.elementwise(xp, lambda dy, y, out: relu_gradient(xp, dy, y, out), dy, y,
                                       fused="relu_gradient")
        positive = (y > 0) if self.slope > 0 else (x > 0)
        return xp.where(positive, dy, dy * self.slope)


@register("PReLU")
class PReLULayer(_Neuron):
    backward_reads_bottom_data = True
    backward_reads_top_data = False
    def setup(self, bottom, top):
        super().setup(bottom, top)
        if bottom[0].num_axes < 2:
            raise self.error("needs a bottom with at least 2 axes, got shape %s", bottom[0].shape)
        p = self.param.prelu_param
        self.channel_shared = p.channel_shared
        channels = bottom[0].shape[1]
        shape = () if self.channel_shared else (channels,)
        want = 1 if self.channel_shared else channels
        if not self.blobs:
            if p.HasField("filler"):
                filler = p.filler
            else:
                filler = caffe_pb2.FillerParameter(type="constant", value=0.25)
            self.blobs = [self.fill(filler, shape)]
        if self.blobs[0].count != want:
            raise self.error("has %d slopes, but channel_shared=%s and the bottom %s needs %d",
                             self.blobs[0].count, self.channel_shared, bottom[0].shape, want)

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error("needs a bottom with at least 2 axes, got shape %s", bottom[0].shape)
        top[0].reshape(bottom[0].shape)

    def _slopes(self, ndim):
        s = self.blobs[0].data
        if self.channel_shared:
            return s.reshape(())
        return s.reshape((1, -1) + (1,) * (ndim - 2))

    def compute(self, x):
        return self.xp.where(x > 0, x, x * self._slopes(x.ndim))

    def backward(self, top, propagate_down, bottom):
        x = self._input(top, bottom)
        dy = top[0].diff
        # Slope gradient first: in place, the bottom diff is the top diff.
        g = dy * self.xp.minimum(x, 0)
        if self.channel_shared:
            g = g.sum()
        else:
            g = g.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
        self.blobs[0].diff += g.reshape(self.blobs[0].shape)
        if propagate_down[0]:
            bottom[0].diff = self.xp.where(x > 0, dy, dy * self._slopes(x.ndim))


@register("ELU")
class ELULayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.alpha = float(self.param.elu_param.alpha)

    def needs_input(self):
        # With alpha >= 0, y > 0 exactly where x > 0.
        return self.alpha < 0

    def compute(self, x):
        xp = self.xp
        return xp.where(x > 0, x, self.alpha * xp.expm1(xp.minimum(x, 0)))

    def gradient(self, x, y, dy):
        positive = (y > 0) if self.alpha >= 0 else (x > 0)
        # for x <= 0: d/dx alpha*(e^x - 1) = alpha*e^x = y + alpha
        return self.xp.where(positive, dy, dy * (y + self.alpha))


@register("Sigmoid")
class SigmoidLayer(_Neuron):
    def needs_input(self):
        return False

    def compute(self, x):
        return sigmoid(self.xp, x)

    def gradient(self, x, y, dy):
        return dy * y * (1 - y)


@register("TanH")
class TanHLayer(_Neuron):
    def needs_input(self):
        return False

    def compute(self, x):
        return self.xp.tanh(x)

    def gradient(self, x, y, dy):
        return dy * (1 - y * y)


@register("AbsVal")
class AbsValLayer(_Neuron):
    in_place_ok = False  # Caffe refuses in-place AbsVal too

    def compute(self, x):
        return self.xp.abs(x)

    def gradient(self, x, y, dy):
        return dy * self.xp.sign(x)


@register("BNLL")
class BNLLLayer(_Neuron):
    def needs_input(self):
        return False

    def compute(self, x):
        # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): never overflows
        xp = self.xp
        return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))

    def gradient(self, x, y, dy):
        # sigmoid(x) = 1 - e^-y, so the output alone gives the gradient
        return dy * -self.xp.expm1(-y)


@register("Power")
class PowerLayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)
        self.diff_scale = self.power * self.scale

    def needs_input(self):
        return not (self.diff_scale == 0 or self.power == 1)

    def _base(self, x):
        b = x
        if self.scale != 1:
            b = b * self.scale
        if self.shift != 0:
            b = b + self.shift
        return b

    def compute(self, x):
        b = self._base(x)
        if self.power == 1:
            return b.copy() if b is x else b
        return b ** self.power

    def gradient(self, x, y, dy):
        # d/dx (shift + scale*x)^p = p*scale*(shift + scale*x)^(p-1)
        if not self.needs_input():
            return dy * self.diff_scale
        b = self._base(x)
        if self.power == 2:
            return dy * (self.diff_scale * b)
        return dy * (self.diff_scale * b ** (self.power - 1))


@register("Exp")
class ExpLayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.exp_param
        log_base = _log_base(self, p.base)
        # base^(shift + scale*x) = base^shift * e^(ln(base)*scale*x)
        self.inner_scale = log_base * p.scale
        self.outer_scale = 1.0 if p.shift == 0 else math.exp(log_base * p.shift)

    def needs_input(self):
        return False

    def compute(self, x):
        a = x * self.inner_scale if self.inner_scale != 1 else x
        y = self.xp.exp(a)
        return y * self.outer_scale if self.outer_scale != 1 else y

    def gradient(self, x, y, dy):
        return dy * y * self.inner_scale


@register("Log")
class LogLayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.log_param
        self.scale, self.shift = float(p.scale), float(p.shift)
        self.base_scale = 1.0 / _log_base(self, p.base)

    def _arg(self, x):
        a = x * self.scale if self.scale != 1 else x
        return a + self.shift if self.shift != 0 else a

    def compute(self, x):
        y = self.xp.log(self._arg(x))
        return y * self.base_scale if self.base_scale != 1 else y

    def gradient(self, x, y, dy):
        return dy * (self.base_scale * self.scale) / self._arg(x)


@register("Threshold")
class ThresholdLayer(_Neuron):
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    def needs_input(self):
        return False

    def compute(self, x):
        return (x > self.param.threshold_param.threshold).astype(self.dtype)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error("has no gradient (a step function; Caffe does not implement "
                             "its backward either): do not backpropagate through it")


@register("Clip")
class ClipLayer(_Neuron):
    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.clip_param
        self.min, self.max = float(p.min), float(p.max)

    def compute(self, x):
        return self.xp.maximum(self.xp.minimum(x, self.max), self.min)

    def gradient(self, x, y, dy):
        # both ends inclusive, as Caffe
        return dy * ((x >= self.min) & (x <= self.max))


@register("Swish")
class SwishLayer(_Neuron):
    backward_state = ("_saved_input", "_sig")
    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.beta = float(self.param.swish_param.beta)
        self._sig = None

    def needs_input(self):
        return False  # backward uses the cached sigmoid(beta*x) and the output

    def compute(self, x):
        self._sig = sigmoid(self.xp, x * self.beta)
        return x * self._sig

    def gradient(self, x, y, dy):
        # d/dx x*s(bx) = s + b*x*s*(1-s) = b*y + s*(1 - b*y)
        by = self.beta * y
        return dy * (by + self._sig * (1 - by))


@register("Dropout")
class DropoutLayer(_Neuron):
    backward_reads_top_data = False
    backward_state = ("_saved_input", "_mask")
    recompute_cheap = False     # draws random numbers
    def setup(self, bottom, top):
        super().setup(bottom, top)
        p = self.param.dropout_param
        self.ratio = float(p.dropout_ratio)
        if not 0 <= self.ratio < 1:
            raise self.error("dropout_ratio must be in [0, 1), got %g", self.ratio)
        self._mask = None

    def needs_input(self):
        return False

    def compute(self, x):
        if self.phase == TRAIN:
            # inverted dropout: scale at train time, identity at test time
            mask = kernels.dropout_mask(self.xp, x.shape, self.ratio, self.dtype)
            self._mask = mask
            return x * mask
        self._mask = None
        return x.copy()

    def gradient(self, x, y, dy):
        if self._mask is not None:
            return dy * self._mask
        return dy.copy()
