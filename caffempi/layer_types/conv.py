"""Convolution and Deconvolution (transposed convolution), 2-D, as Caffe's
BaseConvolutionLayer: bottom i -> top i with shared weights, groups, dilation.
The arithmetic is in :mod:`caffempi.backend.kernels` (im2col + GEMM, or
cuDNN's on the GPU as the layer's ``engine`` says, resolved once at setup by
:func:`caffempi.config.use_cudnn` into ``use_cudnn``)."""
from .. import config
from ..backend import kernels
from .base import Layer, register


def _two(layer, repeated, h, w, has_h, has_w, name, default):
    """Resolve Caffe's `name` (repeated, 1 or 2 values) vs `name_h`/`name_w`."""
    if has_h or has_w:
        if not (has_h and has_w):
            raise layer.error("%s_h and %s_w must be given together", name, name)
        if len(repeated):
            raise layer.error("give either %s or %s_h/%s_w, not both", name, name, name)
        return int(h), int(w)
    vals = list(repeated)
    if not vals:
        if default is None:
            raise layer.error("%s is required (kernel_size, or kernel_h and kernel_w)", name)
        return default, default
    if len(vals) == 1:
        return int(vals[0]), int(vals[0])
    if len(vals) == 2:
        return int(vals[0]), int(vals[1])
    raise layer.error("%s has %d values; only 2-D convolution (1 or 2 values) is supported",
                      name, len(vals))


class _ConvBase(Layer):
    backward_reads_top_data = False     # memory planner (see Layer)
    min_bottom = 1
    min_top = 1
    transposed = False      # Deconvolution

    def setup(self, bottom, top):
        if len(bottom) != len(top):
            raise self.error("needs as many tops as bottoms, got %d bottoms and %d tops",
                             len(bottom), len(top))
        cp = self.param.convolution_param
        if cp.axis not in (1, -3) or bottom[0].num_axes != 4:
            raise self.error("only 2-D convolution of (N, C, H, W) blobs over axis 1 is supported "
                             "(bottom shape %s, axis %d)", bottom[0].shape, cp.axis)
        kh, kw = _two(self, cp.kernel_size, cp.kernel_h, cp.kernel_w,
                      cp.HasField("kernel_h"), cp.HasField("kernel_w"), "kernel", None)
        ph, pw = _two(self, cp.pad, cp.pad_h, cp.pad_w,
                      cp.HasField("pad_h"), cp.HasField("pad_w"), "pad", 0)
        sh, sw = _two(self, cp.stride, cp.stride_h, cp.stride_w,
                      cp.HasField("stride_h"), cp.HasField("stride_w"), "stride", 1)
        dil = list(cp.dilation)
        if len(dil) > 2:
            raise self.error("dilation has %d values; only 2-D convolution is supported", len(dil))
        dh, dw = (1, 1) if not dil else (dil[0], dil[-1])
        if min(kh, kw) <= 0 or min(sh, sw) <= 0 or min(dh, dw) <= 0 or min(ph, pw) < 0:
            raise self.error("kernel, stride and dilation must be positive and pad non-negative "
                             "(kernel %dx%d, stride %dx%d, dilation %dx%d, pad %dx%d)",
                             kh, kw, sh, sw, dh, dw, ph, pw)
        self.geom = (kh, kw, sh, sw, ph, pw, dh, dw)
        self.num_output = cp.num_output
        if self.num_output <= 0:
            raise self.error("num_output must be positive")
        self.group = cp.group
        self.channels = bottom[0].shape[1]
        if self.group <= 0 or self.channels % self.group or self.num_output % self.group:
            raise self.error("group %d must divide both the input channels (%d) and num_output (%d)",
                             self.group, self.channels, self.num_output)
        if self.transposed:
            wshape = (self.channels, self.num_output // self.group, kh, kw)
        else:
            wshape = (self.num_output, self.channels // self.group, kh, kw)
        shapes = [wshape] + ([(self.num_output,)] if cp.bias_term else [])
        if self.blobs:
            if len(self.blobs) != len(shapes) or any(b.shape != s for b, s in zip(self.blobs, shapes)):
                raise self.error("parameter shapes %s do not match the expected %s",
                                 [b.shape for b in self.blobs], shapes)
        else:
            self.blobs = [self.fill(cp.weight_filler, wshape)]
            if cp.bias_term:
                self.blobs.append(self.fill(cp.bias_filler, (self.num_output,)))
        self.bias_term = cp.bias_term
        self.use_cudnn = config.use_cudnn(cp.engine)

    def _out_size(self, h, w):
        kh, kw, sh, sw, ph, pw, dh, dw = self.geom
        if self.transposed:
            return ((h - 1) * sh + dh * (kh - 1) + 1 - 2 * ph,
                    (w - 1) * sw + dw * (kw - 1) + 1 - 2 * pw)
        return (kernels.conv_out_size(h, kh, sh, ph, dh), kernels.conv_out_size(w, kw, sw, pw, dw))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        for b in bottom[1:]:
            if b.shape != shape:
                raise self.error("all bottoms must have one shape; got %s and %s", shape, b.shape)
        if len(shape) != 4 or shape[1] != self.channels:
            raise self.error("bottom shape %s does not match the %d input channels of the weights",
                             shape, self.channels)
        oh, ow = self._out_size(shape[2], shape[3])
        if oh <= 0 or ow <= 0:
            raise self.error("bottom shape %s is too small for kernel/pad/stride/dilation %s "
                             "(output %dx%d)", shape, self.geom, oh, ow)
        for t in top:
            t.reshape((shape[0], self.num_output, oh, ow))

    def _conv(self, x, w, bias=None):
        return kernels.conv2d_forward(self.xp, x, w, self.geom, self.group, bias, use_cudnn=self.use_cudnn)

    def _conv_t(self, dy, w, x_shape):
        return kernels.conv2d_backward(self.xp, None, w, dy, self.geom, self.group,
                                       need_dx=True, need_dw=False, x_shape=x_shape,
                                       use_cudnn=self.use_cudnn)[0]

    def _conv_dw(self, x, dy, w):
        return kernels.conv2d_backward(self.xp, x, w, dy, self.geom, self.group,
                                       need_dx=False, need_dw=True, use_cudnn=self.use_cudnn)[1]

    def forward(self, bottom, top):
        w = self.blobs[0].data
        bias = self.blobs[1].data if self.bias_term else None
        for b, t in zip(bottom, top):
            if self.transposed:
                y = self._conv_t(b.data, w, t.shape)
                if bias is not None:
                    y += bias.reshape(1, -1, 1, 1)
            else:
                y = self._conv(b.data, w, bias)
            t.data = y

    def backward(self, top, propagate_down, bottom):
        w = self.blobs[0].data
        for i, (t, b) in enumerate(zip(top, bottom)):
            dy = t.diff
            if self.bias_term:
                self.blobs[1].diff += kernels.bias_grad(self.xp, dy)
            if self.transposed:
                # a deconvolution is the data-gradient of a convolution whose
                # input is our top: swap the roles of x and y
                self.blobs[0].diff += self._conv_dw(dy, b.data, w)
                if propagate_down[i]:
                    b.diff = self._conv(dy, w)
            else:
                dx, dw = kernels.conv2d_backward(self.xp, b.data, w, dy, self.geom, self.group,
                                                 need_dx=bool(propagate_down[i]), need_dw=True,
                                                 use_cudnn=self.use_cudnn)
                self.blobs[0].diff += dw
                if propagate_down[i]:
                    b.diff = dx


@register("Convolution")
class ConvolutionLayer(_ConvBase):
    pass


@register("Deconvolution")
class DeconvolutionLayer(_ConvBase):
    transposed = True
