"""Fully connected layers: InnerProduct and Embed (a table lookup that is an
inner product with one-hot inputs)."""
from ..backend import kernels
from .base import Layer, register

# Embed's backward builds one-hot rows in chunks of at most this many elements.
_ONE_HOT_CHUNK = 1 << 24


def _canonical_axis(layer, axis, ndim):
    if not -ndim <= axis < ndim:
        raise layer.error("axis %d out of range for a %d-axis bottom", axis, ndim)
    return axis % ndim


@register("InnerProduct")
class InnerProductLayer(Layer):
    """top = bottom (flattened from ``axis``) x W^T + b, with W of shape
    (num_output, K), or (K, num_output) when ``transpose`` is set."""

    backward_reads_top_data = False
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        """Samplewise unless the product flattens the batch axis in."""
        return 1.0 if self.axis > 0 else None

    def setup(self, bottom, top):
        p = self.param.inner_product_param
        self.num_output = int(p.num_output)
        if self.num_output <= 0:
            raise self.error("num_output must be positive, got %d", self.num_output)
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        self.axis = _canonical_axis(self, p.axis, bottom[0].num_axes)
        k = bottom[0].count_range(self.axis)
        if not self.blobs:
            wshape = (k, self.num_output) if self.transpose else (self.num_output, k)
            self.blobs = [self.fill(p.weight_filler, wshape)]
            if self.bias_term:
                self.blobs.append(self.fill(p.bias_filler, (self.num_output,)))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        self.axis = _canonical_axis(self, self.param.inner_product_param.axis, len(shape))
        k = bottom[0].count_range(self.axis)
        wshape = self.blobs[0].shape
        expected = (k, self.num_output) if self.transpose else (self.num_output, k)
        if wshape != expected:
            raise self.error("input size %d (bottom %s flattened from axis %d) and num_output %d "
                             "need weight shape %s, have %s",
                             k, shape, self.axis, self.num_output, expected, wshape)
        self.M = bottom[0].count_range(0, self.axis)
        self.K = k
        top[0].reshape(shape[:self.axis] + (self.num_output,))

    def _weight_nk(self):
        """The weight as an (N, K) matrix (a view)."""
        w = self.blobs[0].data
        return w.T if self.transpose else w

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.M, self.K)
        w = self._weight_nk()
        if self.num_output > self.M:
            # the longer side as the product's rows, which OpenBLAS runs
            # faster (docs/design/cpu.md); the transpose back is fused with
            # the bias add
            y = self.xp.empty((self.M, self.num_output), x.dtype)
            yt = kernels.matmul(self.xp, w, x.T).T
            if self.bias_term:
                self.xp.add(yt, self.blobs[1].data, out=y)
            else:
                y[...] = yt
        else:
            y = kernels.matmul(self.xp, x, w.T)
            if self.bias_term:
                y += self.blobs[1].data
        top[0].data = y.reshape(top[0].shape)

    def weight_factors(self):
        return self.M, self.transpose

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.M, self.num_output)
        x = bottom[0].data.reshape(self.M, self.K)
        if self.param_propagate_down(0):
            if self.transpose:
                kernels.matmul_into(self.xp, x.T, dy, self.blobs[0].diff, accumulate=True)
            else:
                kernels.matmul_into(self.xp, dy.T, x, self.blobs[0].diff, accumulate=True)
        if self.bias_term:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff = kernels.matmul(self.xp, dy, self._weight_nk()).reshape(bottom[0].shape)


@register("Embed")
class EmbedLayer(Layer):
    """Looks up rows of a (input_dim, num_output) table by the integer values
    held (as floats) in the bottom; top shape is bottom shape + (num_output,)."""

    backward_reads_top_data = False
    samplewise = True
    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        p = self.param.embed_param
        self.num_output = int(p.num_output)
        self.input_dim = int(p.input_dim)
        if self.num_output <= 0:
            raise self.error("num_output must be positive, got %d", self.num_output)
        if self.input_dim <= 0:
            raise self.error("input_dim must be positive, got %d", self.input_dim)
        self.bias_term = p.bias_term
        if not self.blobs:
            # (K, N): transposed relative to InnerProduct so a lookup reads a row.
            self.blobs = [self.fill(p.weight_filler, (self.input_dim, self.num_output))]
            if self.bias_term:
                self.blobs.append(self.fill(p.bias_filler, (self.num_output,)))

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _indices(self, bottom, check=True):
        """The rows bottom 0 names; with ``check`` (forward), whether they are
        integers in range is checked (Layer.check_values: on the GPU when the
        net reads its loss, the rows clipped meanwhile)."""
        xp = self.xp
        x = bottom[0].data.reshape(-1)
        if check:
            def refuse(bad):
                if bad:
                    raise self.error("bottom %s holds indices that are not integers in [0, %d)",
                                     bottom[0].shape, self.input_dim)
            self.check_values(((x < 0) | (x >= self.input_dim) | (x != xp.floor(x))).any(), refuse)
        rows = x.astype(xp.int32)
        return rows if self.deferred_checks is None else xp.clip(rows, 0, self.input_dim - 1)

    def forward(self, bottom, top):
        y = self.blobs[0].data[self._indices(bottom)]
        if self.bias_term:
            y = y + self.blobs[1].data
        top[0].data = y.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error("cannot backpropagate to the indices in its bottom")
        xp = self.xp
        idx = self._indices(bottom, check=False)
        dy = top[0].diff.reshape(-1, self.num_output)
        # Scatter-add of dy rows into the table as one-hot^T @ dy: one code
        # path for NumPy and CuPy; chunked to bound the one-hot's memory.
        classes = xp.arange(self.input_dim, dtype=xp.int32)
        step = max(1, _ONE_HOT_CHUNK // self.input_dim)
        grad = None
        for start in range(0, idx.shape[0], step):
            onehot = (idx[start:start + step, None] == classes[None, :]).astype(self.dtype)
            part = onehot.T @ dy[start:start + step]
            grad = part if grad is None else grad + part
        if grad is not None:
            self.blobs[0].diff += grad
        if self.bias_term:
            self.blobs[1].diff += dy.sum(axis=0)
