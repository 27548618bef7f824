"""caffempi.io.atomic: the file appears whole or not at all, and no
temporary file is left behind."""
import os

import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.io.atomic import atomic_path, write_bytes_atomic


def test_write_replaces_the_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"old")
    write_bytes_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["w.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask     # as any new file, not mkstemp's 0600


def test_temp_is_hidden_beside_the_target_and_unique(tmp_path):
    path = tmp_path / "w.bin"
    with atomic_path(path) as a, atomic_path(str(path)) as b:
        assert a != b
        for tmp in (a, b):
            assert os.path.dirname(tmp) == str(tmp_path)
            name = os.path.basename(tmp)
            assert name.startswith(".w.bin.%d." % os.getpid()) and name.endswith(".tmp")
            assert not path.exists()        # nothing under the name until the block ends
        with open(a, "wb") as f:
            f.write(b"a")
        with open(b, "wb") as f:
            f.write(b"b")
    assert path.read_bytes() == b"a"       # the outer block ended last
    assert os.listdir(tmp_path) == ["w.bin"]


def test_error_in_block_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"old")
    with pytest.raises(KeyError):
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise KeyError("writer failed")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["w.bin"]


def test_unwritable_directory_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_bytes_atomic(tmp_path / "missing" / "w.bin", b"x")


def test_save_hdf5_is_atomic(tmp_path):
    h5py = pytest.importorskip("h5py")
    from google.protobuf import text_format
    from caffempi import Net
    from caffempi.proto import caffe_pb2
    net = Net(text_format.Parse('''
        layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
                inner_product_param { num_output: 2 weight_filler { type: "gaussian" } } }''',
                                caffe_pb2.NetParameter()))
    path = tmp_path / "w.caffemodel.h5"
    net.save_hdf5(str(path))
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["data"]["ip"]["0"][()], net.params["ip"][0].data)
    assert os.listdir(tmp_path) == ["w.caffemodel.h5"]
    with pytest.raises(CaffeError, match="missing"):
        net.save_hdf5(str(tmp_path / "missing" / "w.caffemodel.h5"))
