"""Pooling (MAX / AVE) with Caffe's output-size rule and window clipping;
SPP, a pyramid of such poolings."""
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
    samplewise = True
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


@register("SPP")
class SPPLayer(Layer):
    """Spatial pyramid pooling (Caffe's SPPLayer).  Level l of
    ``pyramid_height`` pools every channel into 2^l x 2^l bins with the
    geometry of Caffe's GetPoolingParam: kernel ceil(H / bins), stride the
    kernel, pad (kernel*bins - H + 1) / 2 (the same along W).  Each level is a
    Pooling layer of ours (one pooling implementation); the levels, each
    flattened to N x (C*bins*bins), are concatenated along axis 1.  With
    pyramid_height 1 the top is that one pooling's N x C x 1 x 1, unflattened,
    as in Caffe.  The levels are rebuilt when the bottom's H x W changes."""
    # memory planner (see Layer): Pooling's backward reads neither (MAX its argmax)
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    samplewise = True
    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        sp = self.param.spp_param
        if sp.pyramid_height < 1:
            raise self.error("spp_param.pyramid_height must be at least 1, got %d", sp.pyramid_height)
        if sp.pool not in (_PP.MAX, _PP.AVE):     # SPP's enum has Pooling's values
            raise self.error("only MAX and AVE pooling are supported (STOCHASTIC is not, as in "
                             "our Pooling)")
        self.levels = []
        self.level_blobs = []
        self.level_hw = None

    def _level(self, level, bottom, level_top):
        """The Pooling layer of pyramid level ``level`` for ``bottom``'s H x W."""
        h, w = bottom[0].shape[2:]
        bins = 2 ** level
        kh, kw = -(-h // bins), -(-w // bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        if ph >= kh or pw >= kw:
            raise self.error("a %dx%d bottom is too small for pyramid level %d (%dx%d bins): its "
                             "pooling would need pad %dx%d with kernel %dx%d, and Caffe's Pooling "
                             "needs pad < kernel", h, w, level, bins, bins, ph, pw, kh, kw)
        lp = caffe_pb2.LayerParameter(name="%s/level%d" % (self.name, level), type="Pooling")
        pp = lp.pooling_param
        pp.pool = self.param.spp_param.pool
        pp.kernel_h, pp.kernel_w = kh, kw
        pp.stride_h, pp.stride_w = kh, kw
        pp.pad_h, pp.pad_w = ph, pw
        layer = PoolingLayer(lp, self.phase, self.xp, self.dtype)
        layer.setup(bottom, [level_top])
        return layer

    def _level_tops(self, top):
        """The levels' tops: the layer's own top with a single level, else
        one blob per level, flattened and concatenated into the top."""
        return top if len(self.levels) == 1 else self.level_blobs

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.error("bottom must be 4-D (num, channels, height, width), got %s", shape)
        height = self.param.spp_param.pyramid_height
        if shape[2:] != self.level_hw:
            self.level_blobs = [self.new_blob(()) for _ in range(height)] if height > 1 else []
            self.levels = [self._level(level, bottom, t)
                           for level, t in enumerate(self.level_blobs or top)]
            self.level_hw = shape[2:]
        level_tops = self._level_tops(top)
        for layer, t in zip(self.levels, level_tops):
            layer.reshape(bottom, [t])
        if height > 1:
            top[0].reshape((shape[0], sum(t.count_range(1) for t in level_tops)))

    def forward(self, bottom, top):
        level_tops = self._level_tops(top)
        for layer, t in zip(self.levels, level_tops):
            layer.forward(bottom, [t])
        if len(self.levels) > 1:
            n = bottom[0].shape[0]
            top[0].data = self.xp.concatenate([t.data.reshape(n, -1) for t in level_tops], axis=1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        grad = None
        start = 0
        for layer, t in zip(self.levels, self._level_tops(top)):
            if t is not top[0]:     # a level of several: its part of the top's diff
                size = t.count_range(1)
                t.diff = self.xp.ascontiguousarray(dy[:, start:start + size]).reshape(t.shape)
                start += size
            layer.backward([t], [True], bottom)       # sets a new bottom[0].diff
            if grad is None:
                grad = bottom[0].diff
            else:
                grad += bottom[0].diff
        bottom[0].diff = grad
