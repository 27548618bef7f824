"""caffe.Classifier, caffe.Detector and tools/classify.py on a one-layer
linear net (InnerProduct with known weights), so every prediction is a
NumPy dot product of the preprocessed crops."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import caffempi as caffe
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]
RS = np.random.RandomState(0)

DEPLOY = """
name: "linear"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 3 dim: %d dim: %d } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
"""
MEAN = np.array([10.0, 20.0, 30.0])                 # per channel, in the net's (BGR) order


def linear_model(tmp_path, size):
    """(deploy prototxt, caffemodel, W, b) of the linear net on size x size inputs."""
    weights = RS.randn(2, 3 * size * size).astype(np.float32)
    bias = np.array([0.5, -1.0], np.float32)
    proto = tmp_path / ("deploy%d.prototxt" % size)
    proto.write_text(DEPLOY % (size, size))
    model = caffe_pb2.NetParameter(name="linear")
    layer = model.layer.add(name="ip", type="InnerProduct")
    layer.blobs.extend([caffe.io.array_to_blobproto(weights), caffe.io.array_to_blobproto(bias)])
    path = tmp_path / ("linear%d.caffemodel" % size)
    path.write_bytes(model.SerializeToString())
    return str(proto), str(path), weights.astype(np.float64), bias.astype(np.float64)


def scores(crop, weights, bias, raw_scale=255.0, input_scale=0.5):
    """The net's output for one H x W x 3 RGB crop: RGB -> BGR, scale, mean, scale, W x + b."""
    x = (crop.transpose(2, 0, 1)[[2, 1, 0]] * raw_scale - MEAN[:, None, None]) * input_scale
    return weights @ x.ravel() + bias


def test_classifier_oversample_and_center(tmp_path):
    proto, model, weights, bias = linear_model(tmp_path, 4)
    clf = caffe.Classifier(proto, model, image_dims=(6, 6), mean=MEAN, input_scale=0.5,
                           raw_scale=255.0, channel_swap=(2, 1, 0))
    images = [RS.rand(6, 6, 3).astype(np.float32) for _ in range(3)]
    # 10 crops of 4 x 4 in a 6 x 6 image: corners, centre (1:5), and their mirrors
    corners = [(0, 0), (0, 2), (2, 0), (2, 2), (1, 1)]
    expected = []
    for im in images:
        crops = [im[t:t + 4, l:l + 4] for t, l in corners]
        crops += [c[:, ::-1] for c in crops]
        expected.append(np.mean([scores(c, weights, bias) for c in crops], axis=0))
    predictions = clf.predict(images)
    assert predictions.shape == (3, 2)
    np.testing.assert_allclose(predictions, expected, rtol=1e-4, atol=1e-3)

    center = clf.predict(images, oversample=False)
    np.testing.assert_allclose(center, [scores(im[1:5, 1:5], weights, bias) for im in images],
                               rtol=1e-4, atol=1e-3)


def test_classifier_resizes_to_image_dims(tmp_path):
    proto, model, weights, bias = linear_model(tmp_path, 4)
    clf = caffe.Classifier(proto, model, mean=MEAN, input_scale=0.5, raw_scale=255.0, channel_swap=(2, 1, 0))
    assert tuple(clf.image_dims) == (4, 4)              # default: the net's input, a whole-image crop
    big = RS.rand(9, 7, 3).astype(np.float32)
    np.testing.assert_allclose(clf.predict([big], oversample=False)[0],
                               scores(caffe.io.resize_image(big, (4, 4)), weights, bias), rtol=1e-4, atol=1e-3)
    with pytest.raises(CaffeError, match=r"image_dims \(3, 3\) are smaller than the net's input"):
        caffe.Classifier(proto, model, image_dims=(3, 3))


def test_detector_crop_geometry(tmp_path):
    proto, model, weights, bias = linear_model(tmp_path, 8)
    image = RS.rand(16, 16, 3).astype(np.float32)
    plain = caffe.Detector(proto, model, mean=MEAN, raw_scale=255.0, channel_swap=(2, 1, 0))
    assert tuple(plain.crop_dims) == (8, 8, 3)
    np.testing.assert_array_equal(plain.crop(image, np.array([2, 3, 9, 12])), image[2:9, 3:12])

    det = caffe.Detector(proto, model, mean=MEAN, raw_scale=255.0, channel_swap=(2, 1, 0), context_pad=2)
    # context 2 of 8: the (inclusive) window grows x2 about its centre
    # window 4..7 -> box 2..10 (9 px onto 8): the image's rows/cols 2:10, unresized
    np.testing.assert_array_equal(det.crop(image, np.array([4, 4, 7, 7])), image[2:10, 2:10])
    # window 0..3 -> box -2..6: 2 rows/cols of mean padding, then image 0:6 at 2:8
    crop = det.crop(image, np.array([0, 0, 3, 3]))
    np.testing.assert_array_equal(crop[2:, 2:], image[:6, :6])
    raw_mean = (MEAN[[2, 1, 0]] / 255.0).astype(np.float32)       # the mean back in RGB [0, 1] input
    np.testing.assert_allclose(crop[:2].reshape(-1, 3), np.tile(raw_mean, (16, 1)), rtol=1e-6)
    np.testing.assert_allclose(crop[:, :2].reshape(-1, 3), np.tile(raw_mean, (16, 1)), rtol=1e-6)
    # so the padding preprocesses to zero
    np.testing.assert_allclose(det.transformer.preprocess("data", crop)[:, :2, :], 0.0, atol=1e-5)


def test_detect_windows(tmp_path):
    proto, model, weights, bias = linear_model(tmp_path, 8)
    pixels = RS.randint(0, 256, (16, 16, 3)).astype(np.uint8)
    path = str(tmp_path / "scene.png")
    Image.fromarray(pixels).save(path)
    image = pixels / 255.0
    det = caffe.Detector(proto, model, mean=MEAN, raw_scale=255.0, channel_swap=(2, 1, 0), input_scale=0.5)
    windows = [np.array([0, 0, 8, 8]), np.array([4, 6, 12, 14])]
    detections = det.detect_windows([(path, windows)])
    assert [d["filename"] for d in detections] == [path, path]
    assert [tuple(d["window"]) for d in detections] == [(0, 0, 8, 8), (4, 6, 12, 14)]
    for d in detections:
        t, l, b, r = d["window"]
        np.testing.assert_allclose(d["prediction"], scores(image[t:b, l:r], weights, bias), rtol=1e-4, atol=1e-3)


def test_classify_tool(tmp_path):
    proto, model, weights, bias = linear_model(tmp_path, 4)
    folder = tmp_path / "images"
    folder.mkdir()
    pixels = [RS.randint(0, 256, (6, 6, 3)).astype(np.uint8) for _ in range(2)]
    for name, p in zip(("a.png", "b.png"), pixels):
        Image.fromarray(p).save(folder / name)
    (folder / "skipped.jpg").write_bytes(b"")           # not the --ext
    mean = np.broadcast_to(MEAN[:, None, None], (3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "mean.npy", mean)
    out = tmp_path / "out.npy"
    run = subprocess.run([sys.executable, str(REPO / "tools" / "classify.py"), str(folder), str(out),
                          "--model_def", proto, "--pretrained_model", model, "--images_dim", "6,6",
                          "--mean_file", str(tmp_path / "mean.npy"), "--input_scale", "0.5",
                          "--ext", "png", "--center_only"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Classifying 2 inputs." in run.stderr
    expected = [scores(p[1:5, 1:5] / 255.0, weights, bias) for p in pixels]
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-4, atol=1e-3)

    missing = subprocess.run([sys.executable, str(REPO / "tools" / "classify.py"), str(folder / "none.png"),
                              str(out), "--model_def", proto, "--pretrained_model", model],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1].startswith("classify: error: cannot load image")
