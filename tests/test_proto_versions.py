"""caffe_pb2 on every protobuf that setup.py allows.

``make test-protobuf`` runs this file and the proto round-trip tests again
under the oldest and the newest of that range (CAFFEMPI_TEST_PROTOBUF says
which), with the upb and the pure-Python backends."""
import os
import re
from pathlib import Path

import pytest
from google.protobuf import __version__ as PROTOBUF_VERSION
from google.protobuf import text_format
from google.protobuf.internal import api_implementation

from caffempi.io import proto_io
from caffempi.proto import caffe_pb2
from caffempi.proto.fields import is_repeated, is_required

REPO = Path(__file__).resolve().parents[1]


def _version(text):
    return tuple(int(x) for x in re.match(r"\d+(\.\d+)*", text).group().split("."))


def _setup_range():
    """(oldest, first excluded) of setup.py's protobuf requirement."""
    m = re.search(r'"protobuf>=([\d.]+),<([\d.]+)"', (REPO / "setup.py").read_text())
    assert m, "setup.py states protobuf's range as protobuf>=A,<B"
    return _version(m.group(1)), _version(m.group(2))


def test_runtime_is_in_setup_range():
    low, high = _setup_range()
    assert low <= _version(PROTOBUF_VERSION) < high, PROTOBUF_VERSION


def test_makefile_tests_setup_oldest():
    m = re.search(r"^PROTOBUF_OLDEST := ([\d.]+)$", (REPO / "Makefile").read_text(), re.M)
    assert m and _version(m.group(1)) == _setup_range()[0]


@pytest.mark.skipif(os.environ.get("CAFFEMPI_TEST_PROTOBUF") != "oldest", reason="make test-protobuf's oldest")
def test_runs_on_the_oldest():
    assert _version(PROTOBUF_VERSION) == _setup_range()[0]


def test_backend_is_the_one_asked_for():
    asked = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
    if asked:
        assert api_implementation.Type() == asked
    if api_implementation.Type() == "upb":      # upb of the same install as google.protobuf
        import google.protobuf
        from google._upb import _message
        assert Path(_message.__file__).parents[1] == Path(google.protobuf.__file__).parents[1]


def test_gencode_has_no_runtime_version_check():
    """protoc 26+ code calls runtime_version.ValidateProtobufRuntimeVersion,
    which refuses any protobuf older than that protoc (and protobuf < 5.26
    has no such module): caffe_pb2.py must come from `make proto`'s protoc 25."""
    text = Path(caffe_pb2.__file__).read_text()
    assert "runtime_version" not in text
    assert "# Protobuf Python Version: 4.25." in text


def test_caffempi_solver_state_fields():
    fields = caffe_pb2.SolverState.DESCRIPTOR.fields_by_name
    assert fields["caffempi_state"].number == 1000
    assert fields["caffempi_blobs"].number == 1001
    assert is_repeated(fields["caffempi_blobs"]) and not is_repeated(fields["caffempi_state"])
    assert fields["caffempi_blobs"].message_type is caffe_pb2.BlobProto.DESCRIPTOR


def test_field_cardinality_api():
    """caffempi.proto.fields' is_repeated / is_required (the descriptor's
    own from protobuf 6.31, its label before) agree with the proto."""
    clip = caffe_pb2.ClipParameter.DESCRIPTOR.fields_by_name
    layer = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert is_required(clip["min"]) and not is_repeated(clip["min"])
    assert is_repeated(layer["bottom"]) and not is_required(layer["bottom"])
    assert not is_repeated(layer["name"]) and not is_required(layer["name"])


def test_solver_state_binary_round_trip(tmp_path):
    s = caffe_pb2.SolverState(iter=12, learned_net="x_iter_12.caffemodel", current_step=1)
    s.caffempi_state = b'{"rng": [1, 2]}\0\xff'
    h = s.history.add()
    h.shape.dim.extend([2, 3])
    h.data.extend(float(i) / 3 for i in range(6))
    b = s.caffempi_blobs.add()
    b.double_data.extend([0.1, -2.5])
    path = tmp_path / "x.solverstate"
    path.write_bytes(s.SerializeToString())
    back = proto_io.read_binary_proto(str(path), caffe_pb2.SolverState)
    assert back == s
    assert back.caffempi_state == s.caffempi_state and list(back.caffempi_blobs[0].double_data) == [0.1, -2.5]
    assert back.SerializeToString() == s.SerializeToString()


def test_net_text_and_binary_round_trip():
    net = text_format.Parse("""name: "n"
        layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }
        layer { name: "conv" type: "Convolution" bottom: "x" top: "y"
                param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
                convolution_param { num_output: 2 kernel_size: 3 pad: 1
                                    weight_filler { type: "xavier" } } }
        layer { name: "relu" type: "ReLU" bottom: "y" top: "y" relu_param { negative_slope: 0.1 } }
        """, caffe_pb2.NetParameter())
    again = text_format.Parse(text_format.MessageToString(net), caffe_pb2.NetParameter())
    assert again == net
    assert caffe_pb2.NetParameter.FromString(net.SerializeToString()) == net
    conv = net.layer[1].convolution_param
    assert (conv.stride, conv.bias_term, conv.engine) == ([], True, caffe_pb2.ConvolutionParameter.DEFAULT)


def test_unknown_fields_survive_a_round_trip():
    """A file written with fields this schema lacks (NVCaffe's, a newer
    caffempi's) keeps them through parse and serialize on every runtime."""
    s = caffe_pb2.SolverState(iter=3)
    data = s.SerializeToString() + bytes([0xd8, 0x7d, 0x05])   # field 2011, varint 5
    back = caffe_pb2.SolverState.FromString(data)
    assert back.iter == 3 and back.SerializeToString() == data


def test_packed_fields_are_written_packed():
    """caffe.proto's [packed = true] fields (BlobShape.dim, BlobProto.data
    ...) are written packed, as Caffe writes them, on every backend (the
    pure-Python one reads the option from the gencode's serialized options)."""
    assert caffe_pb2.BlobShape(dim=[1, 2]).SerializeToString() == b"\n\x02\x01\x02"
    assert caffe_pb2.BlobProto(data=[1.0]).SerializeToString() == b"*\x04\x00\x00\x80?"
