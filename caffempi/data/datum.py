"""Caffe ``Datum`` records: encode NumPy images into Datums as BVLC's tools
write them, and decode Datums (raw bytes, float_data, or encoded JPEG/PNG
through Pillow) into C×H×W arrays.

Layout as in Caffe: ``data`` holds C×H×W uint8 bytes (channel-major), colour
images in OpenCV's BGR channel order; ``float_data`` holds C×H×W floats when
``data`` is empty; ``encoded`` Datums hold a whole image file in ``data``.
"""
import io

import numpy as np

from ..common import CaffeError
from ..proto import caffe_pb2


def array_to_datum(arr, label=0):
    """C×H×W (or H×W) array -> Datum.  uint8 arrays go to ``data`` as bytes
    (Caffe's CVMatToDatum); other dtypes go to ``float_data``."""
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise CaffeError("a Datum holds a C x H x W image, got shape %s" % (arr.shape,))
    d = caffe_pb2.Datum()
    d.channels, d.height, d.width = (int(s) for s in arr.shape)
    if arr.dtype == np.uint8:
        d.data = np.ascontiguousarray(arr).tobytes()
    else:
        d.float_data.extend(np.asarray(arr, np.float32).ravel().tolist())
    d.label = int(label)
    return d


def encoded_datum(image_bytes, label=0):
    """A Datum holding an encoded image file (Caffe's ReadFileToDatum)."""
    d = caffe_pb2.Datum()
    d.data = bytes(image_bytes)
    d.label = int(label)
    d.encoded = True
    return d


def parse_datum(value, where=""):
    """bytes -> Datum; a record that does not parse raises CaffeError naming ``where``."""
    d = caffe_pb2.Datum()
    try:
        d.ParseFromString(bytes(value))
    except Exception as e:  # google.protobuf.message.DecodeError
        raise CaffeError("%s: record is not a valid Caffe Datum (%s)" % (where, e)) from None
    return d


def raw_datum_batch(values):
    """(N×C×H×W uint8 images, N float32 labels) of N serialized raw Datums
    (uint8 ``data``, not encoded) of one shape, decoded in one pass: one
    parse per record and a single copy of all pixels.  None when any record
    is not such a Datum; the caller then decodes record by record, which
    handles the other kinds and names a bad record."""
    try:
        first = caffe_pb2.Datum.FromString(values[0]) if values else None
        if first is None or first.encoded or not first.data:
            return None        # (encoded or float data sets: one parse spent, not a batch's)
        datums = [first] + [caffe_pb2.Datum.FromString(v) for v in values[1:]]
    except Exception:        # google.protobuf.message.DecodeError, or not bytes
        return None
    shape = (first.channels, first.height, first.width)
    size = shape[0] * shape[1] * shape[2]
    if not size or any(d.encoded or len(d.data) != size or (d.channels, d.height, d.width) != shape
                       for d in datums):
        return None
    images = np.frombuffer(b"".join([d.data for d in datums]), np.uint8).reshape((len(datums),) + shape)
    return images, np.fromiter((d.label for d in datums), np.float32, len(datums))


def pil_to_chw(img, color=None):
    """PIL image -> C×H×W uint8 in OpenCV's channel order.

    ``color`` None keeps the image's own kind (1 channel for grey, 3 for colour,
    as cv::IMREAD_ANYCOLOR); True forces 3-channel BGR, False forces grey."""
    if color is None:
        if img.mode == "P":
            color = _palette_is_color(img)
        else:
            color = img.mode not in ("L", "1", "I", "I;16", "F", "LA")
    if color:
        a = np.asarray(img.convert("RGB"), np.uint8)[:, :, ::-1]    # RGB -> BGR
        return np.ascontiguousarray(a.transpose(2, 0, 1))
    a = np.asarray(img.convert("L"), np.uint8)
    return np.ascontiguousarray(a[None])


def _palette_is_color(img):
    rgb = np.asarray(img.convert("RGB"))
    return not (np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2]))


def decode_image(data, color=None, where=""):
    """Encoded image bytes (JPEG, PNG, ...) -> C×H×W uint8 (BGR for colour)."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return pil_to_chw(img, color)
    except CaffeError:
        raise
    except Exception as e:
        raise CaffeError("%s: cannot decode encoded image (%s)" % (where, e)) from None


def encode_image(chw, fmt="png"):
    """C×H×W uint8 (BGR) -> encoded image bytes (cv::imencode)."""
    from PIL import Image
    chw = np.asarray(chw, np.uint8)
    if chw.shape[0] == 1:
        img = Image.fromarray(chw[0], "L")
    else:
        img = Image.fromarray(np.ascontiguousarray(chw[::-1].transpose(1, 2, 0)), "RGB")
    buf = io.BytesIO()
    fmt = fmt.lower()
    img.save(buf, format={"jpg": "JPEG", "jpeg": "JPEG"}.get(fmt, fmt.upper()))
    return buf.getvalue()


def datum_to_array(datum, force_color=False, force_gray=False, where=""):
    """Datum -> C×H×W array: uint8 for ``data`` (raw or encoded), float32 for
    ``float_data``.  force_color/force_gray apply to encoded Datums, as in
    Caffe's DataTransformer."""
    if datum.encoded:
        if force_color and force_gray:
            raise CaffeError("force_color and force_gray cannot both be set")
        color = True if force_color else (False if force_gray else None)
        return decode_image(datum.data, color, where)
    c, h, w = datum.channels, datum.height, datum.width
    n = c * h * w
    if datum.data:
        if len(datum.data) != n:
            raise CaffeError("%s: Datum has %d data bytes but channels x height x width = %d x %d x %d"
                             % (where, len(datum.data), c, h, w))
        return np.frombuffer(datum.data, np.uint8).reshape(c, h, w)
    if len(datum.float_data) != n or n == 0:
        raise CaffeError("%s: Datum has %d float_data values but channels x height x width = %d x %d x %d"
                         % (where, len(datum.float_data), c, h, w))
    return np.asarray(datum.float_data, np.float32).reshape(c, h, w)
