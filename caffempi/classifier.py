"""pycaffe's ``caffe.Classifier``: a TEST-phase Net that classifies H x W x K
images by resizing them, taking 10 oversampled crops (or the centre crop)
and preprocessing them with a :class:`caffempi.io.Transformer`."""
import numpy as np

from .backend import to_numpy
from .common import TEST, CaffeError
from .io.image import Transformer, center_crop_box, oversample as oversample_crops, resize_image
from .net import Net

__all__ = ["Classifier", "input_transformer"]


def input_transformer(net, mean=None, input_scale=None, raw_scale=None, channel_swap=None):
    """A Transformer for ``net``'s first input taking H x W x K images
    (transpose (2, 0, 1)) with the given optional preprocessing settings."""
    if not net.inputs:
        raise CaffeError("net %s has no Input layer to feed images to" % (net.source_name or net.name))
    in_ = net.inputs[0]
    transformer = Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer


def predict_batch(net, transformer, images):
    """Preprocess H x W x K ``images`` into ``net``'s first input, run them
    (forward_all batches them) and return its first output as NumPy."""
    in_ = net.inputs[0]
    caffe_in = np.stack([transformer.preprocess(in_, im) for im in images])
    return to_numpy(net.forward_all(**{in_: caffe_in})[net.outputs[0]])


class Classifier(Net):
    """Net for image classification (pycaffe's caffe.Classifier).

    ``image_dims`` (H, W): the size images are resized to before cropping
    (default: the net's input size, i.e. a whole-image crop).  ``mean``,
    ``input_scale``, ``raw_scale``, ``channel_swap``: the Transformer
    settings of the first input.
    """

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None or len(image_dims) == 0 else image_dims
        if any(int(i) < int(c) for i, c in zip(self.image_dims, self.crop_dims)):
            raise CaffeError("Classifier: image_dims %s are smaller than the net's input %s"
                             % (tuple(int(d) for d in self.image_dims), tuple(self.crop_dims)))

    def predict(self, inputs, oversample=True):
        """N x C class scores (the first output) of N H x W x K ``inputs``.

        Each image is resized to ``image_dims``; with ``oversample`` the
        scores are the mean over its 10 crops (corners, centre and their
        mirrors, :func:`caffempi.io.oversample`), else those of the centre crop.
        """
        if len(inputs) == 0:
            raise CaffeError("Classifier.predict: no inputs")
        resized = np.stack([resize_image(im, self.image_dims) for im in inputs])
        if oversample:
            crops = oversample_crops(resized, self.crop_dims)
        else:
            top, left, bottom, right = center_crop_box(self.image_dims, self.crop_dims)
            crops = resized[:, top:bottom, left:right, :]
        predictions = predict_batch(self, self.transformer, crops)
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions
