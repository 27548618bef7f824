"""Normalization layers: BatchNorm (per-channel statistics over the batch)
and MVN (per-sample mean/variance normalization)."""
from ..backend import channels, kernels
from ..common import TEST
from ..proto import caffe_pb2
from .base import Layer, register
from .neuron import ReLULayer, relu_gradient
from .scale import ScaleLayer


def _normalize_backward(xp, dy_of, y, std, dx=None):
    """dx for y = (x - mean(x)) / std with the mean and std per channel of
    the (outer, C, inner) views: both depend on x, giving (dy - mean(dy) -
    mean(dy*y)*y) / std (means over axes 0 and 2), per block of channels in
    cache (:func:`kernels.per_channel`; BatchNorm's share of a ResNet step
    is its passes over memory).  ``dy_of(block)``: dy's block of channels,
    a view, or made there from the gradient of the layers after it; into
    ``dx`` where given."""
    count = y.dtype.type(y.shape[0] * y.shape[2])
    dx = xp.empty(y.shape, y.dtype) if dx is None else dx

    def block(b):
        dyb, yb, dxb = dy_of(b), y[:, b], dx[:, b]
        mean_dy = kernels.sum_over(xp, dyb, (0, 2)) / count
        mean_dyy = kernels.sum_of_products(xp, dyb, yb, (0, 2)) / count
        xp.multiply(yb, -mean_dyy[:, None], out=dxb)
        dxb += dyb
        dxb -= mean_dy[:, None]
        dxb /= std[b, None]
    kernels.per_channel(xp, block, y.shape, y.dtype)
    return dx


@register("BatchNorm")
class BatchNormLayer(Layer):
    """Caffe's BatchNorm: y = (x - mean) / sqrt(var + eps) per channel.

    blobs: [running mean sum (C,), running variance sum (C,), scale factor (1,)];
    the mean and variance estimates are blobs[0]/blobs[2] and blobs[1]/blobs[2].
    Caffe forces their lr_mult to 0; the net takes care of that.

    NVCaffe's ``scale_bias`` (implied by ``scale_filler`` or ``bias_filler``)
    appends a learnable per-channel scale (C,) and bias (C,) as blobs[3] and
    blobs[4], NVCaffe's order, and outputs y * scale + bias: a Scale layer
    with bias_term inside, so NVCaffe models load with their five blobs.  The
    statistics stay BVLC's (NVCaffe's snapshots store the estimates with
    factor 1, which reads the same).
    """

    statistics_params = 3
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    backward_state = ("_y",)
    recompute_cheap = True

    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        p = self.param.batch_norm_param
        self.maf = float(p.moving_average_fraction)
        self.use_global_stats = p.use_global_stats if p.HasField("use_global_stats") \
            else self.phase == TEST
        self.eps = float(p.eps)
        self.channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        self.scale_bias = p.scale_bias or p.HasField("scale_filler") or p.HasField("bias_filler")
        if not self.blobs:
            self.blobs = []
            for shape in ((self.channels,), (self.channels,), (1,)):
                blob = self.new_blob(shape)
                blob.data = self.xp.zeros(shape, self.dtype)
                self.blobs.append(blob)
            if self.scale_bias:
                scale_filler = p.scale_filler if p.HasField("scale_filler") else \
                    caffe_pb2.FillerParameter(type="constant", value=1)
                self.blobs.append(self.fill(scale_filler, (self.channels,)))
                self.blobs.append(self.fill(p.bias_filler, (self.channels,)))   # default: constant 0

    def share_scale(self, share, batch):
        """Samplewise only on the stored statistics: the batch's own mean and
        variance mix its samples."""
        return 1.0 if self.use_global_stats else None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 1 and shape[1] != self.channels:
            raise self.error("bottom %s has %d channels; the layer was set up for %d",
                             shape, shape[1], self.channels)
        if top[0] is not bottom[0]:
            top[0].reshape(shape)

    def _view(self, x):
        """x as (N, C, spatial) so statistics reduce over axes 0 and 2."""
        return x.reshape(x.shape[0] if x.ndim else 1, self.channels, -1)

    def absorb(self, followers):
        """Caffe's spelling of a normalisation with a learned affine and its
        activation, BatchNorm → Scale → ReLU in place (ResNet's), runs as
        one pass over each block of channels each way instead of three: on
        the CPU these layers cost their passes over memory.  Takes a Scale
        per channel (its bias or not), then a ReLU of slope 0; the numbers
        are those of the layers one by one."""
        operands = followers[0].channel_operands(self.channels) \
            if not self.scale_bias and isinstance(followers[0], ScaleLayer) else None
        if operands is None:
            return 0
        self._chain_scale = followers[0]
        self._chain_relu = len(followers) > 1 and isinstance(followers[1], ReLULayer) and followers[1].slope == 0
        return 2 if self._chain_relu else 1

    def _affine(self):
        """(scale blob, bias blob or None) of NVCaffe's scale_bias, else None."""
        return (self.blobs[3], self.blobs[4]) if self.scale_bias else None

    def forward(self, bottom, top):
        self._forward(bottom, top, self._affine(), relu=False)

    def forward_chain(self, bottom, top):
        self._forward(bottom, top, self._chain_scale.channel_operands(self.channels), self._chain_relu)
        self._chain_scale.take_input(self._y.reshape(bottom[0].shape))

    def _forward(self, bottom, top, affine, relu):
        """top = max(y * scale + bias, 0) for y the normalised x, the affine
        (blobs (scale, bias or None)) and the max where asked, a block of
        channels at a time (compiled: backend/channels.py)."""
        xp = self.xp
        x = self._view(bottom[0].data)
        dtype = self.dtype.type
        eps = dtype(self.eps)
        if self.use_global_stats:
            factor = self.blobs[2].data
            # A zero scale factor (no statistics yet) gives zero mean and variance.
            inv = (factor != 0).astype(self.dtype) / xp.where(factor == 0, dtype(1), factor)
            mean = self.blobs[0].data * inv
            var = self.blobs[1].data * inv
            std = xp.sqrt(var + eps)
        else:
            mean, var, std = (xp.empty(self.channels, self.dtype) for _ in range(3))
        # Backward needs y; keep a private copy since an in-place successor may
        # overwrite top's data (as Caffe keeps x_norm_).  A bound top copies
        # what it is given (the memory plan's buffer), so it may get y itself.
        y = xp.empty(x.shape, self.dtype)
        out = y if top[0].bound and not affine and not relu else xp.empty(x.shape, self.dtype)
        scale = affine[0].data.reshape(-1) if affine else None
        bias = affine[1].data.reshape(-1) if affine and affine[1] is not None else None
        running = None
        if not self.use_global_stats:
            # Caffe's moving averages, updated where the statistics are made
            m = x.size // self.channels
            running = (self.blobs[0].data, self.blobs[1].data, self.maf, m / (m - 1.0) if m > 1 else 1.0)
            factor = self.blobs[2].data          # in place, as the sums: state a step carries
            factor *= self.maf
            factor += 1
        if channels.available(*(a for a in (x, y, out, mean, std, scale, bias) + (running or ())[:2]
                                if a is not None)):
            stats = channels.GIVEN_STATS if self.use_global_stats else channels.BATCH_STATS
            stored = None if out is y else out

            def block(b):
                channels.forward(x, y, stored, stats, mean, var, std, scale, bias, relu, self.eps, b, running)
        else:
            block = self._numpy_forward_block(x, y, out, mean, var, std, scale, bias, relu, running)
        kernels.per_channel(xp, block, x.shape, self.dtype)
        self._std = std
        self._y = y
        top[0].data = out.reshape(bottom[0].shape)

    def _numpy_forward_block(self, x, y, out, mean, var, std, scale, bias, relu, running):
        """The forward of a block of channels as NumPy calls (float64, or
        where the compiled kernels do not run)."""
        xp = self.xp
        dtype = self.dtype.type
        eps = dtype(self.eps)
        m = x.size // self.channels

        def block(b):
            # one pass over each block of channels, in cache from the first step
            xb, yb, ob = x[:, b], y[:, b], out[:, b]
            if not self.use_global_stats:
                mean[b] = kernels.sum_over(xp, xb, (0, 2)) / dtype(m)
            xp.subtract(xb, mean[b, None], out=yb)
            if not self.use_global_stats:
                var[b] = kernels.sum_of_products(xp, yb, yb, (0, 2)) / dtype(m)
                std[b] = xp.sqrt(var[b] + eps)
            yb /= std[b, None]
            if scale is not None:
                xp.multiply(yb, scale[b, None], out=ob)
                if bias is not None:
                    ob += bias[b, None]
            elif out is not y:
                ob[...] = yb
            if relu:
                xp.maximum(ob, 0, out=ob)
            if running is not None:
                channels.update_running(running, mean, var, b)
        return block

    def backward(self, top, propagate_down, bottom):
        self._backward(top, propagate_down, bottom, self._affine(), relu=False)

    def backward_chain(self, top, propagate_down, bottom):
        self._backward(top, propagate_down, bottom, self._chain_scale.channel_operands(self.channels),
                       self._chain_relu)

    def _backward(self, top, propagate_down, bottom, affine, relu):
        """The gradients of :meth:`_forward`'s output, a block of channels at
        a time: the ReLU's mask from the top's data, the affine's sums, dx."""
        xp = self.xp
        dy = self._view(top[0].diff)
        out = self._view(top[0].data) if relu else None
        y = self._y
        scale = affine[0].data.reshape(-1) if affine else None
        dscale = xp.empty(self.channels, self.dtype) if affine else None
        dbias = xp.empty(self.channels, self.dtype) if affine and affine[1] is not None else None
        dx = xp.empty(dy.shape, dy.dtype) if propagate_down[0] else None
        if dx is None and not affine:
            return
        if channels.available(*(a for a in (dy, out, y, dx, self._std, scale) if a is not None)):
            stats = channels.GIVEN_STATS if self.use_global_stats else channels.BATCH_STATS

            def block(b):
                channels.backward(dy, y, dx, stats, self._std, scale, dscale, dbias, out, b)
            kernels.per_channel(xp, block, dy.shape, dy.dtype)
        else:
            self._numpy_backward(dy, out, y, dx, scale, dscale, dbias)
        if affine:
            affine[0].diff += dscale.reshape(affine[0].shape)
            if dbias is not None:
                affine[1].diff += dbias.reshape(affine[1].shape)
        if dx is not None:
            bottom[0].diff = dx.reshape(bottom[0].shape)

    def _numpy_backward(self, dy, out, y, dx, scale, dscale, dbias):
        """:meth:`_backward`'s blocks as NumPy calls (float64, or where the
        compiled kernels do not run); dx written unless None."""
        xp = self.xp

        def dy_of(b):
            # the gradient reaching y in this block (through the max and the affine)
            g = dy[:, b]
            if out is not None:
                g = relu_gradient(xp, g, out[:, b])
            if scale is not None:
                if dbias is not None:
                    dbias[b] = kernels.sum_over(xp, g, (0, 2))
                dscale[b] = kernels.sum_of_products(xp, g, y[:, b], (0, 2))
                g = xp.multiply(g, scale[b, None])
            return g
        if dx is None:
            kernels.per_channel(xp, dy_of, dy.shape, dy.dtype)
        elif self.use_global_stats:
            std = self._std
            kernels.per_channel(xp, lambda b: xp.divide(dy_of(b), std[b, None], out=dx[:, b]),
                                dy.shape, dy.dtype)
        else:
            _normalize_backward(xp, dy_of, y, self._std, dx)


@register("MVN")
class MVNLayer(Layer):
    """Subtracts the mean of each sample's channel (or of each whole sample
    with across_channels) and, with normalize_variance, divides by std + eps."""

    backward_reads_bottom_data = False
    backward_reads_top_data = False
    backward_state = ("_y",)
    recompute_cheap = True
    samplewise = True

    exact_num_bottom = 1
    exact_num_top = 1

    def reshape(self, bottom, top):
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def _view(self, x):
        """x as (groups, elements per group)."""
        p = self.param.mvn_param
        groups = x.shape[0] if p.across_channels or x.ndim < 2 else x.shape[0] * x.shape[1]
        return x.reshape(groups, -1)

    def forward(self, bottom, top):
        xp = self.xp
        p = self.param.mvn_param
        x = self._view(bottom[0].data)
        y = x - x.mean(axis=1, keepdims=True)
        if p.normalize_variance:
            # Caffe adds eps to the standard deviation, not to the variance.
            self._std = xp.sqrt((y * y).mean(axis=1, keepdims=True)) + self.dtype.type(p.eps)
            y = y / self._std
            self._y = y
        top[0].data = y.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = self._view(top[0].diff)
        if self.param.mvn_param.normalize_variance:
            # Caffe's formula (exact up to the eps in the denominator), each
            # group a channel of a (1, groups, elements) view
            dy3 = dy[None]
            dx = _normalize_backward(self.xp, lambda b: dy3[:, b], self._y[None], self._std.reshape(-1))[0]
        else:
            dx = dy - dy.mean(axis=1, keepdims=True)
        bottom[0].diff = dx.reshape(bottom[0].shape)
