"""pycaffe's ``caffe.Detector``: windowed detection (R-CNN style) with a
TEST-phase Net, classifying given windows of images, each warped to the net's
input size, optionally with a border of surrounding context (``context_pad``).

pycaffe's ``detect_selective_search`` is not provided: it runs the external
MATLAB selective-search code, so windows must be given (``detect_windows``).
"""
import numpy as np

from .classifier import input_transformer, predict_batch
from .common import TEST, CaffeError
from .io.image import load_image, resize_image
from .net import Net

__all__ = ["Detector"]


class Detector(Net):
    """Net classifying image windows (pycaffe's caffe.Detector).

    ``mean``, ``input_scale``, ``raw_scale``, ``channel_swap``: the
    Transformer settings of the first input.  ``context_pad``: pixels of the
    net's input that show context around each window, as in R-CNN feature
    extraction (None or 0: the bare window).
    """

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """[{'window', 'prediction', 'filename'}] for every window of
        ``images_windows``, pairs (image file, windows (ymin, xmin, ymax, xmax))."""
        images_windows = [(fname, list(windows)) for fname, windows in images_windows]
        window_inputs = []
        for fname, windows in images_windows:
            image = load_image(fname)
            window_inputs.extend(self.crop(image, window) for window in windows)
        if not window_inputs:
            raise CaffeError("Detector.detect_windows: no windows")
        predictions = predict_batch(self, self.transformer, window_inputs)
        pairs = [(fname, window) for fname, windows in images_windows for window in windows]
        return [{"window": window, "prediction": prediction, "filename": fname}
                for (fname, window), prediction in zip(pairs, predictions)]

    def crop(self, im, window):
        """The H x W x K crop of image ``im`` for ``window`` (ymin, xmin, ymax,
        xmax; ymax/xmax exclusive without context, as pycaffe slices).

        With ``context_pad`` (pycaffe's geometry): the window, taken as
        inclusive, grows about its centre by crop / (crop - 2 context_pad) on
        each axis; the part inside the image is resized so that the grown box
        maps onto the net's input, and placed in a crop filled with the mean
        (in raw input space) where the box leaves the image.
        """
        window = np.asarray(window)
        if window.shape != (4,):
            raise CaffeError("Detector.crop: window must be (ymin, xmin, ymax, xmax), got %s" % (window,))
        top, left, bottom, right = (int(v) for v in window)
        if not self.context_pad:
            return im[top:bottom, left:right]
        crop_h, crop_w = (int(d) for d in self.crop_dims[:2])
        crop_size = np.array([crop_h, crop_w, crop_h, crop_w], np.float64)
        scale = crop_size / (crop_size - 2.0 * self.context_pad)
        half_h = (bottom - top + 1) / 2.0
        half_w = (right - left + 1) / 2.0
        center = np.array([top + half_h, left + half_w] * 2)
        box = np.round(center + scale * np.array([-half_h, -half_w, half_h, half_w]))
        scale_h = crop_h / (box[2] - box[0] + 1)
        scale_w = crop_w / (box[3] - box[1] + 1)
        pad_y = int(np.round(max(0.0, -box[0]) * scale_h))      # rows of the box above the image
        pad_x = int(np.round(max(0.0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0, [im_h, im_w, im_h, im_w]).astype(int)
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        out_h = min(int(np.round(clip_h * scale_h)), crop_h - pad_y)
        out_w = min(int(np.round(clip_w * scale_w)), crop_w - pad_x)
        context = im[box[0]:box[2], box[1]:box[3]]
        if context.shape[0] < 1 or context.shape[1] < 1 or out_h < 1 or out_w < 1:
            raise CaffeError("Detector.crop: window %s leaves no pixels of the %d x %d image"
                             % (tuple(window), im_h, im_w))
        crop = np.ones((crop_h, crop_w, im.shape[2]), np.float32) * self.crop_mean
        crop[pad_y:pad_y + out_h, pad_x:pad_x + out_w] = resize_image(context, (out_h, out_w))
        return crop

    def configure_crop(self, context_pad):
        """Set ``crop_dims`` (the input's H x W x K) and ``context_pad``; with
        context, ``crop_mean``: the Transformer's mean taken back to raw
        H x W x K input space (zeros without a mean), to fill the border."""
        in_ = self.inputs[0]
        inverse_transpose = np.argsort(self.transformer.transpose[in_])
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse_transpose]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, np.float32)
            return
        crop_mean = np.array(mean, np.float32).transpose(inverse_transpose)
        channel_swap = self.transformer.channel_swap.get(in_)
        if channel_swap is not None:
            crop_mean = crop_mean[:, :, np.argsort(channel_swap)]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean /= raw_scale
        self.crop_mean = crop_mean
