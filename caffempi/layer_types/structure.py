"""Layers that move, combine or summarise blobs: Concat, Slice, Split,
Flatten, Reshape, Crop, Tile, Eltwise, Silence, Reduction, ArgMax, Filter and
BatchReindex, and Parameter, whose top is its own learnable blob (BVLC Caffe
semantics)."""
from ..backend import kernels
from ..proto import caffe_pb2
from .base import Layer, register
from .neuron import ReLULayer, relu_gradient

_ELTWISE = caffe_pb2.EltwiseParameter
_REDUCTION = caffe_pb2.ReductionParameter


# ------------------------------------------------------------------ helpers
def _canonical_axis(layer, blob, axis):
    """Caffe's CanonicalAxisIndex, raising a layer error when out of range."""
    n = blob.num_axes
    if not -n <= axis < n:
        raise layer.error("axis %d out of range for a %d-D bottom of shape %s", axis, n, blob.shape)
    return axis % n


def _share_scale_over(axis):
    """Layer.share_scale of a layer that works along ``axis`` and keeps the
    axes before it: samplewise unless that is the batch axis."""
    return 1.0 if axis is None or axis > 0 else None


def _legacy_axis(layer, blob, param, dim_field):
    """The axis of Concat/Slice: ``axis`` or the legacy ``concat_dim`` /
    ``slice_dim`` (never both; the legacy field takes no negative values)."""
    if param.HasField(dim_field):
        if param.HasField("axis"):
            raise layer.error("give either axis or %s, not both", dim_field)
        dim = getattr(param, dim_field)
        if dim >= blob.num_axes:
            raise layer.error("%s %d out of range for a %d-D bottom of shape %s",
                              dim_field, dim, blob.num_axes, blob.shape)
        return dim
    return _canonical_axis(layer, blob, param.axis)


def _prod(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _contiguous_part(xp, a, axis, start, stop):
    """a[..., start:stop, ...] along axis; a view when that is contiguous
    (axis 0, or every leading dim 1), else a compact copy."""
    part = a[(slice(None),) * axis + (slice(start, stop),)]
    if _prod(a.shape[:axis]) == 1:
        return part
    return xp.ascontiguousarray(part)


def _weighted_sum(xp, arrays, coeffs, relu=False):
    """A new array: the sum of c * a over ``arrays`` (of one shape) and
    ``coeffs``, added in order, each product rounded to the arrays' dtype
    first (a coefficient of 1 takes the array as it is), then max(sum, 0)
    with ``relu``; in blocks on the intra-op threads
    (:func:`kernels.elementwise`)."""
    scalar = arrays[0].dtype.type
    fused = ("sum_relu" if relu else "sum") if all(c == 1 for c in coeffs) else None

    def fn(first, *rest, out):
        if coeffs[0] == 1:
            xp.copyto(out, first)
        else:
            xp.multiply(first, scalar(coeffs[0]), out=out)
        for a, c in zip(rest, coeffs[1:]):
            out += a if c == 1 else a * scalar(c)
        if relu:
            xp.maximum(out, 0, out=out)
    return kernels.elementwise(xp, fn, *arrays, fused=fused)


def _no_in_place(layer, bottom, top):
    if top[0] is bottom[0]:
        raise layer.error("does not allow in-place computation")


# --------------------------------------------------------- Concat and Slice
@register("Concat")
class ConcatLayer(Layer):
    """Joins its bottoms along one axis."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    min_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._axis)

    def reshape(self, bottom, top):
        b0 = bottom[0]
        axis = self._axis = _legacy_axis(self, b0, self.param.concat_param, "concat_dim")
        size = 0
        for b in bottom:
            if b.num_axes != b0.num_axes or any(
                    b.shape[i] != b0.shape[i] for i in range(b0.num_axes) if i != axis):
                raise self.error("bottom shapes %s and %s differ outside the concat axis %d",
                                 b0.shape, b.shape, axis)
            size += b.shape[axis]
        shape = list(b0.shape)
        shape[axis] = size
        top[0].reshape(shape)

    def forward(self, bottom, top):
        if len(bottom) == 1:
            top[0].data = bottom[0].data
            return
        top[0].data = self.xp.concatenate([b.data for b in bottom], axis=self._axis)

    def backward(self, top, propagate_down, bottom):
        if len(bottom) == 1:
            if propagate_down[0]:
                bottom[0].diff = top[0].diff
            return
        diff = top[0].diff
        start = 0
        for b, prop in zip(bottom, propagate_down):
            stop = start + b.shape[self._axis]
            if prop:
                b.diff = _contiguous_part(self.xp, diff, self._axis, start, stop)
            start = stop


@register("Slice")
class SliceLayer(Layer):
    """Cuts its bottom along one axis at ``slice_point``s, or into equal parts."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    exact_num_bottom = 1
    min_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._axis)

    def reshape(self, bottom, top):
        b = bottom[0]
        axis = self._axis = _legacy_axis(self, b, self.param.slice_param, "slice_dim")
        total = b.shape[axis]
        points = list(self.param.slice_param.slice_point)
        if points:
            if len(points) != len(top) - 1:
                raise self.error("%d slice_point(s) given for %d tops (need %d)",
                                 len(points), len(top), len(top) - 1)
            bounds = [0] + points + [total]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                if hi <= lo:
                    raise self.error("slice points %s must increase strictly within (0, %d) "
                                     "for the bottom of shape %s", points, total, b.shape)
        else:
            if total % len(top):
                raise self.error("axis %d of the bottom of shape %s (size %d) does not split "
                                 "into %d equal parts", axis, b.shape, total, len(top))
            step = total // len(top)
            bounds = [i * step for i in range(len(top) + 1)]
        self._bounds = bounds
        for t, lo, hi in zip(top, bounds[:-1], bounds[1:]):
            shape = list(b.shape)
            shape[axis] = hi - lo
            t.reshape(shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        if len(top) == 1:
            top[0].data = x
            return
        for t, lo, hi in zip(top, self._bounds[:-1], self._bounds[1:]):
            t.data = _contiguous_part(self.xp, x, self._axis, lo, hi)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if len(top) == 1:
            bottom[0].diff = top[0].diff
            return
        bottom[0].diff = self.xp.concatenate([t.diff for t in top], axis=self._axis)


# -------------------------------------------------------------------- Split
@register("Split")
class SplitLayer(Layer):
    """Hands one bottom to several consumers.  The tops share the bottom's
    array (no copy, as Caffe's ShareData); the gradient is the sum of theirs."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    samplewise = True
    exact_num_bottom = 1
    min_top = 1

    def reshape(self, bottom, top):
        for t in top:
            if t is bottom[0]:
                raise self.error("does not allow in-place computation")
            t.reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        for t in top:
            t.data = x

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if len(top) == 1:
            bottom[0].diff = top[0].diff
            return
        # a new array: the tops' diffs stay intact
        bottom[0].diff = _weighted_sum(self.xp, [t.diff for t in top], [1.0] * len(top))


# --------------------------------------------------------- Flatten, Reshape
class _ViewLayer(Layer):
    """Base of layers whose top is the bottom's data under another shape
    (Caffe shares data and diff); subclasses compute ``_top_shape`` and
    ``_start``, the first axis they change."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._start)

    def _top_shape(self, b):
        raise NotImplementedError

    def reshape(self, bottom, top):
        _no_in_place(self, bottom, top)
        shape = tuple(self._top_shape(bottom[0]))
        if _prod(shape) != bottom[0].count:
            raise self.error("top shape %s does not hold the %d elements of the bottom of shape %s",
                             shape, bottom[0].count, bottom[0].shape)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data = bottom[0].data.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff = top[0].diff.reshape(bottom[0].shape)


@register("Flatten")
class FlattenLayer(_ViewLayer):
    """Merges axes ``axis`` .. ``end_axis`` (inclusive) into one."""

    def _top_shape(self, b):
        p = self.param.flatten_param
        start = self._start = _canonical_axis(self, b, p.axis)
        end = _canonical_axis(self, b, p.end_axis)
        if end < start:
            raise self.error("end_axis %d comes before axis %d for the bottom of shape %s",
                             p.end_axis, p.axis, b.shape)
        return b.shape[:start] + (b.count_range(start, end + 1),) + b.shape[end + 1:]


@register("Reshape")
class ReshapeLayer(_ViewLayer):
    """Replaces axes [axis, axis + num_axes) by ``shape`` (0 copies the
    bottom's dim at that place, one -1 is inferred from the count)."""

    def setup(self, bottom, top):
        dims = [int(d) for d in self.param.reshape_param.shape.dim]
        if sum(1 for d in dims if d == -1) > 1:
            raise self.error("reshape_param shape %s has more than one -1", dims)
        if any(d < -1 for d in dims):
            raise self.error("reshape_param shape %s has a dim below -1", dims)
        self._dims = dims

    def _top_shape(self, b):
        p = self.param.reshape_param
        n = b.num_axes
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            raise self.error("reshape axis %d out of range for the bottom of shape %s", p.axis, b.shape)
        if p.num_axes < -1:
            raise self.error("num_axes must be >= 0, or -1 for all, got %d", p.num_axes)
        end = n if p.num_axes == -1 else start + p.num_axes
        self._start = start + 1 if self._dims[:1] == [0] else start     # dim 0 copies the axis
        if end > n:
            raise self.error("axis %d + num_axes %d exceeds the axes of the bottom of shape %s",
                             p.axis, p.num_axes, b.shape)
        new = []
        for i, d in enumerate(self._dims):
            if d == 0:
                if start + i >= n:
                    raise self.error("reshape dim %d is 0 but the bottom of shape %s has no axis %d "
                                     "to copy", i, b.shape, start + i)
                d = b.shape[start + i]
            new.append(d)
        if -1 in new:
            known = b.count_range(0, start) * b.count_range(end) * _prod(d for d in new if d != -1)
            if known == 0 or b.count % known:
                raise self.error("bottom count %d of shape %s is not divisible by the product "
                                 "of the given dims (%d)", b.count, b.shape, known)
            new[new.index(-1)] = b.count // known
        return b.shape[:start] + tuple(new) + b.shape[end:]


# --------------------------------------------------------------------- Crop
@register("Crop")
class CropLayer(Layer):
    """Crops bottom 0 to the shape of bottom 1 on axes >= ``axis``, starting at
    ``offset`` (one for all cropped axes, or one per cropped axis; default 0)."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    exact_num_bottom = 2
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._start)

    def reshape(self, bottom, top):
        p = self.param.crop_param
        a, b = bottom
        n = a.num_axes
        start = self._start = _canonical_axis(self, a, p.axis)
        offsets = list(p.offset)
        if len(offsets) > 1 and len(offsets) != n - start:
            raise self.error("%d crop offsets given; need 1 or one per axis from %d of the "
                             "bottom of shape %s (%d)", len(offsets), start, a.shape, n - start)
        if b.num_axes < n:
            raise self.error("reference bottom of shape %s has fewer axes than the bottom of shape %s",
                             b.shape, a.shape)
        shape = list(a.shape)
        self._slices = []
        for i in range(n):
            off = 0
            if i >= start:
                off = offsets[0] if len(offsets) == 1 else (offsets[i - start] if offsets else 0)
                shape[i] = b.shape[i]
                if a.shape[i] - off < b.shape[i]:
                    raise self.error("cannot crop the bottom of shape %s to %s at offset %d on axis %d",
                                     a.shape, b.shape, off, i)
            self._slices.append(slice(off, off + shape[i]))
        self._slices = tuple(self._slices)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data = self.xp.ascontiguousarray(bottom[0].data[self._slices])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            g = self.xp.zeros(bottom[0].shape, self.dtype)
            g[self._slices] = top[0].diff
            bottom[0].diff = g
        if propagate_down[1]:
            # The reference bottom only gives a shape: its gradient is zero.
            bottom[1].diff = self.xp.zeros(bottom[1].shape, self.dtype)


# --------------------------------------------------------------------- Tile
@register("Tile")
class TileLayer(Layer):
    """Repeats the bottom ``tiles`` times along ``axis`` (whole blocks of
    axes >= axis, as np.tile does on that axis)."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    recompute_cheap = True
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._axis)

    def reshape(self, bottom, top):
        p = self.param.tile_param
        b = bottom[0]
        if p.tiles < 1:
            raise self.error("tiles must be positive, got %d", p.tiles)
        axis = self._axis = _canonical_axis(self, b, p.axis)
        self._outer = b.count_range(0, axis)
        self._inner = b.count_range(axis)
        shape = list(b.shape)
        shape[axis] *= p.tiles
        top[0].reshape(shape)

    def forward(self, bottom, top):
        tiles = self.param.tile_param.tiles
        x = bottom[0].data.reshape(self._outer, 1, self._inner)
        y = self.xp.broadcast_to(x, (self._outer, tiles, self._inner))
        top[0].data = self.xp.ascontiguousarray(y).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            tiles = self.param.tile_param.tiles
            g = top[0].diff.reshape(self._outer, tiles, self._inner).sum(axis=1)
            bottom[0].diff = g.reshape(bottom[0].shape)


# ------------------------------------------------------------------ Eltwise
@register("Eltwise")
class EltwiseLayer(Layer):
    """Element-wise PROD, SUM (with one ``coeff`` per bottom) or MAX."""
    # SUM reads neither in backward; PROD reads bottoms and top; MAX its index
    backward_reads_bottom_data = lambda self: self._op == _ELTWISE.PROD
    backward_reads_top_data = lambda self: self._op == _ELTWISE.PROD
    backward_state = ("_max_idx",)
    recompute_cheap = lambda self: self._op == _ELTWISE.SUM
    samplewise = True
    min_bottom = 2
    exact_num_top = 1

    def setup(self, bottom, top):
        p = self.param.eltwise_param
        self._op = p.operation
        if p.coeff and len(p.coeff) != len(bottom):
            raise self.error("takes one coeff per bottom: %d coeffs for %d bottoms",
                             len(p.coeff), len(bottom))
        if p.coeff and self._op == _ELTWISE.PROD:
            raise self.error("coeff is only for operation SUM")
        self._coeffs = [float(c) for c in p.coeff] if p.coeff else [1.0] * len(bottom)
        self._max_idx = None

    def reshape(self, bottom, top):
        for b in bottom[1:]:
            if b.shape != bottom[0].shape:
                raise self.error("bottom shapes %s and %s differ", bottom[0].shape, b.shape)
        top[0].reshape(bottom[0].shape)

    def absorb(self, followers):
        """A SUM and a ReLU of slope 0 in place on its top (ResNet's
        shortcut and its activation) run as one pass each way, with the
        numbers of the two layers one by one."""
        relu = followers[0]
        return int(self._op == _ELTWISE.SUM and isinstance(relu, ReLULayer) and relu.slope == 0)

    def forward_chain(self, bottom, top):
        top[0].data = _weighted_sum(self.xp, [b.data for b in bottom], self._coeffs, relu=True)

    def backward_chain(self, top, propagate_down, bottom):
        """The ReLU's gradient (dy where the output is positive) and each
        bottom's share of it, in one pass over dy."""
        xp = self.xp
        wanted = [i for i in range(len(bottom)) if propagate_down[i]]
        if not wanted:
            return
        scalar = self.dtype.type
        coeffs = [self._coeffs[i] for i in wanted]

        def fn(dy, y, out):
            outs = out if len(wanted) > 1 else (out,)
            g = relu_gradient(xp, dy, y, outs[0])
            for o, c in zip(outs[1:], coeffs[1:]):
                if c == 1:
                    xp.copyto(o, g)
                else:
                    xp.multiply(g, scalar(c), out=o)
            if coeffs[0] != 1:
                g *= scalar(coeffs[0])
        diffs = kernels.elementwise(xp, fn, top[0].diff, top[0].data, outputs=len(wanted),
                                    fused="relu_gradient" if all(c == 1 for c in coeffs) else None)
        for i, diff in zip(wanted, diffs if len(wanted) > 1 else (diffs,)):
            bottom[i].diff = diff

    def forward(self, bottom, top):
        xp = self.xp
        if self._op == _ELTWISE.PROD:
            y = bottom[0].data * bottom[1].data
            for b in bottom[2:]:
                y *= b.data
        elif self._op == _ELTWISE.SUM:
            y = _weighted_sum(xp, [b.data for b in bottom], self._coeffs)
        elif self._op == _ELTWISE.MAX:
            # Caffe's tie rule: between bottoms 0 and 1 the later wins, after
            # that an earlier maximum is only replaced by a strictly larger one.
            a, b = bottom[0].data, bottom[1].data
            first = a > b
            y = xp.where(first, a, b)
            idx = xp.where(first, 0, 1).astype(xp.int32)
            for k in range(2, len(bottom)):
                x = bottom[k].data
                larger = x > y
                y = xp.where(larger, x, y)
                idx[larger] = k
            self._max_idx = idx
        else:
            raise self.error("unknown eltwise operation %d", self._op)
        top[0].data = y

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        dy = top[0].diff
        for i, b in enumerate(bottom):
            if not propagate_down[i]:
                continue
            if self._op == _ELTWISE.PROD:
                if self.param.eltwise_param.stable_prod_grad:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    g = others[0] * dy
                    for o in others[1:]:
                        g *= o
                else:
                    g = top[0].data / b.data * dy
            elif self._op == _ELTWISE.SUM:
                # Bottoms get their own arrays, so no two blobs share a diff.
                c = self._coeffs[i]
                g = dy if c == 1 and i == 0 else _weighted_sum(xp, [dy], [c])
            else:
                g = xp.where(self._max_idx == i, dy, xp.zeros((), self.dtype))
            b.diff = g


# ------------------------------------------------------------------ Silence
@register("Silence")
class SilenceLayer(Layer):
    """Consumes its bottoms so they are not reported as net outputs."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    samplewise = True
    min_bottom = 1
    exact_num_top = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff = self.xp.zeros(b.shape, self.dtype)


# ---------------------------------------------------------------- Reduction
@register("Reduction")
class ReductionLayer(Layer):
    """SUM, ASUM, SUMSQ or MEAN over all axes from ``axis`` on, times coeff;
    the top keeps the axes before ``axis`` (a scalar for axis 0)."""
    backward_reads_top_data = False
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._axis)

    def setup(self, bottom, top):
        self._op = self.param.reduction_param.operation
        if self._op not in (_REDUCTION.SUM, _REDUCTION.ASUM, _REDUCTION.SUMSQ, _REDUCTION.MEAN):
            raise self.error("unknown reduction operation %d", self._op)

    def reshape(self, bottom, top):
        b = bottom[0]
        axis = self._axis = _canonical_axis(self, b, self.param.reduction_param.axis) if b.num_axes else 0
        self._num = b.count_range(0, axis)
        self._dim = b.count_range(axis)
        coeff = self.param.reduction_param.coeff
        if self._op == _REDUCTION.MEAN:
            coeff /= self._dim
        self._coeff = self.dtype.type(coeff)
        top[0].reshape(b.shape[:axis])

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self._num, self._dim)
        if self._op == _REDUCTION.ASUM:
            x = self.xp.abs(x)
        elif self._op == _REDUCTION.SUMSQ:
            x = x * x
        y = x.sum(axis=1)
        if self._coeff != 1:
            y *= self._coeff
        top[0].data = y.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = self.xp
        scale = (top[0].diff.reshape(self._num, 1) * self._coeff)
        if self._op in (_REDUCTION.SUM, _REDUCTION.MEAN):
            g = xp.broadcast_to(scale, (self._num, self._dim)).astype(self.dtype)
        else:
            x = bottom[0].data.reshape(self._num, self._dim)
            if self._op == _REDUCTION.ASUM:
                g = xp.sign(x) * scale
            else:
                g = x * (2 * scale)
        bottom[0].diff = g.reshape(bottom[0].shape)


# ------------------------------------------------------------------- ArgMax
@register("ArgMax")
class ArgMaxLayer(Layer):
    """Indices (and with out_max_val, values) of the top_k largest entries,
    per image over all its values, or along ``axis``.  Ties put the larger
    index first, as Caffe's partial_sort over (value, index) pairs does."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    exact_num_bottom = 1
    exact_num_top = 1

    def share_scale(self, share, batch):
        return _share_scale_over(self._axis)

    def setup(self, bottom, top):
        p = self.param.argmax_param
        b = bottom[0]
        self._k = p.top_k
        if self._k < 1:
            raise self.error("top_k must be at least 1, got %d", self._k)
        self._axis = _canonical_axis(self, b, p.axis) if p.HasField("axis") else None

    def reshape(self, bottom, top):
        b = bottom[0]
        k = self._k
        if self._axis is not None:
            if k > b.shape[self._axis]:
                raise self.error("top_k %d exceeds axis %d of the bottom of shape %s", k, self._axis, b.shape)
            shape = list(b.shape)
            shape[self._axis] = k
        else:
            if k > b.count_range(1):
                raise self.error("top_k %d exceeds the %d values per item of the bottom of shape %s",
                                 k, b.count_range(1), b.shape)
            shape = [1] * max(b.num_axes, 3)
            shape[0] = b.shape[0]
            shape[2] = k
            if self.param.argmax_param.out_max_val:
                shape[1] = 2
        top[0].reshape(shape)

    def _top_k(self, x):
        """(indices, values) of the k largest along the last axis, ties
        broken towards the larger index (a reversed stable ascending sort)."""
        xp = self.xp
        # CuPy's argsort is always stable and takes no ``kind`` other than None.
        kw = {"kind": "stable"} if xp.__name__ == "numpy" else {}
        order = xp.argsort(x, axis=-1, **kw)[..., ::-1][..., :self._k]
        return order, xp.take_along_axis(x, order, axis=-1)

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        out_val = self.param.argmax_param.out_max_val
        if self._axis is not None:
            order, vals = self._top_k(xp.moveaxis(x, self._axis, -1))
            y = vals if out_val else order.astype(self.dtype)
            y = xp.ascontiguousarray(xp.moveaxis(y, -1, self._axis))
        else:
            order, vals = self._top_k(x.reshape(x.shape[0], -1))
            y = order.astype(self.dtype)
            if out_val:
                y = xp.stack([y, vals.astype(self.dtype)], axis=1)
        top[0].data = y.reshape(top[0].shape)


# ------------------------------------------------------------------- Filter
@register("Filter")
class FilterLayer(Layer):
    """Keeps the items (first-axis entries) whose selector value is nonzero:
    the last bottom is the selector (N, or N x 1 x ...), top i holds bottom
    i's selected items in order.  How many are kept depends on the data, so
    forward sets the tops' shapes (the first reshape, before any data, gives
    them all N items, as Caffe's).  Backward copies each kept item's diff
    back and zeros the others; the selector takes no gradient."""
    backward_reads_bottom_data = False     # memory planner (see Layer): the kept indices
    backward_reads_top_data = False
    backward_state = ("kept",)
    min_bottom = 2
    min_top = 1

    def setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise self.error("needs one top per filtered bottom: %d bottoms (the last is the "
                             "selector) need %d tops, got %d", len(bottom), len(bottom) - 1, len(top))
        self.selector_index = len(bottom) - 1
        self.kept = None
        self.shaped = False

    def allow_force_backward(self, bottom_index):
        return bottom_index != self.selector_index

    def reshape(self, bottom, top):
        selector = bottom[-1]
        if selector.num_axes == 0 or any(d != 1 for d in selector.shape[1:]):
            raise self.error("the selector (last bottom) must hold one value per item (shape N or "
                             "N x 1 x ...), got shape %s", selector.shape)
        n = selector.shape[0]
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes == 0 or b.shape[0] != n:
                raise self.error("bottom %d of shape %s does not have the selector's %d items",
                                 i, b.shape, n)
        if not self.shaped:
            for t, b in zip(top, bottom):
                t.reshape(b.shape)
            self.shaped = True

    def forward(self, bottom, top):
        self.kept = self.xp.nonzero(bottom[-1].data.reshape(-1))[0]
        for t, b in zip(top, bottom):
            t.reshape((self.kept.shape[0],) + b.shape[1:])
            t.data = b.data[self.kept]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise self.error("cannot backpropagate to the selector (last bottom)")
        for t, b, prop in zip(top, bottom, propagate_down):
            if prop:
                g = self.xp.zeros(b.shape, self.dtype)
                g[self.kept] = t.diff
                b.diff = g


# ------------------------------------------------------------- BatchReindex
@register("BatchReindex")
class BatchReindexLayer(Layer):
    """top item i = bottom 0's item idx[i], for the 1-D index bottom 1 (float
    values, truncated to integers as Caffe's cast, after Caffe's range check
    0 <= idx < N).  Backward sums the top's item diffs into the items they
    came from (repeated indices add up); the indices take no gradient."""
    backward_reads_top_data = False        # memory planner (see Layer): reads the indices
    exact_num_bottom = 2
    exact_num_top = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        if bottom[1].num_axes != 1:
            raise self.error("the indices (bottom 1) must be 1-D, got shape %s", bottom[1].shape)
        if bottom[0].num_axes == 0:
            raise self.error("bottom 0 must have an item axis, got a scalar")
        top[0].reshape(bottom[1].shape[:1] + bottom[0].shape[1:])

    def _indices(self, bottom, check=True):
        """The items bottom 1 names; with ``check`` (forward), whether they
        are in range is checked (Layer.check_values: on the GPU when the net
        reads its loss, the indices clipped meanwhile)."""
        xp = self.xp
        idx = bottom[1].data
        n = bottom[0].shape[0]
        if check:
            def refuse(host):
                bad = (host < 0) | (host >= n)
                if bad.any():
                    first = int(bad.argmax())
                    raise self.error("index %g (entry %d of bottom 1) is out of range for the %d items "
                                     "of bottom 0 (shape %s)", float(host[first]), first, n, bottom[0].shape)
            self.check_values(idx, refuse)
        items = idx.astype(xp.int64)
        return items if self.deferred_checks is None else xp.clip(items, 0, n - 1)

    def forward(self, bottom, top):
        top[0].data = bottom[0].data[self._indices(bottom)]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to the indices (bottom 1)")
        if not propagate_down[0]:
            return
        xp = self.xp
        idx = self._indices(bottom, check=False)
        n = bottom[0].shape[0]
        # scatter-add as one-hot^T @ dy: one code path for NumPy and CuPy,
        # summing repeated indices (the one-hot is only batch x batch)
        onehot = (idx[:, None] == xp.arange(n)[None, :]).astype(self.dtype)
        dy = top[0].diff.reshape(idx.shape[0], -1)
        bottom[0].diff = (onehot.T @ dy).reshape(bottom[0].shape)


# ---------------------------------------------------------------- Parameter
@register("Parameter")
class ParameterLayer(Layer):
    """No bottoms; the one top is the layer's learnable blob of
    ``parameter_param.shape`` (zeros until weights are loaded: Caffe leaves it
    unfilled).  The top's data is the parameter's array (Caffe's ShareData).
    Caffe shares the diff too; our blobs rebind their diffs, so backward adds
    the top's diff to the parameter's (the same gradient, accumulating as
    every parameter's does)."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    samplewise = True       # its top has no batch axis
    exact_num_bottom = 0
    exact_num_top = 1

    def setup(self, bottom, top):
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        if any(d < 0 for d in shape):
            raise self.error("parameter_param.shape %s has a negative dim", list(shape))
        if self.blobs:
            if len(self.blobs) != 1 or self.blobs[0].shape != shape:
                raise self.error("parameter shapes %s do not match parameter_param.shape %s",
                                 [b.shape for b in self.blobs], shape)
        else:
            self.blobs = [self.new_blob(shape)]

    def reshape(self, bottom, top):
        top[0].reshape(self.blobs[0].shape)

    def forward(self, bottom, top):
        top[0].data = self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff += top[0].diff
