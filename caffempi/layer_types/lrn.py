"""Local response normalization (Caffe's LRN layer).

ACROSS_CHANNELS: scale = k + alpha/n * (sum of x^2 over n channels centred on
c, zeros beyond the edges); y = x * scale^-beta.
WITHIN_CHANNEL: Caffe composes it from square, AVE pooling (kernel n, pad
(n-1)/2, so the divisor is always n^2) and power(shift 1, scale alpha), so
scale = 1 + alpha/n^2 * (sum of x^2 over an n x n window) and k is unused.
"""
from ..proto import caffe_pb2
from ..backend import kernels
from .base import Layer, register


@register("LRN")
class LRNLayer(Layer):
    backward_state = ("scale",)         # memory planner (see Layer)
    recompute_cheap = False             # 6% of GoogLeNet's CPU time: not cheap here
    samplewise = True
    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        lp = self.param.lrn_param
        self.size = lp.local_size
        if self.size <= 0 or self.size % 2 != 1:
            raise self.error("local_size must be a positive odd number, got %d", self.size)
        self.alpha = lp.alpha
        self.beta = lp.beta
        self.k = lp.k
        if lp.norm_region not in (caffe_pb2.LRNParameter.ACROSS_CHANNELS,
                                  caffe_pb2.LRNParameter.WITHIN_CHANNEL):
            raise self.error("unknown norm_region %d", lp.norm_region)
        self.across = lp.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS
        if top[0] is bottom[0]:
            raise self.error("cannot run in place (its gradient needs the input)")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom must be 4-D (num, channels, height, width), got %s",
                             bottom[0].shape)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        y, self.scale = kernels.lrn_forward(self.xp, bottom[0].data, self.size, self.alpha,
                                            self.beta, self.k, self.across)
        top[0].data = y

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        bottom[0].diff = kernels.lrn_backward(self.xp, bottom[0].data, top[0].data, self.scale,
                                              top[0].diff, self.size, self.alpha, self.beta,
                                              self.across)
