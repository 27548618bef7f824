"""Convolution and Deconvolution (transposed convolution), 2-D, as Caffe's
BaseConvolutionLayer: bottom i -> top i with shared weights, groups, dilation;
Im2col, the unfolded input itself.
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


def _geometry(layer, cp, bottom):
    """The window geometry (kh, kw, sh, sw, ph, pw, dh, dw) of a
    ConvolutionParameter over the (N, C, H, W) blob ``bottom``: 2-D over
    axis 1 only (the kernels are 2-D)."""
    if cp.axis not in (1, -3) or bottom.num_axes != 4:
        raise layer.error("only 2-D convolution of (N, C, H, W) blobs over axis 1 is supported "
                          "(bottom shape %s, axis %d)", bottom.shape, cp.axis)
    kh, kw = _two(layer, cp.kernel_size, cp.kernel_h, cp.kernel_w,
                  cp.HasField("kernel_h"), cp.HasField("kernel_w"), "kernel", None)
    ph, pw = _two(layer, cp.pad, cp.pad_h, cp.pad_w,
                  cp.HasField("pad_h"), cp.HasField("pad_w"), "pad", 0)
    sh, sw = _two(layer, cp.stride, cp.stride_h, cp.stride_w,
                  cp.HasField("stride_h"), cp.HasField("stride_w"), "stride", 1)
    dil = list(cp.dilation)
    if len(dil) > 2:
        raise layer.error("dilation has %d values; only 2-D convolution is supported", len(dil))
    dh, dw = (1, 1) if not dil else (dil[0], dil[-1])
    if min(kh, kw) <= 0 or min(sh, sw) <= 0 or min(dh, dw) <= 0 or min(ph, pw) < 0:
        raise layer.error("kernel, stride and dilation must be positive and pad non-negative "
                          "(kernel %dx%d, stride %dx%d, dilation %dx%d, pad %dx%d)",
                          kh, kw, sh, sw, dh, dw, ph, pw)
    return (kh, kw, sh, sw, ph, pw, dh, dw)


def _out_size(geom, h, w):
    """Caffe's convolution output (height, width) for an h x w input."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    return kernels.conv_out_size(h, kh, sh, ph, dh), kernels.conv_out_size(w, kw, sw, pw, dw)


class _ConvBase(Layer):
    backward_reads_top_data = False     # memory planner (see Layer)
    samplewise = True
    min_bottom = 1
    min_top = 1
    transposed = False      # Deconvolution

    def setup(self, bottom, top):
        if len(bottom) != len(top):
            raise self.error("needs as many tops as bottoms, got %d bottoms and %d tops",
                             len(bottom), len(top))
        cp = self.param.convolution_param
        self.geom = _geometry(self, cp, bottom[0])
        kh, kw = self.geom[:2]
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
        return _out_size(self.geom, h, w)

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


@register("Im2col")
class Im2colLayer(Layer):
    """Caffe's Im2col: the top is each image's column matrix, N x (C*kh*kw) x
    oh x ow, channel (c*kh + i)*kw + j holding input channel c at kernel tap
    (i, j) (zero where the tap falls in the padding); backward is col2im.
    2-D over axis 1 only, as our Convolution: Caffe's N-D im2col and other
    channel axes are refused with an error (``force_nd_im2col`` picks only
    Caffe's algorithm, not the result, so it is accepted)."""
    backward_reads_bottom_data = False     # memory planner (see Layer): shapes only
    backward_reads_top_data = False
    samplewise = True
    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        self.geom = _geometry(self, self.param.convolution_param, bottom[0])

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.error("bottom must be 4-D (num, channels, height, width), got %s", shape)
        n, c, h, w = shape
        oh, ow = self.out_hw = _out_size(self.geom, h, w)
        if oh <= 0 or ow <= 0:
            raise self.error("bottom shape %s is too small for kernel/pad/stride/dilation %s "
                             "(output %dx%d)", shape, self.geom, oh, ow)
        top[0].reshape((n, c * self.geom[0] * self.geom[1], oh, ow))

    def forward(self, bottom, top):
        oh, ow = self.out_hw
        col = kernels.im2col(self.xp, bottom[0].data, self.geom, oh, ow)    # (K, N*oh*ow)
        n = bottom[0].shape[0]
        top[0].data = self.xp.ascontiguousarray(col.reshape(-1, n, oh, ow).transpose(1, 0, 2, 3))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        oh, ow = self.out_hw
        dy = top[0].diff
        col = self.xp.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(dy.shape[1], -1)
        bottom[0].diff = kernels.col2im(self.xp, col, bottom[0].shape, self.geom, oh, ow)
