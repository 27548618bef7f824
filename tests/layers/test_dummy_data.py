"""DummyData's refills: random fillers draw anew every forward (fast float32
draws, caffempi.filler.refill), reproducibly from the seed and for any thread
count; constant fillers fill once."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import Net, set_random_seed
from caffempi import filler as filler_module
from caffempi.backend import threads
from caffempi.proto import caffe_pb2

NET = """
layer { name: "d" type: "DummyData" top: "g" top: "u" top: "c"
        dummy_data_param { shape { dim: 3 dim: 70 dim: 50 dim: 40 }
                           data_filler { type: "gaussian" mean: 2 std: 3 }
                           data_filler { type: "uniform" min: -1 max: 5 }
                           data_filler { type: "constant" value: 7 } } }
"""


def forwards(seed, count=2):
    set_random_seed(seed)
    p = caffe_pb2.NetParameter()
    text_format.Merge(NET, p)
    net = Net(p)
    out = []
    for _ in range(count):
        net.forward()
        out.append({k: net.blobs[k].data.copy() for k in ("g", "u", "c")})
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(filler_module, "_REFILL_CHUNK", 10000)     # 42 chunks


def test_random_fillers_refill_with_their_distribution_and_constants_stay(small_chunks):
    first, second = forwards(5)
    for step in (first, second):
        g, u, c = step["g"], step["u"], step["c"]
        assert g.dtype == u.dtype == np.float32 and g.shape == (3, 70, 50, 40)
        assert abs(g.mean() - 2) < 0.02 and abs(g.std() - 3) < 0.02
        z = np.abs(g - 2) / 3          # a normal's mass within 1, 2 and 3 sigma
        assert [round(float(np.mean(z < k)), 3) for k in (1, 2, 3)] == pytest.approx([0.683, 0.954, 0.997], abs=0.003)
        assert u.min() >= -1 and u.max() < 5 and abs(u.mean() - 2) < 0.02 and abs(u.std() - np.sqrt(3)) < 0.01
        assert (c == 7).all()
    assert not np.array_equal(first["g"], second["g"]) and not np.array_equal(first["u"], second["u"])
    # the chunks are not copies of one another
    g = first["g"].ravel()
    assert not np.array_equal(g[:10000], g[10000:20000])


def test_refills_are_reproducible_from_the_seed_and_the_same_on_any_thread_count(small_chunks):
    previous = threads.set_thread_count(1)
    try:
        one = forwards(5)
        threads.set_thread_count(2)
        two = forwards(5)
    finally:
        threads.set_thread_count(previous)
    other_seed = forwards(6)
    for a, b in zip(one, two):
        for k in a:
            assert np.array_equal(a[k], b[k])
    assert not np.array_equal(one[0]["g"], other_seed[0]["g"])
