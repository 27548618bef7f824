"""classify: classify images with a Classifier and save the predictions as a
.npy array, N x C (pycaffe's python/classify.py).

    python tools/classify.py --model_def=deploy.prototxt --pretrained_model=net.caffemodel \\
        [--center_only] [--images_dim=256,256] [--mean_file=mean.npy] [--raw_scale=255] \\
        [--channel_swap=2,1,0] [--input_scale=S] [--ext=jpg] [--gpu] INPUT OUTPUT.npy

INPUT is an image file, a directory (its *.EXT files, in name order), or a
.npy array of N x H x W x K images.  There is no bundled model, so
--model_def and --pretrained_model have no defaults.
"""
import glob
import os
import time

import numpy as np

from ..backend import set_mode_cpu, set_mode_gpu
from ..classifier import Classifier
from ..common import CaffeError
from ..flags import FlagSet
from ..io.image import load_image
from ._util import info, run_tool


def _int_list(text, flag):
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise CaffeError("--%s must be integers separated by ',', got '%s'" % (flag, text)) from None


def _load_npy(path, what):
    try:
        return np.load(path)
    except (OSError, ValueError) as e:
        raise CaffeError("cannot read %s %s: %s" % (what, path, e)) from None


def load_inputs(input_file, ext):
    """H x W x K float images from an image file, a directory's *.ext files
    (sorted by name) or a .npy array."""
    input_file = os.path.expanduser(input_file)
    if input_file.endswith("npy"):
        info("Loading file: %s", input_file)
        return _load_npy(input_file, "input")
    if os.path.isdir(input_file):
        info("Loading folder: %s", input_file)
        files = sorted(glob.glob(os.path.join(glob.escape(input_file), "*." + ext)))
        if not files:
            raise CaffeError("no *.%s images in %s" % (ext, input_file))
        return [load_image(f) for f in files]
    info("Loading file: %s", input_file)
    return [load_image(input_file)]


FLAGS = FlagSet("classify", "Classify images with a Classifier and save the predictions (.npy).")
FLAGS.argument("input_file", "Input image, directory, or npy.")
FLAGS.argument("output_file", "Output npy filename.")
FLAGS.define("model_def", "", "Model definition file (deploy prototxt); required.")
FLAGS.define("pretrained_model", "", "Trained model weights file; required.")
FLAGS.define("gpu", False, "Switch for gpu computation.")
FLAGS.define("center_only", False, "Switch for prediction from center crop alone instead of averaging "
             "predictions across crops (default).")
FLAGS.define("images_dim", "256,256", "Canonical 'height,width' dimensions of input images.")
FLAGS.define("mean_file", "", "Data set image mean of [Channels x Height x Width] dimensions (numpy array). "
             "Set to '' for no mean subtraction.")
FLAGS.define("input_scale", None, "Multiply input features by this scale to finish preprocessing.", kind=float)
FLAGS.define("raw_scale", 255.0, "Multiply raw input by this scale before preprocessing.")
FLAGS.define("channel_swap", "2,1,0", "Order to permute input channels. The default converts RGB -> BGR "
             "since BGR is the Caffe default by way of OpenCV.")
FLAGS.define("ext", "jpg", "Image file extension to take as input when a directory is given as the input file.")


def _run(flags, input_file, output_file):
    for name in ("model_def", "pretrained_model"):
        if not getattr(flags, name):
            raise CaffeError("--%s is required (there is no bundled model)" % name)
    image_dims = _int_list(flags.images_dim, "images_dim")
    mean = _load_npy(flags.mean_file, "mean file") if flags.mean_file else None
    channel_swap = _int_list(flags.channel_swap, "channel_swap") if flags.channel_swap else None
    if flags.gpu:
        set_mode_gpu()
        info("GPU mode")
    else:
        set_mode_cpu()
        info("CPU mode")
    classifier = Classifier(flags.model_def, flags.pretrained_model, image_dims=image_dims, mean=mean,
                            input_scale=flags.input_scale, raw_scale=flags.raw_scale, channel_swap=channel_swap)
    inputs = load_inputs(input_file, flags.ext)
    info("Classifying %d inputs.", len(inputs))
    start = time.time()
    predictions = classifier.predict(inputs, not flags.center_only)
    info("Done in %.2f s.", time.time() - start)
    info("Saving results into %s", output_file)
    try:
        np.save(output_file, predictions)
    except OSError as e:
        raise CaffeError("cannot write %s: %s" % (output_file, e.strerror or e)) from None


def main(argv=None):
    return run_tool(FLAGS, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
