"""Softmax over one axis (Caffe's SoftmaxLayer)."""
from .base import Layer, register


def softmax(xp, x, axis):
    """Numerically stable softmax of ``x`` along ``axis`` (max subtracted first)."""
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def softmax_backward(xp, prob, top_diff, axis):
    """Gradient through softmax: (dy - sum(dy * y)) * y along ``axis``."""
    dot = (top_diff * prob).sum(axis=axis, keepdims=True)
    return (top_diff - dot) * prob


@register("Softmax")
class SoftmaxLayer(Layer):
    backward_reads_bottom_data = False
    recompute_cheap = True
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        """Samplewise unless the softmax runs over the batch axis."""
        return 1.0 if self.axis > 0 else None

    def reshape(self, bottom, top):
        if bottom[0].num_axes == 0:
            raise self.error("needs a bottom with at least one axis, got shape %s", bottom[0].shape)
        try:
            self.axis = bottom[0].canonical_axis(self.param.softmax_param.axis)
        except ValueError:
            raise self.error("softmax_param.axis %d out of range for bottom shape %s",
                             self.param.softmax_param.axis, bottom[0].shape) from None
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data = softmax(self.xp, bottom[0].data, self.axis)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff = softmax_backward(self.xp, top[0].data, top[0].diff, self.axis)
