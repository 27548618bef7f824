"""WindowData on tiny PNGs and window files written here: exact crops of
windows with known pixels (BGR, mirror, mean, scale), Caffe's context-pad
and square geometry (hand-computed), the fg/bg split of every batch and the
fg/bg/ignored classification, resuming from get_state, the legacy
window_data_param fields, errors naming the window file and line."""
import numpy as np
import pytest
from PIL import Image

from caffempi.common import CaffeError
from caffempi.data.transformer import mean_to_blob_proto
from caffempi.layer_types.window_data import window_geometry
from caffempi.testing.gradient_check import run_layer


def pixels(h, w, seed=0):
    """An h x w RGB image with distinct-ish pixel values."""
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3)).astype(np.uint8)


def bgr_chw(rgb):
    return rgb[:, :, ::-1].transpose(2, 0, 1).astype(float)


def write_window_file(tmp_path, images, name="windows.txt"):
    """images: [(rgb or grey array, [(label, overlap, x1, y1, x2, y2), ...])]."""
    lines = []
    for i, (arr, windows) in enumerate(images):
        Image.fromarray(arr).save(tmp_path / ("im%d.png" % i))
        channels = 1 if arr.ndim == 2 else 3
        lines += ["# %d" % i, "im%d.png" % i, str(channels), str(arr.shape[0]), str(arr.shape[1]),
                  str(len(windows))]
        lines += ["%d %g %d %d %d %d" % w for w in windows]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def window_text(source, root, batch, params="", transform="crop_size: 4"):
    return ('type: "WindowData" window_data_param { source: "%s" root_folder: "%s/" batch_size: %d %s } '
            'transform_param { %s }' % (source, root, batch, params, transform))


def run(text, seed=1701):
    return run_layer(text, [], num_top=2, seed=seed)


# ------------------------------------------------------------- crop values
def test_window_is_cropped_exactly(tmp_path):
    # a 4x4 window with crop_size 4: no resampling, the pixels themselves
    img = pixels(8, 9)
    src = write_window_file(tmp_path, [(img, [(3, 0.8, 2, 1, 5, 4)])])
    _, _, top = run(window_text(src, tmp_path, 2, "fg_fraction: 1"))
    assert top[0].shape == (2, 3, 4, 4)
    for item in top[0].data:
        np.testing.assert_array_equal(item, bgr_chw(img)[:, 1:5, 2:6])
    np.testing.assert_array_equal(top[1].data, [3, 3])


def test_mirror_mean_value_and_scale(tmp_path):
    img = pixels(8, 9, seed=1)
    src = write_window_file(tmp_path, [(img, [(1, 0.9, 2, 1, 5, 4)])])
    text = window_text(src, tmp_path, 8, "fg_fraction: 1",
                       "crop_size: 4 mirror: true mean_value: 10 mean_value: 20 mean_value: 30 scale: 0.5")
    _, _, top = run(text)
    plain = (bgr_chw(img)[:, 1:5, 2:6] - np.array([10, 20, 30.]).reshape(3, 1, 1)) * 0.5
    mirrored = [np.array_equal(item, plain[:, :, ::-1]) for item in top[0].data]
    for item, m in zip(top[0].data, mirrored):
        assert m or np.array_equal(item, plain)
    assert 0 < sum(mirrored) < 8                      # both kinds drawn (seeded)


def test_mean_file_central_square(tmp_path):
    img = pixels(8, 9, seed=2)
    src = write_window_file(tmp_path, [(img, [(1, 0.9, 2, 1, 5, 4)])])
    mean = np.random.RandomState(3).uniform(0, 200, (3, 6, 6)).astype(np.float32)
    (tmp_path / "mean.binaryproto").write_bytes(mean_to_blob_proto(mean).SerializeToString())
    text = window_text(src, tmp_path, 1, "fg_fraction: 1",
                       'crop_size: 4 scale: 2 mean_file: "%s"' % (tmp_path / "mean.binaryproto"))
    _, _, top = run(text)
    # Caffe's offset (6 - 4) / 2 = 1: the mean's central 4x4
    want = (bgr_chw(img)[:, 1:5, 2:6] - mean[:, 1:5, 1:5]) * 2
    np.testing.assert_allclose(top[0].data[0], want, rtol=1e-6)


def test_grey_images_give_one_channel(tmp_path):
    grey = pixels(6, 6)[:, :, 0]
    src = write_window_file(tmp_path, [(grey, [(1, 0.9, 1, 1, 4, 4)])])
    _, _, top = run(window_text(src, tmp_path, 1, "fg_fraction: 1"))
    assert top[0].shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(top[0].data[0, 0], grey[1:5, 1:5])


# ----------------------------------------------------------------- geometry
@pytest.mark.parametrize("window,crop,pad,square,mirror,want", [
    # context_pad 2 at crop 8 grows the window 2x about its centre (2, 2):
    # x -2..6 -> clipped 0..6 (7 of 9 columns), warped to round(7*8/9) = 6,
    # after round(2*8/9) = 2 columns of context beyond the image
    ((0, 0, 3, 3), 8, 2, False, False, ((0, 0, 6, 6), (6, 6), (2, 2))),
    ((0, 0, 3, 3), 8, 2, False, True, ((0, 0, 6, 6), (6, 6), (2, 0))),       # mirrored padding
    # centre (8, 8): 4..12 -> clipped 4..9, round(6*8/9) = 5; the 3 columns
    # beyond the right edge become round(3*8/9) = 3 on the left when mirrored
    ((6, 6, 9, 9), 8, 2, False, False, ((4, 4, 9, 9), (5, 5), (0, 0))),
    ((6, 6, 9, 9), 8, 2, False, True, ((4, 4, 9, 9), (5, 5), (0, 3))),
    # square: 2 wide, 4 tall about (4, 4) -> 4 x 4 halves, x and y 2..6
    ((3, 2, 4, 5), 4, 0, True, False, ((2, 2, 6, 6), (4, 4), (0, 0))),
    # warp without context: the window itself, to the full square
    ((3, 2, 4, 5), 4, 0, False, False, ((3, 2, 4, 5), (4, 4), (0, 0))),
])
def test_window_geometry_hand_computed(window, crop, pad, square, mirror, want):
    assert window_geometry(window, (10, 10), crop, pad, square, mirror) == want


def test_context_padding_is_zero_and_mean_is_taken_at_the_pixels_place(tmp_path):
    flat = np.full((10, 10, 3), 100, np.uint8)
    src = write_window_file(tmp_path, [(flat, [(1, 0.9, 0, 0, 3, 3)])])
    mean = np.random.RandomState(4).uniform(0, 50, (3, 10, 10)).astype(np.float32)
    (tmp_path / "mean.binaryproto").write_bytes(mean_to_blob_proto(mean).SerializeToString())
    text = window_text(src, tmp_path, 8, "fg_fraction: 1 context_pad: 2",
                       'crop_size: 8 mirror: true mean_file: "%s"' % (tmp_path / "mean.binaryproto"))
    _, _, top = run(text)
    square = mean[:, 1:9, 1:9]                       # offset (10 - 8) / 2
    kinds = set()
    for item in top[0].data:
        # as test_window_geometry_hand_computed: 6x6 of image after 2 rows
        # of context, and 2 columns of context left (right when mirrored)
        cols = slice(0, 6) if item[:, :, 0].any() else slice(2, 8)
        kinds.add(cols.start)
        want = np.zeros((3, 8, 8))
        want[:, 2:8, cols] = 100 - square[:, 2:8, cols]
        np.testing.assert_allclose(item, want, rtol=1e-6)
    assert kinds == {0, 2}


# ----------------------------------------------------------------- sampling
def test_every_batch_has_the_fg_fraction_and_the_right_windows(tmp_path):
    # one image, four 2x2 windows of their own colour: fg A (label 2), fg B
    # (label 5), bg C (class 7 in the file, label 0), D between the thresholds
    img = np.zeros((2, 8, 3), np.uint8)
    for k, value in enumerate((10, 20, 30, 40)):
        img[:, 2 * k:2 * k + 2] = value
    windows = [(2, 0.9, 0, 0, 1, 1), (5, 0.6, 2, 0, 3, 1), (7, 0.1, 4, 0, 5, 1), (4, 0.4, 6, 0, 7, 1)]
    src = write_window_file(tmp_path, [(img, windows)])
    text = window_text(src, tmp_path, 8, "fg_fraction: 0.25 fg_threshold: 0.5 bg_threshold: 0.3",
                       "crop_size: 2")
    layer, _, top = run(text)
    colour_of_label = {0: 30, 2: 10, 5: 20}
    seen = set()
    for _ in range(6):
        labels = top[1].data
        np.testing.assert_array_equal(labels[:6], 0)          # int(8 * 0.25) = 2 fg, after the bg
        assert set(labels[6:]) <= {2, 5}
        for item, label in zip(top[0].data, labels):
            np.testing.assert_array_equal(item, colour_of_label[int(label)])
            seen.add(int(label))
        layer.forward([], top)
    assert seen == {0, 2, 5}                                  # D (40) is never used


def test_set_state_repeats_the_batches(tmp_path):
    img = pixels(12, 12, seed=5)
    windows = [(1, 0.9, 0, 0, 5, 5), (2, 0.8, 4, 4, 11, 11), (0, 0.0, 1, 2, 9, 7), (3, 0.1, 6, 0, 11, 4)]
    src = write_window_file(tmp_path, [(img, windows)])
    layer, _, top = run(window_text(src, tmp_path, 4, "fg_fraction: 0.5 context_pad: 1",
                                    "crop_size: 6 mirror: true"))
    state = layer.get_state()
    batches = []
    for _ in range(2):
        layer.forward([], top)
        batches.append((top[0].data.copy(), top[1].data.copy()))
    assert not np.array_equal(batches[0][0], batches[1][0])
    layer.set_state(state)
    for data, labels in batches:
        layer.forward([], top)
        np.testing.assert_array_equal(top[0].data, data)
        np.testing.assert_array_equal(top[1].data, labels)


# ------------------------------------------------------------- parameters
def test_legacy_window_data_param_fields(tmp_path):
    img = pixels(8, 9, seed=6)
    src = write_window_file(tmp_path, [(img, [(1, 0.9, 2, 1, 5, 4)])])
    text = window_text(src, tmp_path, 1, "fg_fraction: 1 crop_size: 4 scale: 0.25", "")
    _, _, top = run(text)
    np.testing.assert_allclose(top[0].data[0], bgr_chw(img)[:, 1:5, 2:6] * 0.25)
    with pytest.raises(CaffeError, match="crop_size is 4 in transform_param but 5 in window_data_param"):
        run(window_text(src, tmp_path, 1, "fg_fraction: 1 crop_size: 5"))


# ------------------------------------------------------------------- errors
GOOD = ["# 0", "im0.png", "3", "6", "6", "2", "1 0.9 0 0 3 3", "0 0.1 1 1 4 4"]


@pytest.mark.parametrize("lines,match", [
    (GOOD[:2] + ["x"] + GOOD[3:], "windows.txt line 3: expected the channel count, got 'x'"),
    (["@ 0"] + GOOD[1:], "windows.txt line 1: expected '#'"),
    (["# 1"] + GOOD[1:], "windows.txt line 1: image index 1, expected 0"),
    (GOOD[:6] + ["0 0.9 0 0 3 3", GOOD[7]], "windows.txt line 7: foreground window .* class index 0"),
    (GOOD[:6] + ["1 0.9 0 0 3"], "windows.txt ends early"),
    (GOOD[:6] + ["1 0.9 0 0 3 3"] * 2, "no background windows"),
    (GOOD[:6] + ["1 0.9 3 0 2 3", GOOD[7]], "line 7: window .* has x2 < x1"),
    (GOOD[:6] + ["1 0.9 0 0 3 6", GOOD[7]], r"windows.txt line 7: window \(0, 0, 3, 6\) does not fit in its 6x6"),
    ([], "is empty"),
])
def test_window_file_errors(tmp_path, lines, match):
    Image.fromarray(pixels(6, 6)).save(tmp_path / "im0.png")
    src = tmp_path / "windows.txt"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(CaffeError, match=match):
        run(window_text(src, tmp_path, 4))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CaffeError, match="cannot read window file .*nope.txt"):
        run(window_text(tmp_path / "nope.txt", tmp_path, 2))
    (tmp_path / "windows.txt").write_text("\n".join(GOOD) + "\n")        # im0.png never written
    with pytest.raises(CaffeError, match="windows.txt line 2: cannot read image .*im0.png"):
        run(window_text(tmp_path / "windows.txt", tmp_path, 2))


@pytest.mark.parametrize("params,transform,match", [
    ("", "", "crop_size must be set"),
    ("context_pad: 2", "crop_size: 4", "crop_size 4 must exceed twice the context_pad 2"),
    ('crop_mode: "stretch"', "crop_size: 4", "crop_mode must be warp or square"),
    ("fg_fraction: 1.5", "crop_size: 4", r"fg_fraction 1.5 must lie in \[0, 1\]"),
    ("", "crop_size: 4 mean_value: 1 mean_value: 2", "1 mean_value or one per channel"),
])
def test_parameter_errors(tmp_path, params, transform, match):
    Image.fromarray(pixels(6, 6)).save(tmp_path / "im0.png")
    (tmp_path / "windows.txt").write_text("\n".join(GOOD) + "\n")
    with pytest.raises(CaffeError, match=match):
        run(window_text(tmp_path / "windows.txt", tmp_path, 2, params, transform))
