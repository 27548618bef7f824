"""pycaffe's caffe.io: Transformer against a NumPy reference of each setting,
load_image on Pillow-written PNGs, resize_image and oversample geometry, and
the BlobProto / BlobProtoVector / Datum conversions."""
import io

import numpy as np
import pytest
from PIL import Image

import caffempi as caffe
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2

RS = np.random.RandomState(0)


# ------------------------------------------------------------------ Transformer

def transformer(shape=(2, 3, 4, 5)):
    return caffe.io.Transformer({"data": shape})


def test_transformer_full_pipeline_and_round_trip():
    t = transformer()
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255.0)
    mean = np.array([10.0, 20.0, 30.0], np.float32)
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.5)
    im = RS.rand(4, 5, 3).astype(np.float32)
    out = t.preprocess("data", im)
    # pycaffe's order: transpose, channel swap, raw scale, minus mean, input scale
    expected = (im.transpose(2, 0, 1)[[2, 1, 0]] * 255.0 - mean[:, None, None]) * 0.5
    assert out.dtype == np.float32 and out.shape == (3, 4, 5)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", out), im, atol=1e-6)
    np.testing.assert_allclose(t.deprocess("data", out[None]), im, atol=1e-6)   # 1 x K x H x W


@pytest.mark.parametrize("setting, value, reference", [
    ("set_raw_scale", 255.0, lambda im: im * 255.0),
    ("set_input_scale", 0.25, lambda im: im * 0.25),
    ("set_mean", np.array([0.1, 0.2, 0.3]), lambda im: im - np.array([0.1, 0.2, 0.3])[:, None, None]),
    ("set_channel_swap", (1, 2, 0), lambda im: im[[1, 2, 0]]),
])
def test_transformer_each_setting(setting, value, reference):
    t = transformer()
    t.set_transpose("data", (2, 0, 1))
    getattr(t, setting)("data", value)
    im = RS.rand(4, 5, 3).astype(np.float32)
    np.testing.assert_allclose(t.preprocess("data", im), reference(im.transpose(2, 0, 1)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(t.deprocess("data", t.preprocess("data", im)), im, atol=1e-6)


def test_transformer_transpose_and_resize():
    t = transformer()
    t.set_transpose("data", (2, 0, 1))
    im = RS.rand(8, 10, 3).astype(np.float32)
    out = t.preprocess("data", im)
    assert out.shape == (3, 4, 5)
    np.testing.assert_array_equal(out, caffe.io.resize_image(im, (4, 5)).transpose(2, 0, 1))


def test_preprocess_leaves_the_callers_array_alone():
    t = transformer()
    t.set_raw_scale("data", 255.0)
    im = RS.rand(3, 4, 5).astype(np.float32)
    before = im.copy()
    t.preprocess("data", im)
    np.testing.assert_array_equal(im, before)


def test_set_mean_resizes_a_mean_of_another_size():
    t = transformer()
    mean = RS.rand(3, 8, 10).astype(np.float32)
    t.set_mean("data", mean)
    expected = caffe.io.resize_image(mean.transpose(1, 2, 0), (4, 5)).transpose(2, 0, 1)
    np.testing.assert_array_equal(t.mean["data"], expected)
    t.set_mean("data", np.full((3, 2, 2), 7.0))         # constant: pycaffe's normalisation divides by 0
    np.testing.assert_array_equal(t.mean["data"], np.full((3, 4, 5), 7.0, np.float32))
    gray = transformer((1, 1, 4, 5))
    gray.set_mean("data", np.ones((4, 5)))              # H x W for one channel
    assert gray.mean["data"].shape == (1, 4, 5)


def test_transformer_errors():
    t = transformer()
    with pytest.raises(CaffeError, match="'label' is not one of the net inputs"):
        t.set_raw_scale("label", 2.0)
    with pytest.raises(ValueError, match="mean of 2 channels for 'data', which has 3"):
        t.set_mean("data", np.zeros(2))
    with pytest.raises(CaffeError, match=r"mean shape \(2, 4, 5\)"):
        t.set_mean("data", np.zeros((2, 4, 5)))
    with pytest.raises(CaffeError, match="transpose order"):
        t.set_transpose("data", (0, 1))
    with pytest.raises(CaffeError, match="channel swap"):
        t.set_channel_swap("data", (0, 1, 1))
    with pytest.raises(CaffeError, match=r"input 'label' has shape \(4, 10\), not N x K x H x W"):
        caffe.io.Transformer({"label": (4, 10)})


# ------------------------------------------------------------------ load_image

def save_png(path, array, mode=None):
    Image.fromarray(array, mode).save(path) if mode else Image.fromarray(array).save(path)
    return str(path)


def test_load_image_color_gray_rgba(tmp_path):
    rgb = RS.randint(0, 256, (5, 7, 3)).astype(np.uint8)
    gray = RS.randint(0, 256, (5, 7)).astype(np.uint8)
    rgba = RS.randint(0, 256, (5, 7, 4)).astype(np.uint8)
    f_rgb, f_gray, f_rgba = (save_png(tmp_path / n, a) for n, a in
                             (("rgb.png", rgb), ("gray.png", gray), ("rgba.png", rgba)))

    im = caffe.io.load_image(f_rgb)
    assert im.dtype == np.float32 and im.shape == (5, 7, 3)
    np.testing.assert_array_equal(im, (rgb / 255.0).astype(np.float32))
    assert 0.0 <= im.min() and im.max() <= 1.0

    im = caffe.io.load_image(f_gray)                    # grey repeated to 3 channels
    np.testing.assert_array_equal(im, np.repeat((gray / 255.0).astype(np.float32)[:, :, None], 3, 2))
    im = caffe.io.load_image(f_gray, color=False)
    np.testing.assert_array_equal(im, (gray / 255.0).astype(np.float32)[:, :, None])

    im = caffe.io.load_image(f_rgba)                    # alpha dropped
    np.testing.assert_array_equal(im, (rgba[:, :, :3] / 255.0).astype(np.float32))

    im = caffe.io.load_image(f_rgb, color=False)        # skimage's rgb2gray luma
    luma = (rgb / 255.0) @ np.array([0.2125, 0.7154, 0.0721])
    assert im.shape == (5, 7, 1)
    np.testing.assert_allclose(im[:, :, 0], luma, rtol=1e-6)


def test_load_image_16_bit(tmp_path):
    values = np.array([[0, 1000], [40000, 65535]], np.uint16)
    path = str(tmp_path / "deep.png")
    Image.fromarray(values).save(path)
    im = caffe.io.load_image(path, color=False)
    np.testing.assert_allclose(im[:, :, 0], values / 65535.0, rtol=1e-6)


def test_load_image_missing_file(tmp_path):
    with pytest.raises(CaffeError, match="cannot load image .*nothing.png"):
        caffe.io.load_image(str(tmp_path / "nothing.png"))


# ------------------------------------------------------------------ resize_image

def bilinear_reference(im, new_h, new_w):
    """Pixel-by-pixel bilinear at pixel centres, border pixels repeated."""
    h, w, k = im.shape
    out = np.zeros((new_h, new_w, k))
    for i in range(new_h):
        y = min(max((i + 0.5) * h / new_h - 0.5, 0.0), h - 1.0)
        for j in range(new_w):
            x = min(max((j + 0.5) * w / new_w - 0.5, 0.0), w - 1.0)
            y0, x0 = int(np.floor(y)), int(np.floor(x))
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            fy, fx = y - y0, x - x0
            out[i, j] = ((1 - fy) * (1 - fx) * im[y0, x0] + (1 - fy) * fx * im[y0, x1]
                         + fy * (1 - fx) * im[y1, x0] + fy * fx * im[y1, x1])
    return out


def test_resize_constant_and_ramp_exact():
    const = np.full((4, 6, 3), 0.3, np.float32)
    for dims in ((8, 12), (2, 3), (5, 7)):
        out = caffe.io.resize_image(const, dims)
        assert out.dtype == np.float32 and out.shape == dims + (3,)
        np.testing.assert_array_equal(out, const[0, 0, 0])
    ramp = np.arange(8, dtype=np.float32)[None, :, None] * np.ones((2, 1, 5), np.float32)   # 2 x 8 x 5
    down = caffe.io.resize_image(ramp, (2, 4))          # x2 down: the mean of each pair
    np.testing.assert_array_equal(down[0, :, 0], [0.5, 2.5, 4.5, 6.5])
    up = caffe.io.resize_image(ramp, (2, 16))           # x2 up: x/2 - 1/4, edges repeated
    np.testing.assert_array_equal(up[0, :, 0], np.clip(np.arange(16) / 2.0 - 0.25, 0, 7))
    assert ramp.min() <= up.min() and up.max() <= ramp.max()
    np.testing.assert_array_equal(caffe.io.resize_image(ramp, (2, 8)), ramp)   # same size: unchanged


def test_resize_matches_reference_at_odd_factors():
    im = RS.rand(5, 7, 2)
    for dims in ((3, 4), (9, 11), (5, 3)):
        np.testing.assert_allclose(caffe.io.resize_image(im, dims), bilinear_reference(im, *dims), rtol=1e-5)


def test_resize_nearest_and_errors():
    im = np.arange(8, dtype=np.float32).reshape(1, 8, 1)
    np.testing.assert_array_equal(caffe.io.resize_image(im, (1, 4), interp_order=0)[0, :, 0], [1, 3, 5, 7])
    with pytest.raises(CaffeError, match="H x W x K"):
        caffe.io.resize_image(np.zeros((4, 4)), (2, 2))
    with pytest.raises(CaffeError, match="interp_order 3"):
        caffe.io.resize_image(im, (2, 2), interp_order=3)


# ------------------------------------------------------------------ oversample

def test_oversample_crop_positions():
    a = np.arange(6 * 7 * 2, dtype=np.float32).reshape(6, 7, 2)
    b = -a
    crops = caffe.io.oversample([a, b], (3, 4))
    assert crops.shape == (20, 3, 4, 2) and crops.dtype == np.float32
    # corners TL, TR, BL, BR, then the centre: rows 6/2 -+ 1.5 -> 1:4, cols 7/2 -+ 2 -> 1:5
    boxes = [(0, 0), (0, 3), (3, 0), (3, 3), (1, 1)]
    for n, im in enumerate((a, b)):
        for i, (top, left) in enumerate(boxes):
            window = im[top:top + 3, left:left + 4]
            np.testing.assert_array_equal(crops[10 * n + i], window)
            np.testing.assert_array_equal(crops[10 * n + 5 + i], window[:, ::-1])
    with pytest.raises(CaffeError, match="at least 7 x 4"):
        caffe.io.oversample([a], (7, 4))


# ------------------------------------------------------------------ BlobProto / Datum

def test_blobproto_round_trip_and_shape():
    arr = RS.randn(2, 3, 4).astype(np.float32)
    diff = RS.randn(2, 3, 4).astype(np.float32)
    blob = caffe.io.array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4] and not blob.HasField("num")
    back = caffe.io.blobproto_to_array(blob)
    assert back.dtype == np.float64 and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, arr)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob, return_diff=True), diff)


def test_blobproto_legacy_dims_scalar_and_bad_count():
    blob = caffe_pb2.BlobProto()
    blob.data.extend(np.arange(100.0))
    blob.num, blob.channels, blob.height, blob.width = 1, 1, 10, 10
    arr = caffe.io.blobproto_to_array(blob)
    assert arr.shape == (1, 1, 10, 10) and arr[0, 0, 3, 4] == 34.0

    blob = caffe_pb2.BlobProto()
    blob.data.append(123.0)
    assert caffe.io.blobproto_to_array(blob).shape == () and caffe.io.blobproto_to_array(blob) == 123.0

    blob.data.append(4.0)                                # two values and no shape
    with pytest.raises(ValueError, match="2 values but shape"):
        caffe.io.blobproto_to_array(blob)


def test_blobprotovector_string_round_trip():
    arrays = [RS.randn(2, 3).astype(np.float32), np.arange(5, dtype=np.float32), np.ones((1, 2, 2, 1))]
    serialized = caffe.io.arraylist_to_blobprotovector_str(arrays)
    vec = caffe_pb2.BlobProtoVector.FromString(serialized)
    assert len(vec.blobs) == 3
    back = caffe.io.blobprotovector_str_to_arraylist(serialized)
    assert [b.shape for b in back] == [a.shape for a in arrays]
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(CaffeError, match="not a serialized BlobProtoVector"):
        caffe.io.blobprotovector_str_to_arraylist(b"\xff\xff\xff")


def test_datum_round_trips():
    pixels = RS.randint(0, 256, (3, 4, 5)).astype(np.uint8)
    datum = caffe.io.array_to_datum(pixels, label=7)
    assert datum.data == pixels.tobytes() and len(datum.float_data) == 0 and datum.label == 7
    back = caffe.io.datum_to_array(datum)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, pixels)

    values = RS.randn(2, 3, 4)
    datum = caffe.io.array_to_datum(values)
    assert not datum.HasField("label") and not datum.data
    back = caffe.io.datum_to_array(datum)
    assert back.dtype == np.float64
    np.testing.assert_allclose(back, values.astype(np.float32))
    # an unlabelled Datum serializes smaller than a labelled one (pycaffe's test)
    assert len(caffe.io.array_to_datum(values, label=1).SerializeToString()) > len(datum.SerializeToString())

    with pytest.raises(ValueError, match=r"K x H x W array, got shape \(4, 5\)"):
        caffe.io.array_to_datum(np.zeros((4, 5)))


def test_encoded_datum_decodes_to_bgr():
    rgb = RS.randint(0, 256, (4, 5, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    datum = caffe_pb2.Datum(data=buf.getvalue(), encoded=True)
    np.testing.assert_array_equal(caffe.io.datum_to_array(datum), rgb[:, :, ::-1].transpose(2, 0, 1))
    with pytest.raises(CaffeError, match="cannot decode encoded image"):
        caffe.io.datum_to_array(caffe_pb2.Datum(data=b"not an image", encoded=True))
