"""Layers that bring data into the net without reading files: Input and
DummyData.  (Data, ImageData, HDF5Data and MemoryData live in data.py.)"""
from ..filler import refill as refill_values
from .base import Layer, register


def blob_shape(shape_proto):
    return tuple(int(d) for d in shape_proto.dim)


@register("Input")
class InputLayer(Layer):
    """Tops whose values are set from outside (``net.blobs[name].data``)."""
    exact_num_bottom = 0
    min_top = 1

    def setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.error("input_param must give 0, 1 or %d shapes, got %d", len(top), len(shapes))
        for i, t in enumerate(top):
            if shapes:
                t.reshape(blob_shape(shapes[0] if len(shapes) == 1 else shapes[i]))

    def reshape(self, bottom, top):
        """Shapes are set in setup or by the caller; nothing to do."""

    def forward(self, bottom, top):
        """The values were written into the tops by the caller."""

    def backward(self, top, propagate_down, bottom):
        """No bottoms."""


@register("DummyData")
class DummyDataLayer(Layer):
    """Tops filled by fillers; constant fillers fill once (and again when
    the shape changes), random ones every forward (as Caffe's DummyDataLayer
    refills).  Under uneven batch shares, the tops whose first axis is the
    first top's (the batch) take this rank's count."""
    exact_num_bottom = 0
    min_top = 1
    samplewise = True

    def setup(self, bottom, top):
        p = self.param.dummy_data_param
        n = len(top)
        legacy = len(p.num) or len(p.channels) or len(p.height) or len(p.width)
        if legacy:
            if p.shape:
                raise self.error("give either shape or num/channels/height/width, not both")
            dims = [p.num, p.channels, p.height, p.width]
            if any(len(d) not in (1, n) for d in dims):
                raise self.error("num/channels/height/width must be given once or once per top")
            shapes = [tuple(int(d[0] if len(d) == 1 else d[i]) for d in dims) for i in range(n)]
        else:
            if len(p.shape) not in (1, n):
                raise self.error("dummy_data_param needs 1 or %d shapes, got %d", n, len(p.shape))
            shapes = [blob_shape(p.shape[0] if len(p.shape) == 1 else p.shape[i]) for i in range(n)]
        if len(p.data_filler) not in (0, 1, n):
            raise self.error("dummy_data_param needs 0, 1 or %d data_fillers, got %d", n, len(p.data_filler))
        self._fillers = []
        for i in range(n):
            if p.data_filler:
                f = p.data_filler[0] if len(p.data_filler) == 1 else p.data_filler[i]
            else:
                f = type(p).DESCRIPTOR.fields_by_name["data_filler"].message_type._concrete_class()
            self._fillers.append(f)
        self._shapes = shapes
        for t, shape, f in zip(top, shapes, self._fillers):
            t.reshape(shape)
            t.data = self.fill(f, shape).data
        self._refill = [f.type != "constant" for f in self._fillers]

    def share_batch(self):
        return self._shapes[0][0] if self._shapes[0] else None

    def _rank_shapes(self):
        batch = self.share_batch()
        return [(self.rank_batch(batch),) + shape[1:] if shape and shape[0] == batch else shape
                for shape in self._shapes]

    def reshape(self, bottom, top):
        for t, shape, f in zip(top, self._rank_shapes(), self._fillers):
            if t.shape != shape:
                t.reshape(shape)
                t.data = self.fill(f, shape).data

    def forward(self, bottom, top):
        for t, shape, f, refill in zip(top, self._rank_shapes(), self._fillers, self._refill):
            if refill:
                t.data = self.xp.asarray(refill_values(f, shape, self.dtype))

    def backward(self, top, propagate_down, bottom):
        """No bottoms."""
