"""WindowData (BVLC Caffe's R-CNN fine-tuning input): windows of images
listed in a window file, sampled per batch as foreground and background,
cropped with context padding, warped to crop_size x crop_size.

The window file is a sequence of image records, in Caffe's format::

    # image_index
    img_path
    channels
    height
    width
    num_windows
    class_index overlap x1 y1 x2 y2        (num_windows lines)

A window with overlap >= fg_threshold is foreground (its class_index must be
positive), one with overlap < bg_threshold background (label 0); others are
not used.  Coordinates are inclusive pixel indices.  The height and width
are read but, as in Caffe, the image's own size is what counts.
"""
import io
import math
import os
import time

import numpy as np

from ..common import CaffeError, rng
from ..data.datum import pil_to_chw
from ..data.transformer import load_mean_file
from .base import Layer, register

# columns of the window tables
_IMAGE, _LABEL, _X1, _Y1, _X2, _Y2, _LINE = range(7)


def read_window_file(path, fg_threshold, bg_threshold, root_folder=""):
    """Parse a window file: returns (images, foreground, background), images
    a list of (image path, channels, line), the window tables int64 arrays
    of rows (image index, label, x1, y1, x2, y2, line of the window);
    background windows get label 0.  Raises CaffeError naming the file and
    line of anything malformed."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CaffeError("cannot read window file %s: %s" % (path, e.strerror or e)) from None
    tokens = [(tok, n) for n, line in enumerate(lines, 1) for tok in line.split()]
    pos = 0

    def take(what, kind=str):
        nonlocal pos
        if pos >= len(tokens):
            raise CaffeError("window file %s ends early (line %d): expected %s"
                             % (path, len(lines), what))
        tok, line = tokens[pos]
        pos += 1
        try:
            return kind(tok), line
        except ValueError:
            raise CaffeError("window file %s line %d: expected %s, got '%s'"
                             % (path, line, what, tok)) from None

    images, fg, bg = [], [], []
    while pos < len(tokens):
        mark, line = take("'#'")
        if mark != "#":
            raise CaffeError("window file %s line %d: expected '#' to start an image record, got '%s'"
                             % (path, line, mark))
        index, line = take("an image index", int)
        if index != len(images):
            raise CaffeError("window file %s line %d: image index %d, expected %d (images are "
                             "numbered from 0 in file order)" % (path, line, index, len(images)))
        image_path, path_line = take("an image path")
        channels, line = take("the channel count", int)
        if channels not in (1, 3):
            raise CaffeError("window file %s line %d: %d channels; images are read as colour (3) "
                             "or grey (1)" % (path, line, channels))
        take("the image height", int)
        take("the image width", int)
        images.append((os.path.join(root_folder, image_path) if root_folder else image_path,
                       channels, path_line))
        count, line = take("the number of windows", int)
        for _ in range(count):
            label, line = take("a class index", int)
            overlap, _ = take("an overlap", float)
            x1, _ = take("x1", int)
            y1, _ = take("y1", int)
            x2, _ = take("x2", int)
            y2, _ = take("y2", int)
            if x2 < x1 or y2 < y1:
                raise CaffeError("window file %s line %d: window (%d, %d, %d, %d) has x2 < x1 or "
                                 "y2 < y1" % (path, line, x1, y1, x2, y2))
            row = [index, label, x1, y1, x2, y2, line]
            if overlap >= fg_threshold:
                if label <= 0:
                    raise CaffeError("window file %s line %d: foreground window (overlap %g) has "
                                     "class index %d; it must be positive (0 is background)"
                                     % (path, line, overlap, label))
                fg.append(row)
            elif overlap < bg_threshold:
                row[_LABEL] = 0
                bg.append(row)
    if not images:
        raise CaffeError("window file %s is empty" % path)
    if len({c for _, c, _ in images}) > 1:
        raise CaffeError("window file %s: images of %s channels; the top needs one channel count"
                         % (path, sorted({c for _, c, _ in images})))
    return images, np.asarray(fg, np.int64).reshape(-1, 7), np.asarray(bg, np.int64).reshape(-1, 7)


def _c_round(v):
    """C's round(): halves away from zero."""
    v = float(v)
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def window_geometry(window, image_hw, crop_size, context_pad, square, mirror, real=np.float32):
    """Caffe's crop of ``window`` (x1, y1, x2, y2, inclusive) from an image of
    ``image_hw``: the window, squared for crop_mode "square", is grown so that
    after warping to crop_size it has context_pad pixels of context on each
    side, then clipped to the image.  Returns ((x1, y1, x2, y2) of the
    clipped region, (height, width) it is warped to, (pad_h, pad_w) where it
    goes in the crop_size square; the rest is zero, the part beyond the
    image).  With mirroring the horizontal padding is mirrored too.  The
    arithmetic is in ``real`` (Caffe's Dtype), rounding as C's round()."""
    x1, y1, x2, y2 = window
    if not (context_pad > 0 or square):
        return (x1, y1, x2, y2), (crop_size, crop_size), (0, 0)
    h, w = image_hw
    context_scale = real(crop_size) / real(crop_size - 2 * context_pad)
    half_h, half_w = real((y2 - y1 + 1) / 2.0), real((x2 - x1 + 1) / 2.0)
    center_x, center_y = real(x1) + half_w, real(y1) + half_h
    if square:
        half_h = half_w = max(half_h, half_w)
    x1 = _c_round(center_x - half_w * context_scale)
    x2 = _c_round(center_x + half_w * context_scale)
    y1 = _c_round(center_y - half_h * context_scale)
    y2 = _c_round(center_y + half_h * context_scale)
    unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
    pad_x2, pad_y2 = max(0, x2 - w + 1), max(0, y2 - h + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    scale_x = real(crop_size) / real(unclipped_w)
    scale_y = real(crop_size) / real(unclipped_h)
    out_w = _c_round(real(x2 - x1 + 1) * scale_x)
    out_h = _c_round(real(y2 - y1 + 1) * scale_y)
    pad_h = _c_round(real(pad_y1) * scale_y)
    pad_w = _c_round(real(pad_x2 if mirror else pad_x1) * scale_x)
    # the rounded parts may overrun the square by a pixel
    out_h = min(out_h, crop_size - pad_h)
    out_w = min(out_w, crop_size - pad_w)
    return (x1, y1, x2, y2), (out_h, out_w), (pad_h, pad_w)


@register("WindowData")
class WindowDataLayer(Layer):
    """Tops data (batch_size x C x crop_size x crop_size) and label
    (batch_size): each batch holds batch_size - int(batch_size * fg_fraction)
    background windows, then the foreground ones, drawn uniformly with
    replacement from their lists (:func:`read_window_file`), each cropped as
    :func:`window_geometry`, warped with Pillow's bilinear resize (as our
    ImageData; OpenCV's differs slightly where a window is scaled), mirrored
    at random when ``mirror`` is set, then (pixel - mean) * scale, the mean
    being the central crop_size square of ``mean_file`` at the pixel's place
    or one ``mean_value`` per channel; context beyond the image stays 0.

    crop_size, mirror, mean_file and scale come from ``transform_param``
    where it sets them, else from the legacy ``window_data_param`` fields
    (Caffe reads scale from window_data_param only and the others from
    transform_param only).  Unlike Caffe, only the window lists a batch
    draws from must be non-empty, and the image's channel count in the
    window file (1 or 3) picks grey or colour (Caffe always reads colour).
    Draws come from the seed drawn at setup, the batch index and the rank, so
    :meth:`get_state` / :meth:`set_state` resume a run exactly; batches are
    read in forward (no prefetch thread)."""
    exact_num_bottom = 0
    exact_num_top = 2
    wait_seconds = 0.0

    def setup(self, bottom, top):
        wp = self.param.window_data_param
        self.source = wp.source
        self.batch_size = int(wp.batch_size)
        if self.batch_size <= 0:
            raise self.error("window_data_param.batch_size must be positive")
        self.crop_size = int(self._setting("crop_size"))
        if self.crop_size <= 0:
            raise self.error("crop_size must be set (in transform_param, or window_data_param)")
        self.context_pad = int(wp.context_pad)
        if self.crop_size <= 2 * self.context_pad:
            raise self.error("crop_size %d must exceed twice the context_pad %d",
                             self.crop_size, self.context_pad)
        if wp.crop_mode not in ("warp", "square"):
            raise self.error("crop_mode must be warp or square, got '%s'", wp.crop_mode)
        self.square = wp.crop_mode == "square"
        self.mirror = bool(self._setting("mirror"))
        self.scale = float(self._setting("scale"))
        try:
            self.images, self.fg, self.bg = read_window_file(
                wp.source, wp.fg_threshold, wp.bg_threshold, wp.root_folder)
        except CaffeError as e:
            raise self.error("%s", e) from None
        self.channels = self.images[0][1]
        self.num_fg = int(np.float32(self.batch_size) * np.float32(wp.fg_fraction))
        if not 0 <= self.num_fg <= self.batch_size:
            raise self.error("fg_fraction %g must lie in [0, 1]", wp.fg_fraction)
        for name, windows, needed in (("foreground", self.fg, self.num_fg),
                                      ("background", self.bg, self.batch_size - self.num_fg)):
            if needed and not len(windows):
                raise self.error("window file %s has no %s windows for the %d a batch takes "
                                 "(fg_threshold %g, bg_threshold %g)", wp.source, name, needed,
                                 wp.fg_threshold, wp.bg_threshold)
        self.mean = self._mean()
        self.cache = {} if wp.cache_images else None
        self._seed = int(rng().randint(0, 2 ** 31 - 1))
        self._batch = 0
        self.wait_seconds = 0.0

    def _setting(self, name):
        """``transform_param``'s field where set, else ``window_data_param``'s."""
        tp, wp = self.param.transform_param, self.param.window_data_param
        if tp.HasField(name) and wp.HasField(name) and getattr(tp, name) != getattr(wp, name):
            raise self.error("%s is %s in transform_param but %s in window_data_param",
                             name, getattr(tp, name), getattr(wp, name))
        return getattr(tp if tp.HasField(name) else wp, name)

    def _mean(self):
        """The mean of every pixel of the crop_size square (C x crop x crop),
        from mean_file or mean_value, or None."""
        mean_file = self._setting("mean_file")
        values = list(self.param.transform_param.mean_value)
        if mean_file and values:
            raise self.error("give either mean_file or mean_value, not both")
        if mean_file:
            try:
                mean = load_mean_file(mean_file)
            except CaffeError as e:
                raise self.error("%s", e) from None
            off = (mean.shape[2] - self.crop_size) // 2     # Caffe's offset, from the width
            square = mean[:, off:off + self.crop_size, off:off + self.crop_size]
            if mean.shape[0] != self.channels or off < 0 or square.shape[1:] != (self.crop_size,) * 2:
                raise self.error("mean file %s of shape %s has no central %dx%d square of %d "
                                 "channels", mean_file, mean.shape, self.crop_size, self.crop_size,
                                 self.channels)
            return square.astype(self.dtype)
        if values:
            if len(values) not in (1, self.channels):
                raise self.error("give 1 mean_value or one per channel (%d), got %d",
                                 self.channels, len(values))
            return np.broadcast_to(np.asarray(values, self.dtype).reshape(-1, 1, 1),
                                   (self.channels, self.crop_size, self.crop_size))
        return None

    def get_state(self):
        return {"batch": int(self._batch), "seed": int(self._seed)}

    def set_state(self, state):
        self._batch = int(state["batch"])
        self._seed = int(state.get("seed", self._seed))

    def reshape(self, bottom, top):
        top[0].reshape((self.batch_size, self.channels, self.crop_size, self.crop_size))
        top[1].reshape((self.batch_size,))

    def _image(self, index):
        """Image ``index`` of the window file as a PIL image (file bytes
        kept in memory with cache_images, as Caffe)."""
        from PIL import Image
        path, _, line = self.images[index]
        raw = self.cache.get(index) if self.cache is not None else None
        if raw is None:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError as e:
                raise self.error("%s line %d: cannot read image %s: %s", self.source, line, path,
                                 e.strerror or e) from None
            if self.cache is not None:
                self.cache[index] = raw
        try:
            img = Image.open(io.BytesIO(raw))
            img.load()
        except Exception as e:
            raise self.error("%s line %d: cannot decode image %s (%s)", self.source, line, path,
                             e) from None
        return img

    def _crop(self, img, window, mirror):
        """One window's C x crop x crop values, before the mean and scale,
        and the mask of the pixels it covers."""
        from PIL import Image
        (x1, y1, x2, y2), (out_h, out_w), (pad_h, pad_w) = window_geometry(
            window[_X1:_Y2 + 1], (img.height, img.width), self.crop_size, self.context_pad,
            self.square, mirror, self.dtype.type)
        if x1 < 0 or y1 < 0 or x2 >= img.width or y2 >= img.height or out_h <= 0 or out_w <= 0:
            raise self.error("%s line %d: window (%d, %d, %d, %d) does not fit in its %dx%d image",
                             self.source, window[_LINE], *window[_X1:_Y2 + 1], img.width, img.height)
        region = img.crop((x1, y1, x2 + 1, y2 + 1))
        if region.size != (out_w, out_h):
            region = region.convert("RGB" if self.channels == 3 else "L").resize(
                (out_w, out_h), Image.BILINEAR)
        pixels = pil_to_chw(region, self.channels == 3)
        if mirror:
            pixels = pixels[:, :, ::-1]
        return pixels, (slice(pad_h, pad_h + out_h), slice(pad_w, pad_w + out_w))

    def _load_batch(self, k):
        rank, _ = self.data_shard
        draws = np.random.RandomState([self._seed, k, rank])
        chosen = [pool[draws.randint(0, len(pool), n)] if n else pool[:0]
                  for pool, n in ((self.bg, self.batch_size - self.num_fg), (self.fg, self.num_fg))]
        windows = np.concatenate(chosen)
        mirrors = draws.randint(0, 2, self.batch_size).astype(bool) & self.mirror
        data = np.zeros((self.batch_size, self.channels, self.crop_size, self.crop_size), self.dtype)
        images = {}
        for item, (window, mirror) in enumerate(zip(windows, mirrors)):
            index = int(window[_IMAGE])
            if index not in images:
                images[index] = self._image(index)
            pixels, (rows, cols) = self._crop(images[index], window, mirror)
            values = pixels.astype(self.dtype)
            if self.mean is not None:
                values -= self.mean[:, rows, cols]
            data[item, :, rows, cols] = values * self.dtype.type(self.scale)
        return data, windows[:, _LABEL].astype(self.dtype)

    def forward(self, bottom, top):
        t0 = time.perf_counter()
        data, labels = self._load_batch(self._batch)
        self._batch += 1
        self.wait_seconds += time.perf_counter() - t0
        top[0].data = self.xp.asarray(data)
        top[1].data = self.xp.asarray(labels)

    def backward(self, top, propagate_down, bottom):
        """No bottoms."""
