"""Scale and Bias: multiply / add an operand (a parameter or a second bottom)
that covers axes [axis, axis + operand.ndim) of bottom[0] and is broadcast
over the others."""
from ..backend import channels, kernels
from .base import Layer, register


def _param_shape(layer, shape, axis_param, num_axes):
    """Shape of a learned operand: bottom axes [axis, axis+num_axes), -1 = to the end."""
    ndim = len(shape)
    if not -ndim <= axis_param < max(ndim, 1):
        raise layer.error("axis %d out of range for bottom %s", axis_param, shape)
    axis = axis_param % ndim if ndim else 0
    if num_axes < -1:
        raise layer.error("num_axes must be non-negative or -1, got %d", num_axes)
    end = ndim if num_axes == -1 else axis + num_axes
    if end > ndim:
        raise layer.error("operand of %d axes starting at axis %d extends past bottom %s",
                          num_axes, axis, shape)
    return tuple(shape[axis:end])


def _share_scale(layer, p):
    """Layer.share_scale of Scale and Bias (``p`` their param): samplewise
    unless a learned operand spans the batch axis (its shape is the batch's)."""
    learned = len(layer.param.bottom) == 1
    ndim = len(layer.bottom_shape)
    spans_batch = ndim > 0 and p.axis % ndim == 0 and p.num_axes != 0
    return None if learned and spans_batch else 1.0


def _broadcast_dims(layer, shape, operand_shape, axis_param):
    """(outer, dim, inner) so that bottom reshaped to (outer, dim, inner)
    meets the operand reshaped to (1, dim, 1)."""
    ndim = len(shape)
    if not operand_shape:
        # A scalar broadcasts the same from any axis.
        axis = 0
    else:
        if not -ndim <= axis_param < max(ndim, 1):
            raise layer.error("axis %d out of range for bottom %s", axis_param, shape)
        axis = axis_param % ndim
    n = len(operand_shape)
    if tuple(shape[axis:axis + n]) != tuple(operand_shape):
        raise layer.error("operand shape %s does not match bottom %s at axes [%d, %d)",
                          operand_shape, shape, axis, axis + n)
    outer = 1
    for d in shape[:axis]:
        outer *= d
    dim = 1
    for d in operand_shape:
        dim *= d
    inner = 1
    for d in shape[axis + n:]:
        inner *= d
    return outer, dim, inner


def _reduce(a, dims):
    """Sum an array of shape (outer*dim*inner) down to (dim,)."""
    return a.reshape(dims).sum(axis=(0, 2))


@register("Scale")
class ScaleLayer(Layer):
    """top = bottom[0] * scale (+ bias).  With one bottom the scale is
    blobs[0] (default filler: constant 1) and an optional bias is blobs[1];
    with two bottoms the scale is bottom[1] and the bias, if any, blobs[0]."""

    backward_reads_top_data = False
    in_place_keeps_input = True
    backward_state = ("_x",)
    recompute_cheap = True

    min_bottom = 1
    max_bottom = 2
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale(self, self.param.scale_param)

    def setup(self, bottom, top):
        p = self.param.scale_param
        shape = self.bottom_shape = bottom[0].shape
        if len(bottom) == 1 and not self.blobs:
            sshape = _param_shape(self, shape, p.axis, p.num_axes)
            if p.HasField("filler"):
                blob = self.fill(p.filler, sshape)
            else:
                blob = self.new_blob(sshape)
                blob.data = self.xp.ones(sshape, self.dtype)
            self.blobs = [blob]
        self.bias_term = p.bias_term
        self.bias_index = None
        if self.bias_term:
            # Caffe's internal Bias layer: same axis; num_axes of the scale.
            self.bias_index = 1 if len(bottom) == 1 else 0
            if len(self.blobs) <= self.bias_index:
                if len(bottom) > 1:
                    bshape = _param_shape(self, shape, p.axis, bottom[1].num_axes)
                else:
                    bshape = _param_shape(self, shape, p.axis, p.num_axes)
                self.blobs.append(self.fill(p.bias_filler, bshape))

    def _scale(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def channel_operands(self, channels):
        """(scale blob, bias blob or None) where this layer multiplies axis 1
        of its one bottom by ``channels`` learned numbers (BatchNorm's
        affine in Caffe's spelling), else None."""
        p = self.param.scale_param
        ndim = len(self.bottom_shape)
        if len(self.param.bottom) != 1 or ndim < 2 or p.axis % ndim != 1 or self.blobs[0].shape != (channels,):
            return None
        return self.blobs[0], self.blobs[self.bias_index] if self.bias_term else None

    def take_input(self, x):
        """The input a layer that absorbed this one (:meth:`Layer.absorb`)
        computed for it, kept for this layer's backward as its own in-place
        forward keeps it."""
        self._x = x

    def reshape(self, bottom, top):
        axis = self.param.scale_param.axis
        self.dims = _broadcast_dims(self, bottom[0].shape, self._scale(bottom).shape, axis)
        if self.bias_term and self.blobs[self.bias_index].shape != self._scale(bottom).shape:
            # as Caffe's internal Bias layer, whose blob takes the scale's axes
            raise self.error("bias shape %s differs from the scale's %s",
                             self.blobs[self.bias_index].shape, self._scale(bottom).shape)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        # In place, keep the input for the scale's gradient: the array itself
        # where top's data is rebound to the output, a copy where the memory
        # plan binds the blob (the output is written into it)
        self._x = (x.copy() if top[0].bound else x) if top[0] is bottom[0] else None
        x3 = x.reshape(self.dims)
        scale = self._scale(bottom).data.reshape(-1)
        bias = self.blobs[self.bias_index].data.reshape(-1) if self.bias_term else None
        y = xp.empty(self.dims, x.dtype)

        def block(b):
            yb = xp.multiply(x3[:, b], scale[b, None], out=y[:, b])
            if bias is not None:
                yb += bias[b, None]
        kernels.per_channel(xp, block, self.dims, x.dtype)
        top[0].data = y.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        dy = top[0].diff.reshape(self.dims)
        x = (self._x if self._x is not None else bottom[0].data).reshape(self.dims)
        scale = self._scale(bottom)
        s = scale.data.reshape(-1)
        dim = self.dims[1]
        dbias = xp.empty(dim, dy.dtype) if self.bias_term else None
        dscale = xp.empty(dim, dy.dtype) if len(bottom) == 1 or propagate_down[1] else None
        dx = xp.empty(self.dims, dy.dtype) if propagate_down[0] else None
        if channels.available(*(a for a in (dy, x, s, dx) if a is not None)):
            # compiled, BatchNorm's kernel without statistics: a chain of the
            # two fused (BatchNorm.absorb) sums in the same order
            sums = dscale if dscale is not None else xp.empty(dim, dy.dtype)

            def block(b):
                channels.backward(dy, x, dx, channels.NO_STATS, None, s, sums, dbias, None, b)
        else:
            def block(b):
                # the sums and dx in one pass over each block of channels
                dyb = dy[:, b]
                if dbias is not None:
                    dbias[b] = kernels.sum_over(xp, dyb, (0, 2))
                if dscale is not None:
                    dscale[b] = kernels.sum_of_products(xp, dyb, x[:, b], (0, 2))
                if dx is not None:
                    xp.multiply(dyb, s[b, None], out=dx[:, b])
        kernels.per_channel(xp, block, self.dims, dy.dtype)
        if dbias is not None:
            bias = self.blobs[self.bias_index]
            bias.diff += dbias.reshape(bias.shape)
        if dscale is not None:
            if len(bottom) == 1:
                scale.diff += dscale.reshape(scale.shape)
            else:
                scale.diff = dscale.reshape(scale.shape)
        if dx is not None:
            bottom[0].diff = dx.reshape(bottom[0].shape)


@register("Bias")
class BiasLayer(Layer):
    """top = bottom[0] + bias, the bias being blobs[0] (default filler:
    constant 0) or bottom[1]."""

    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True

    min_bottom = 1
    max_bottom = 2
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale(self, self.param.bias_param)

    def setup(self, bottom, top):
        p = self.param.bias_param
        self.bottom_shape = bottom[0].shape
        if len(bottom) == 1 and not self.blobs:
            self.blobs = [self.fill(p.filler, _param_shape(self, bottom[0].shape, p.axis,
                                                           p.num_axes))]

    def _bias(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        self.dims = _broadcast_dims(self, bottom[0].shape, self._bias(bottom).shape,
                                    self.param.bias_param.axis)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        y = bottom[0].data.reshape(self.dims) + self._bias(bottom).data.reshape(1, self.dims[1], 1)
        top[0].data = y.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        bias = self._bias(bottom)
        if len(bottom) == 1:
            bias.diff += _reduce(dy, self.dims).reshape(bias.shape)
        elif propagate_down[1]:
            bias.diff = _reduce(dy, self.dims).reshape(bias.shape)
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff = dy.copy()
