"""pycaffe's ``caffe.io`` image helpers: load_image, resize_image, oversample
and the Transformer that turns H x W x K images into a net's K x H x W input.

NumPy on the host (as pycaffe); Pillow is imported only inside load_image, so
``import caffempi`` stays light.
"""
import numpy as np

from .blobproto import ConversionError

__all__ = ["Transformer", "load_image", "resize_image", "oversample", "center_crop_box"]

# skimage.color.rgb2gray's weights (ITU-R 709 luma), which pycaffe's
# load_image(color=False) applies to colour files.
_GRAY_WEIGHTS = np.array([0.2125, 0.7154, 0.0721])


def load_image(filename, color=True):
    """Image file -> float32 H x W x K array in [0, 1], as pycaffe's load_image.

    K is 3 (RGB) when ``color``, grey files repeated to 3 channels; with
    ``color`` False a grey file gives K=1 and a colour file its luma (K=1,
    skimage's rgb2gray weights).  Alpha channels are dropped.  8-bit files
    are divided by 255, 16-bit ones ("I;16"/"I" modes) by 65535.
    """
    from PIL import Image
    from ..data.datum import pil_to_chw      # on use: caffempi.data's __init__ imports caffempi.io
    try:
        with Image.open(filename) as img:
            img.load()
            if img.mode.startswith("I"):     # 16-bit grey: Pillow's 8-bit conversion would clip it
                im = np.asarray(img, np.float64)[:, :, None] / 65535.0
            else:
                im = pil_to_chw(img)[::-1].transpose(1, 2, 0) / 255.0    # BGR C x H x W -> RGB H x W x C
    except OSError as e:
        raise ConversionError("cannot load image %s: %s" % (filename, e)) from None
    if not color and im.shape[2] == 3:
        im = (im @ _GRAY_WEIGHTS)[:, :, None]
    elif color and im.shape[2] == 1:
        im = np.repeat(im, 3, axis=2)
    return im.astype(np.float32)


def _source_positions(n_in, n_out):
    """Source coordinates of ``n_out`` output pixel centres on an ``n_in`` axis
    (pixel i covers [i, i+1), as skimage's resize samples)."""
    return (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5


def _resize_axis(im, axis, n_out, interp_order):
    n_in = im.shape[axis]
    pos = _source_positions(n_in, n_out)
    if interp_order == 0:
        index = np.clip(np.floor(pos + 0.5).astype(np.intp), 0, n_in - 1)
        return np.take(im, index, axis=axis)
    low = np.floor(pos)
    weight = (pos - low).reshape((-1,) + (1,) * (im.ndim - axis - 1))
    low = low.astype(np.intp)
    below = np.take(im, np.clip(low, 0, n_in - 1), axis=axis)
    above = np.take(im, np.clip(low + 1, 0, n_in - 1), axis=axis)
    return below * (1.0 - weight) + above * weight


def resize_image(im, new_dims, interp_order=1):
    """H x W x K array -> float32 new_dims[0] x new_dims[1] x K array.

    ``interp_order`` 1 is bilinear, 0 nearest neighbour, at skimage's sample
    positions (pixel centres), so downscaling equals pycaffe's output with
    any K.  Samples past the border repeat the edge pixel where pycaffe's
    skimage call (mode='constant') blends in the image minimum, which
    darkens upscaled borders: the result stays within the input's range.
    """
    im = np.asarray(im)
    if im.ndim != 3:
        raise ConversionError("resize_image needs an H x W x K image, got shape %s" % (im.shape,))
    new_h, new_w = (int(d) for d in new_dims)
    if new_h < 1 or new_w < 1 or im.shape[0] < 1 or im.shape[1] < 1:
        raise ConversionError("resize_image: cannot resize a %s image to %d x %d"
                              % (im.shape, new_h, new_w))
    if interp_order not in (0, 1):
        raise ConversionError("resize_image: interp_order %s is not supported (0 nearest, 1 bilinear)"
                              % interp_order)
    out = im.astype(np.float64)
    out = _resize_axis(out, 0, new_h, interp_order)
    out = _resize_axis(out, 1, new_w, interp_order)
    return out.astype(np.float32)


def center_crop_box(image_dims, crop_dims):
    """(top, left, bottom, right) of the centred ``crop_dims`` window in an
    ``image_dims`` image, truncated to integers as pycaffe computes it."""
    center = np.asarray(image_dims[:2], np.float64) / 2.0
    half = np.asarray(crop_dims, np.float64) / 2.0
    return tuple(int(v) for v in np.concatenate([center - half, center + half]))


def oversample(images, crop_dims):
    """N images H x W x K -> float32 10N x h x w x K crops: per image the four
    corners (top-left, top-right, bottom-left, bottom-right), the centre, then
    the same five mirrored left-right (pycaffe's order)."""
    images = [np.asarray(im) for im in images]
    if not images:
        raise ConversionError("oversample: no images")
    shape = images[0].shape
    crop_h, crop_w = (int(d) for d in crop_dims)
    if len(shape) != 3 or crop_h > shape[0] or crop_w > shape[1] or any(im.shape != shape for im in images):
        raise ConversionError("oversample: need H x W x K images of one shape at least %d x %d, got %s"
                              % (crop_h, crop_w, sorted({im.shape for im in images})))
    boxes = [(top, left, top + crop_h, left + crop_w)
             for top in (0, shape[0] - crop_h) for left in (0, shape[1] - crop_w)]
    boxes.append(center_crop_box(shape, (crop_h, crop_w)))
    crops = np.empty((10 * len(images), crop_h, crop_w, shape[2]), np.float32)
    for i, im in enumerate(images):
        five = np.stack([im[t:b, l:r] for t, l, b, r in boxes])
        crops[10 * i:10 * i + 5] = five
        crops[10 * i + 5:10 * i + 10] = five[:, :, ::-1]
    return crops


class Transformer:
    """pycaffe's caffe.io.Transformer: per-input preprocessing of H' x W' x K
    images into K x H x W net inputs.

    ``inputs`` maps input blob names to their N x K x H x W shapes.  preprocess
    applies, in pycaffe's order: float32, resize to H x W, transpose, channel
    swap, raw scale, mean subtraction, input scale; deprocess inverts it.
    Unlike pycaffe, preprocess never writes into the caller's array.
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        for name, shape in self.inputs.items():
            if len(shape) != 4:
                raise ConversionError("Transformer: input '%s' has shape %s, not N x K x H x W" % (name, shape))
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise ConversionError("Transformer: '%s' is not one of the net inputs: %s"
                                  % (in_, sorted(self.inputs)))

    def preprocess(self, in_, data):
        """H' x W' x K image -> float32 K x H x W input for ``in_``."""
        self._check_input(in_)
        caffe_in = np.array(data, dtype=np.float32)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        if raw_scale is not None:
            caffe_in *= raw_scale
        if mean is not None:
            caffe_in -= mean
        if input_scale is not None:
            caffe_in *= input_scale
        return caffe_in

    def deprocess(self, in_, data):
        """K x H x W (or 1 x K x H x W) net input -> the image preprocess took
        (at the net's H x W).  Only a leading batch axis of 1 is dropped,
        where pycaffe squeezes every axis of size 1 and so fails on 1-channel inputs."""
        self._check_input(in_)
        decaf_in = np.array(data, dtype=np.float32)
        if decaf_in.ndim == 4 and decaf_in.shape[0] == 1:
            decaf_in = decaf_in[0]
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        """Axis order taking the image to K x H x W, e.g. (2, 0, 1) for H x W x K."""
        self._check_input(in_)
        if sorted(order) != list(range(len(self.inputs[in_]) - 1)):
            raise ConversionError("Transformer: transpose order %s for '%s' must permute the %d image axes"
                                  % (tuple(order), in_, len(self.inputs[in_]) - 1))
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """Channel order applied after transpose, e.g. (2, 1, 0) for RGB -> BGR."""
        self._check_input(in_)
        channels = self.inputs[in_][1]
        if sorted(order) != list(range(channels)):
            raise ConversionError("Transformer: channel swap %s for '%s' must permute its %d channels"
                                  % (tuple(order), in_, channels))
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """Factor applied before mean subtraction (255 for [0, 255] models on [0, 1] images)."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Mean subtracted after raw scaling: one value per channel (K,), or a
        K x H' x W' (H' x W' for K=1) mean, resized bilinearly to the input's
        H x W when its size differs (as pycaffe)."""
        self._check_input(in_)
        channels, height, width = self.inputs[in_][1:]
        mean = np.asarray(mean, np.float32)
        if mean.ndim == 1:
            if mean.shape[0] != channels:
                raise ConversionError("Transformer: mean of %d channels for '%s', which has %d"
                                      % (mean.shape[0], in_, channels))
            mean = mean[:, None, None]
        else:
            if mean.ndim == 2:
                mean = mean[None]
            if mean.ndim != 3 or mean.shape[0] != channels:
                raise ConversionError("Transformer: mean shape %s for '%s' is not K x H x W with K = %d"
                                      % (mean.shape, in_, channels))
            if mean.shape[1:] != (height, width):
                mean = resize_image(mean.transpose(1, 2, 0), (height, width)).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Factor applied last, after mean subtraction."""
        self._check_input(in_)
        self.input_scale[in_] = scale
