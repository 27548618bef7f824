"""HDF5Output: the datasets Caffe writes ("data", "label", 4-D legacy
shapes, the net's float type), one batch per forward replacing the last,
the empty file at setup, zero gradients, errors naming the file."""
import os

import h5py
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import make_layer, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def out_text(path):
    return 'type: "HDF5Output" hdf5_output_param { file_name: "%s" }' % path


def read(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in f}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_writes_data_and_label_as_legacy_4d(tmp_path, dtype):
    path = tmp_path / "out.h5"
    data, label = rand(3, 2, 4), np.array([1.0, 0.0, 2.0])
    layer = make_layer(out_text(path), dtype=dtype)
    run_layer(layer, [data, label], num_top=0)
    saved = read(path)
    assert sorted(saved) == ["data", "label"]
    assert saved["data"].shape == (3, 2, 4, 1) and saved["label"].shape == (3, 1, 1, 1)
    assert saved["data"].dtype == dtype and saved["label"].dtype == dtype
    np.testing.assert_array_equal(saved["data"][..., 0], data.astype(dtype))
    np.testing.assert_array_equal(saved["label"].reshape(-1), label)


def test_each_forward_replaces_the_file_with_its_batch(tmp_path):
    path = tmp_path / "out.h5"
    layer, bottom, top = run_layer(out_text(path), [rand(2, 3), np.zeros(2)], num_top=0)
    second = rand(2, 3, seed=1)
    bottom[0].data = second
    bottom[1].data = np.ones(2)
    layer.forward(bottom, top)
    saved = read(path)
    np.testing.assert_array_equal(saved["data"].reshape(2, 3), second)
    np.testing.assert_array_equal(saved["label"].reshape(-1), [1, 1])
    assert [p for p in os.listdir(tmp_path) if p != "out.h5"] == []      # no temporaries left


def test_setup_creates_an_empty_file(tmp_path):
    path = tmp_path / "out.h5"
    path.write_bytes(b"old contents")
    from caffempi.blob import Blob
    layer = make_layer(out_text(path))
    bottom = [Blob((2, 3), np, np.float64), Blob((2,), np, np.float64)]
    layer.setup(bottom, [])
    assert read(path) == {}


def test_backward_gives_zero_gradients(tmp_path):
    layer, bottom, top = run_layer(out_text(tmp_path / "o.h5"), [rand(2, 3), rand(2)], num_top=0)
    layer.backward(top, [True, True], bottom)
    assert not bottom[0].diff.any() and not bottom[1].diff.any()


@pytest.mark.parametrize("text,bottoms,match", [
    ('type: "HDF5Output"', [np.zeros((2, 3)), np.zeros(2)], "file_name is not set"),
    (None, [np.zeros((2, 3)), np.zeros(3)], r"same number of items"),
    (None, [np.zeros((2, 1, 1, 1, 1)), np.zeros(2)], r"bottom 0 has shape \(2, 1, 1, 1, 1\)"),
])
def test_errors(tmp_path, text, bottoms, match):
    with pytest.raises(CaffeError, match=match):
        run_layer(text or out_text(tmp_path / "o.h5"), bottoms, num_top=0)


def test_unwritable_file_is_named(tmp_path):
    path = tmp_path / "missing_dir" / "o.h5"
    with pytest.raises(CaffeError, match="cannot write HDF5 file .*missing_dir/o.h5"):
        run_layer(out_text(path), [np.zeros((2, 3)), np.zeros(2)], num_top=0)
