"""DataTransformer: Caffe's per-image preprocessing (BVLC data_transformer.cpp).

For every image, in Caffe's order: crop (random offsets in TRAIN, centred in
TEST), mirror (random when ``mirror`` is set; Caffe draws it in TEST too), subtract the mean
(``mean_file`` at the uncropped position, or one ``mean_value`` per channel),
multiply by ``scale``:  out = (x[crop] - mean[crop]) * scale, mirrored.
All arithmetic is float32, as Caffe's Dtype=float.

Random draws never depend on thread timing: the draws for global batch ``k``
come from ``np.random.RandomState([seed, k])`` (one draw per record of the
*global* batch of R·b records), and rank r takes the draws of its records'
places in it (``reader.shard_columns``).  So R ranks × batch b transform every record exactly as one process
with batch R·b does, and a reader restarted at batch k repeats itself bitwise.
"""
import numpy as np

from ..common import CaffeError, TRAIN
from ..io import proto_io


def load_mean_file(path):
    """A .binaryproto mean (BlobProto, num 1) -> C×H×W float32."""
    try:
        bp = proto_io.read_binary_proto(path, _blob_proto_cls())
        arr = np.asarray(proto_io.blob_proto_to_array(bp), np.float32)
    except Exception as e:  # ProtoError, a blob's bad values (CaffeError) and friends
        if isinstance(e, CaffeError) and str(path) in str(e):
            raise
        raise CaffeError("mean file %s: %s" % (path, e)) from None
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise CaffeError("mean file %s: expected num 1, got shape %s" % (path, arr.shape))
        arr = arr[0]
    if arr.ndim != 3:
        raise CaffeError("mean file %s: expected a 1 x C x H x W blob, got shape %s" % (path, arr.shape))
    return arr


def _blob_proto_cls():
    from ..proto import caffe_pb2
    return caffe_pb2.BlobProto


def mean_to_blob_proto(mean):
    """C×H×W mean -> BlobProto with Caffe's legacy num/channels/height/width
    (as compute_image_mean writes it)."""
    from ..proto import caffe_pb2
    mean = np.asarray(mean, np.float32)
    bp = caffe_pb2.BlobProto()
    bp.num = 1
    bp.channels, bp.height, bp.width = (int(s) for s in mean.shape)
    bp.data.extend(mean.ravel().tolist())
    return bp


class DataTransformer:
    def __init__(self, param, phase=TRAIN, where=""):
        """``param`` is a caffe_pb2.TransformationParameter; ``where`` prefixes errors."""
        self.where = where
        self.phase = phase
        # batch allocation: GPU nets swap in pinned host memory
        self.empty = np.empty
        self.scale = np.float32(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        self.force_color = bool(param.force_color)
        self.force_gray = bool(param.force_gray)
        if self.force_color and self.force_gray:
            raise CaffeError("%sforce_color and force_gray cannot both be set" % where)
        if param.mean_file and len(param.mean_value):
            raise CaffeError("%scannot specify mean_file and mean_value at the same time" % where)
        self.mean_file = param.mean_file or None
        self.mean = load_mean_file(param.mean_file) if param.mean_file else None
        self.mean_values = np.asarray(list(param.mean_value), np.float32) if len(param.mean_value) else None
        self._checked = {}     # input shape -> (output shape, per-channel means)
        # random crop offsets and mirror flips are drawn per batch (draws)
        self.needs_draws = self.mirror or (phase == TRAIN and self.crop_size > 0)

    # ------------------------------------------------------------ shapes
    def output_shape(self, in_shape):
        """Check the mean and crop against an input C×H×W shape; return the
        transformed C×H×W (Caffe's InferBlobShape)."""
        return self._prepare(in_shape)[0]

    def _prepare(self, in_shape):
        key = tuple(int(s) for s in in_shape)
        hit = self._checked.get(key)
        if hit is not None:
            return hit
        if len(key) != 3:
            raise CaffeError("%sexpected a C x H x W image, got shape %s" % (self.where, key))
        c, h, w = key
        if self.crop_size and (self.crop_size > h or self.crop_size > w):
            raise CaffeError("%scrop_size %d is larger than the image (%d x %d)"
                             % (self.where, self.crop_size, h, w))
        if self.mean is not None and tuple(self.mean.shape) != key:
            raise CaffeError("%smean file %s has shape %s but the data is %d x %d x %d"
                             % (self.where, self.mean_file, " x ".join(map(str, self.mean.shape)), c, h, w))
        mv = None
        if self.mean_values is not None:
            if len(self.mean_values) == 1 and c > 1:
                mv = np.repeat(self.mean_values, c)
            elif len(self.mean_values) != c:
                raise CaffeError("%s%d mean_value(s) given for %d channels (give 1 or %d)"
                                 % (self.where, len(self.mean_values), c, c))
            else:
                mv = self.mean_values
        out = (c, self.crop_size, self.crop_size) if self.crop_size else key
        self._checked[key] = (out, mv)
        return out, mv

    # ------------------------------------------------------------ random
    @staticmethod
    def draws(seed, batch_index, global_batch, columns=slice(None)):
        """Random words for one batch: (crop_h, crop_w, mirror) uint32 arrays
        for the records at places ``columns`` (a slice) of global batch
        ``batch_index``."""
        rs = np.random.RandomState([int(seed) & 0xFFFFFFFF, int(batch_index) & 0xFFFFFFFF,
                                    (int(batch_index) >> 32) & 0xFFFFFFFF])
        r = rs.randint(0, 2 ** 31, size=(3, global_batch)).astype(np.int64)
        return r[:, columns]

    # ------------------------------------------------------------ transform
    def transform(self, images, rand=None):
        """Transform a list (or N-stack) of C×H×W images (uint8 or float) into
        an N×C×h×w float32 batch.  ``rand`` = (3, N) random words from
        :meth:`draws` (needed in TRAIN when cropping or mirroring)."""
        n = len(images)
        if n == 0:
            raise CaffeError("%sempty batch" % self.where)
        shape = tuple(np.shape(images[0]))
        oc, mv = self._prepare(shape)
        for i in range(1, n):
            if tuple(np.shape(images[i])) != shape:
                raise CaffeError("%simage %d of the batch is %s but image 0 is %s (images of one batch "
                                 "must have one size)" % (self.where, i, " x ".join(map(str, np.shape(images[i]))),
                                                          " x ".join(map(str, shape))))
        c, h, w = shape
        x = images if isinstance(images, np.ndarray) else np.stack(images)
        train = self.phase == TRAIN
        cs = self.crop_size
        if (self.mirror or (train and cs)) and rand is None:
            raise CaffeError("%srandom crop/mirror needs the batch's random draws" % self.where)
        if cs:
            if train:
                hoff = rand[0] % (h - cs + 1)
                woff = rand[1] % (w - cs + 1)
            else:
                hoff = np.full(n, (h - cs) // 2)
                woff = np.full(n, (w - cs) // 2)
        out = self.empty((n,) + oc, np.float32)
        if not cs:
            out[...] = x
            if self.mean is not None:
                out -= self.mean[None]
        for i in range(n if cs else 0):
            if cs:
                ho, wo = int(hoff[i]), int(woff[i])
                xi = x[i, :, ho:ho + cs, wo:wo + cs]
                mi = self.mean[:, ho:ho + cs, wo:wo + cs] if self.mean is not None else None
            else:
                xi, mi = x[i], self.mean
            if mi is not None:
                np.subtract(xi, mi, out=out[i], dtype=np.float32, casting="unsafe")
            else:
                out[i] = xi
        if mv is not None:
            out -= mv[None, :, None, None]
        if self.scale != 1:
            out *= self.scale
        if self.mirror:
            flip = (rand[2] & 1).astype(bool)
            if flip.any():
                out[flip] = out[flip][..., ::-1]
        return out
