"""Pooling (MAX / AVE) with Caffe's output-size rule and window clipping."""
import math

from ..backend import kernels
from ..proto import caffe_pb2
from .base import Layer, register

_PP = caffe_pb2.PoolingParameter


def _pair(layer, pp, name, default):
    """Caffe's `name` vs `name_h`/`name_w` (pooling takes scalars)."""
    has_h, has_w = pp.HasField(name + "_h"), pp.HasField(name + "_w")
    if has_h or has_w:
        if not (has_h and has_w):
            raise layer.error("%s_h and %s_w must be given together", name, name)
        if pp.HasField(name if name != "kernel" else "kernel_size"):
            raise layer.error("give either %s or %s_h/%s_w, not both", name, name, name)
        return getattr(pp, name + "_h"), getattr(pp, name + "_w")
    field = name if name != "kernel" else "kernel_size"
    if pp.HasField(field):
        v = getattr(pp, field)
        return v, v
    return default, default


def pooled_size(size, k, s, p, ceil_mode=True):
    """Caffe's pooled length: ceil (or floor) division, then with padding the
    last window must start inside the image or the left padding."""
    r = (size + 2 * p - k) / float(s)
    out = int(math.ceil(r) if ceil_mode else math.floor(r)) + 1
    if p and (out - 1) * s >= size + p:
        out -= 1
    return out


@register("Pooling")
class PoolingLayer(Layer):
    # memory planner (see Layer): MAX keeps its argmax, AVE needs shapes only
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    backward_state = ("argmax",)
    recompute_cheap = False     # 11% of GoogLeNet's CPU time: not cheap here
    exact_num_bottom = 1
    min_top = 1
    max_top = 2

    def setup(self, bottom, top):
        pp = self.param.pooling_param
        self.method = pp.pool
        if self.method == _PP.STOCHASTIC:
            raise self.error("STOCHASTIC pooling is not supported (Caffe's CPU implementation "
                             "does not support it either)")
        if self.method not in (_PP.MAX, _PP.AVE):
            raise self.error("unknown pooling method %d", self.method)
        if len(top) > 1 and self.method != _PP.MAX:
            raise self.error("only MAX pooling has a second (mask) top")
        self.global_pooling = pp.global_pooling
        if self.global_pooling:
            if pp.HasField("kernel_size") or pp.HasField("kernel_h") or pp.HasField("kernel_w"):
                raise self.error("with global_pooling the kernel size cannot be specified")
            self.kernel = None
        else:
            self.kernel = _pair(self, pp, "kernel", None)
            if self.kernel[0] is None:
                raise self.error("kernel_size (or kernel_h and kernel_w) is required")
            if min(self.kernel) <= 0:
                raise self.error("kernel size must be positive, got %dx%d", *self.kernel)
        self.pad = _pair(self, pp, "pad", 0)
        self.stride = _pair(self, pp, "stride", 1)
        if min(self.stride) <= 0:
            raise self.error("stride must be positive, got %dx%d", *self.stride)
        if self.global_pooling and (any(self.pad) or self.stride != (1, 1)):
            raise self.error("with global_pooling only pad 0 and stride 1 are allowed")
        if self.kernel is not None and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]):
            raise self.error("pad %dx%d must be smaller than the kernel %dx%d",
                             self.pad[0], self.pad[1], self.kernel[0], self.kernel[1])
        self.ceil_mode = pp.round_mode == _PP.CEIL

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.error("bottom must be 4-D (num, channels, height, width), got %s", shape)
        n, c, h, w = shape
        kh, kw = (h, w) if self.global_pooling else self.kernel
        ph, pw = self.pad
        sh, sw = self.stride
        oh = pooled_size(h, kh, sh, ph, self.ceil_mode)
        ow = pooled_size(w, kw, sw, pw, self.ceil_mode)
        if oh <= 0 or ow <= 0:
            raise self.error("bottom shape %s is smaller than the kernel %dx%d", shape, kh, kw)
        self.geom = (kh, kw, sh, sw, ph, pw)
        self.out_hw = (oh, ow)
        for t in top:
            t.reshape((n, c, oh, ow))

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        oh, ow = self.out_hw
        if self.method == _PP.MAX:
            y, self.argmax = kernels.max_pool_forward(xp, x, self.geom, oh, ow)
            if len(top) > 1:
                top[1].data = self.argmax.astype(self.dtype)
        else:
            y = kernels.ave_pool_forward(xp, x, self.geom, oh, ow)
        top[0].data = y

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.method == _PP.MAX:
            bottom[0].diff = kernels.max_pool_backward(self.xp, dy, self.argmax, self.geom, bottom[0].shape)
        else:
            bottom[0].diff = kernels.ave_pool_backward(self.xp, dy, self.geom, bottom[0].shape)
