"""Data path: Datum records as Caffe's tools write them, the converters, the
threaded per-rank LMDB reader (sharding, resume, errors), the DataTransformer,
and the ImageData / HDF5Data / MemoryData layers."""
import io
import json
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi.layer_types.data  # noqa: F401  (registers the data layers)
from caffempi import CaffeError, Net, TEST, TRAIN
from caffempi.data import lmdb_io
from caffempi.data.datum import (array_to_datum, datum_to_array, encode_image, encoded_datum, parse_datum,
                                  raw_datum_batch)
from caffempi.data.transformer import DataTransformer, mean_to_blob_proto
from caffempi.io import proto_io
from caffempi.proto import caffe_pb2
from caffempi.tools import compute_image_mean, convert_cifar_data, convert_imageset, convert_mnist_data

REPO = Path(__file__).resolve().parents[1]
SAMPLE_H5 = REPO.parent / "shared" / "caffe-zoo" / "bvlc" / "test_data" / "sample_data.h5"


# ----------------------------------------------------------------- helpers
def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def caffe_datum_bytes(c, h, w, data, label, encoded=None):
    """The wire bytes C++ Caffe writes for a Datum (fields in number order)."""
    out = b"\x08" + varint(c) + b"\x10" + varint(h) + b"\x18" + varint(w)
    out += b"\x22" + varint(len(data)) + data + b"\x28" + varint(label)
    if encoded is not None:
        out += b"\x38" + varint(int(encoded))
    return out


def write_idx(tmp, images, labels):
    n, r, c = images.shape
    ip, lp = tmp / "imgs-idx3-ubyte", tmp / "lbls-idx1-ubyte"
    ip.write_bytes(struct.pack(">iiii", 2051, n, r, c) + images.astype(np.uint8).tobytes())
    lp.write_bytes(struct.pack(">ii", 2049, n) + labels.astype(np.uint8).tobytes())
    return ip, lp


def make_lmdb(path, images, labels, fmt="%08d"):
    with lmdb_io.LMDBWriter(path) as w:
        for i, (im, lb) in enumerate(zip(images, labels)):
            w.put(fmt % i, array_to_datum(im, int(lb)).SerializeToString())
    return str(path)


def data_net(source, batch, shard=(0, 1), phase=TRAIN, transform="", extra="", labels=True):
    p = text_format.Parse('''layer { name: "d" type: "Data" top: "data" %s
        transform_param { %s } data_param { source: "%s" batch_size: %d backend: LMDB %s } }'''
                          % ('top: "label"' if labels else "", transform, source, batch, extra),
                          caffe_pb2.NetParameter())
    return Net(p, phase, data_shard=shard)


def run(net, n):
    out = []
    for _ in range(n):
        net.forward()
        out.append((net.blobs["data"].data.copy(),
                    net.blobs["label"].data.copy() if "label" in net.blobs else None))
    return out


def close(net):
    for l in net.layers:
        if hasattr(l, "close"):
            l.close()


@pytest.fixture
def small_db(tmp_path):
    """13 records (not a multiple of 2 or 3: exercises the wrap-around), 3×6×5."""
    rs = np.random.RandomState(0)
    imgs = rs.randint(0, 256, size=(13, 3, 6, 5)).astype(np.uint8)
    labels = np.arange(13) % 10
    return make_lmdb(tmp_path / "small_lmdb", imgs, labels), imgs, labels


# ------------------------------------------------------------- Datum format
def test_datum_bytes_match_caffe_wire_format():
    img = np.arange(12, dtype=np.uint8).reshape(1, 3, 4)
    d = array_to_datum(img, 7)
    assert d.SerializeToString() == caffe_datum_bytes(1, 3, 4, img.tobytes(), 7)
    d0 = array_to_datum(img, 0)          # label 0 is still written (set_label)
    assert d0.SerializeToString() == caffe_datum_bytes(1, 3, 4, img.tobytes(), 0)
    back = datum_to_array(parse_datum(d.SerializeToString()))
    np.testing.assert_array_equal(back, img)


def test_raw_datum_batch_matches_record_by_record_decoding():
    rs = np.random.RandomState(3)
    imgs = rs.randint(0, 256, (5, 3, 4, 2)).astype(np.uint8)
    values = [array_to_datum(im, i).SerializeToString() for i, im in enumerate(imgs)]
    images, labels = raw_datum_batch(values)
    np.testing.assert_array_equal(images, np.stack([datum_to_array(parse_datum(v)) for v in values]))
    np.testing.assert_array_equal(labels, np.arange(5, dtype=np.float32))
    # anything but raw uint8 Datums of one shape goes back to record-by-record
    # decoding, which handles float_data and encoded images and names bad records
    other = [array_to_datum(np.zeros((3, 4, 3), np.uint8)).SerializeToString(),
             array_to_datum(np.zeros((3, 4, 2), np.float32)).SerializeToString(),
             encoded_datum(encode_image(imgs[0], "png")).SerializeToString(),
             b"\xff\xff\xff garbage"]
    for bad in other:
        assert raw_datum_batch(values[:2] + [bad]) is None
    assert raw_datum_batch([]) is None


def test_float_data_and_encoded_datums():
    f = np.random.RandomState(1).randn(2, 3, 4).astype(np.float32)
    np.testing.assert_array_equal(datum_to_array(array_to_datum(f, 1)), f)
    rgb = np.random.RandomState(2).randint(0, 256, (3, 5, 6)).astype(np.uint8)   # BGR C×H×W
    png = encode_image(rgb, "png")
    d = encoded_datum(png, 3)
    np.testing.assert_array_equal(datum_to_array(d), rgb)
    from PIL import Image
    pil = np.asarray(Image.open(io.BytesIO(png)))                # RGB H×W×C
    np.testing.assert_array_equal(pil[:, :, ::-1].transpose(2, 0, 1), rgb)
    gray = datum_to_array(d, force_gray=True)
    assert gray.shape == (1, 5, 6)
    g = encoded_datum(encode_image(rgb[:1], "png"))
    assert datum_to_array(g).shape == (1, 5, 6)
    assert datum_to_array(g, force_color=True).shape == (3, 5, 6)


def test_convert_mnist_data_writes_caffe_records(tmp_path):
    rs = np.random.RandomState(3)
    imgs = rs.randint(0, 256, (5, 4, 3)).astype(np.uint8)
    labels = np.array([3, 0, 9, 1, 1])
    ip, lp = write_idx(tmp_path, imgs, labels)
    db = str(tmp_path / "mnist_lmdb")
    assert convert_mnist_data.main([str(ip), str(lp), db, "--backend=lmdb"]) == 0
    recs = lmdb_io.read_all(db)
    assert [k for k, _ in recs] == [b"%08d" % i for i in range(5)]
    for i, (_, v) in enumerate(recs):
        assert v == caffe_datum_bytes(1, 4, 3, imgs[i].tobytes(), int(labels[i]))
    # and the hand-built Caffe database reads back identically through the Data layer
    net = data_net(db, 5, phase=TEST)
    (data, lab), = run(net, 1)
    np.testing.assert_array_equal(data, imgs[:, None].astype(np.float32))
    np.testing.assert_array_equal(lab, labels)
    close(net)


def test_convert_mnist_rejects_bad_magic(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(struct.pack(">iiii", 1234, 1, 1, 1) + b"\0")
    with pytest.raises(CaffeError, match="magic"):
        convert_mnist_data.read_idx_images(str(p))


def test_convert_cifar_data_writes_caffe_records(tmp_path):
    rs = np.random.RandomState(4)
    n = 3
    src = tmp_path / "cifar"
    src.mkdir()
    batches = {}
    for name in ["data_batch_%d.bin" % i for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rs.randint(0, 10, n).astype(np.uint8)
        imgs = rs.randint(0, 256, (n, 3072)).astype(np.uint8)
        (src / name).write_bytes(np.concatenate([labels[:, None], imgs], 1).tobytes())
        batches[name] = (labels, imgs)
    out = tmp_path / "out"
    convert_cifar_data.convert_dataset(str(src), str(out), "lmdb", batch_size=n)
    train = lmdb_io.read_all(out / "cifar10_train_lmdb")
    assert [k for k, _ in train] == [b"%05d" % i for i in range(5 * n)]
    for i, (_, v) in enumerate(train):
        labels, imgs = batches["data_batch_%d.bin" % (i // n + 1)]
        assert v == caffe_datum_bytes(3, 32, 32, imgs[i % n].tobytes(), int(labels[i % n]))
    test = lmdb_io.read_all(out / "cifar10_test_lmdb")
    assert [k for k, _ in test] == [b"%05d" % i for i in range(n)]
    labels, imgs = batches["test_batch.bin"]
    assert test[1][1] == caffe_datum_bytes(3, 32, 32, imgs[1].tobytes(), int(labels[1]))


def test_convert_imageset_raw_encoded_and_mean(tmp_path):
    from PIL import Image
    rs = np.random.RandomState(5)
    root = tmp_path / "imgs"
    root.mkdir()
    arrs = []
    lines = []
    for i in range(4):
        rgb = rs.randint(0, 256, (6, 7, 3)).astype(np.uint8)
        Image.fromarray(rgb).save(root / ("im%d.png" % i))
        arrs.append(rgb[:, :, ::-1].transpose(2, 0, 1))       # BGR C×H×W, as OpenCV reads it
        lines.append("im%d.png %d" % (i, i % 2))
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(lines) + "\n")
    raw = str(tmp_path / "raw_lmdb")
    assert convert_imageset.main([str(root) + "/", str(lst), raw, "--check_size"]) == 0
    recs = lmdb_io.read_all(raw)
    assert [k for k, _ in recs] == [b"%08d_im%d.png" % (i, i) for i in range(4)]
    for i, (_, v) in enumerate(recs):
        assert v == caffe_datum_bytes(3, 6, 7, arrs[i].tobytes(), i % 2, encoded=False)
    enc = str(tmp_path / "enc_lmdb")
    assert convert_imageset.main([str(root) + "/", str(lst), enc, "--encoded"]) == 0
    d = parse_datum(lmdb_io.read_all(enc)[2][1])
    assert d.encoded and d.data == (root / "im2.png").read_bytes()      # the file as is
    np.testing.assert_array_equal(datum_to_array(d), arrs[2])
    gray = str(tmp_path / "gray_lmdb")
    assert convert_imageset.main([str(root) + "/", str(lst), gray, "--gray", "--resize_height=4",
                                  "--resize_width=5"]) == 0
    assert datum_to_array(parse_datum(lmdb_io.read_all(gray)[0][1])).shape == (1, 4, 5)
    # the Data layer reads encoded and raw databases alike
    n1, n2 = data_net(raw, 4, phase=TEST), data_net(enc, 4, phase=TEST)
    np.testing.assert_array_equal(run(n1, 1)[0][0], run(n2, 1)[0][0])
    close(n1), close(n2)
    # compute_image_mean: float32 mean, BlobProto 1×C×H×W (legacy dims)
    mean_path = str(tmp_path / "mean.binaryproto")
    assert compute_image_mean.main([raw, mean_path]) == 0
    bp = proto_io.read_binary_proto(mean_path, caffe_pb2.BlobProto)
    assert (bp.num, bp.channels, bp.height, bp.width) == (1, 3, 6, 7)
    want = np.stack(arrs).astype(np.float32).sum(0) / np.float32(4)
    np.testing.assert_array_equal(np.asarray(bp.data, np.float32).reshape(3, 6, 7), want)


def test_convert_imageset_missing_image(tmp_path):
    (tmp_path / "list.txt").write_text("nope.png 1\n")
    with pytest.raises(CaffeError, match="nope.png"):
        convert_imageset.convert(str(tmp_path), str(tmp_path / "list.txt"), str(tmp_path / "db"))


# ------------------------------------------------------------- Data layer
def test_data_layer_reads_in_key_order_and_wraps(small_db):
    db, imgs, labels = small_db
    net = data_net(db, 5, phase=TEST, transform="scale: 0.5")
    out = run(net, 4)                    # 20 records: wraps after 13
    idx = np.arange(20) % 13
    data = np.concatenate([d for d, _ in out])
    np.testing.assert_array_equal(data, imgs[idx].astype(np.float32) * np.float32(0.5))
    np.testing.assert_array_equal(np.concatenate([l for _, l in out]), labels[idx])
    assert net.blobs["data"].shape == (5, 3, 6, 5) and net.blobs["label"].shape == (5,)
    assert net.data_state()["d"]["batch"] == 4
    assert net.data_wait_seconds() > 0
    close(net)


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharding_reproduces_the_bigger_batch(small_db, ranks):
    db, imgs, labels = small_db
    b, iters = 2, 5
    tf = "crop_size: 4 mirror: true scale: 0.25"
    from caffempi.common import set_random_seed
    set_random_seed(11)                 # every rank's solver seeds the same random_seed
    one = data_net(db, b * ranks, transform=tf)
    single = run(one, iters)
    shards = []
    for r in range(ranks):
        set_random_seed(11)
        net = data_net(db, b, shard=(r, ranks), transform=tf)
        shards.append(run(net, iters))
        close(net)
    for k in range(iters):
        # global batch k = records k·R·b ... (k+1)·R·b − 1 (mod 13); rank r has those ≡ r (mod R)
        want_idx = (k * ranks * b + np.arange(ranks * b)) % 13
        np.testing.assert_array_equal(single[k][1], labels[want_idx])
        for r in range(ranks):
            np.testing.assert_array_equal(shards[r][k][1], labels[want_idx[r::ranks]])
            # the same records with the same random crop and mirror
            np.testing.assert_array_equal(shards[r][k][0], single[k][0][r::ranks])
    close(one)


@pytest.mark.parametrize("ranks,schedule", [
    (2, [(3, 1), (3, 1), None, (1, 3), (2, 2)]),
    (3, [(1, 2, 3), (3, 2, 1), None, (4, 1, 1), (1, 1, 4)]),
])
def test_uneven_shares_read_the_same_records_with_the_same_draws(small_db, ranks, schedule):
    """Shares that change every batch (None: equal, interleaved): the ranks
    hold each global batch between them, each record once, crops and
    mirrors as one process draws them."""
    db, _, labels = small_db
    b = 2
    tf = "crop_size: 4 mirror: true scale: 0.25"
    from caffempi.common import set_random_seed
    set_random_seed(11)
    one = data_net(db, b * ranks, transform=tf)
    single = run(one, len(schedule))
    close(one)
    nets = []
    for r in range(ranks):
        set_random_seed(11)
        nets.append(data_net(db, b, shard=(r, ranks), transform=tf))
    for k, shares in enumerate(schedule):
        for net in nets:
            net.set_batch_shares(shares)
        got = [run(net, 1)[0] for net in nets]
        order = np.concatenate([np.arange(ranks * b)[r::ranks] for r in range(ranks)]) if shares is None \
            else np.arange(ranks * b)
        np.testing.assert_array_equal(np.concatenate([y for _, y in got]), single[k][1][order])
        np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), single[k][0][order])
        if shares is not None:
            assert [net.blobs["data"].shape[0] for net in nets] == list(shares)
    for net in nets:
        close(net)


def test_shares_announced_ahead_keep_the_readers_running(small_db):
    """Shares announced a lookahead ahead (Net.set_batch_shares(..., ahead))
    take effect at that batch with no reader restart, the records and
    draws those of one process; announced too late, the reader restarts
    and reads them all the same."""
    db, _, _ = small_db
    b, ranks = 3, 2
    tf = "crop_size: 4 mirror: true"
    from caffempi.common import set_random_seed
    set_random_seed(5)
    one = data_net(db, b * ranks, transform=tf)
    single = run(one, 12)
    close(one)
    nets = []
    for r in range(ranks):
        set_random_seed(5)
        nets.append(data_net(db, b, shard=(r, ranks), transform=tf, extra="prefetch: 2"))
    ahead = nets[0].share_lookahead()
    assert ahead == 5
    plan = {0: ((5, 1), ahead), 3: ((2, 4), ahead), 9: ((1, 5), 1)}      # batch: (shares, announced ahead)
    in_effect, restarts, readers = {}, 0, None
    for k in range(12):
        if k in plan:
            shares, when = plan[k]
            for net in nets:
                net.set_batch_shares(shares, when)
            in_effect[k + when] = shares
        got = [run(net, 1)[0] for net in nets]
        now = [p for p in [layer._prefetcher for layer in (net.layer("d") for net in nets)]]
        restarts += readers is not None and any(a is not c for a, c in zip(readers, now))
        readers = now
        shares = in_effect[max(j for j in in_effect if j <= k)] if any(j <= k for j in in_effect) else None
        order = np.arange(ranks * b) if shares else np.concatenate([np.arange(ranks * b)[r::ranks]
                                                                    for r in range(ranks)])
        assert nets[0].batch_shares == shares
        assert [len(y) for _, y in got] == list(shares or (b,) * ranks), (k, [len(y) for _, y in got])
        np.testing.assert_array_equal(np.concatenate([y for _, y in got]), single[k][1][order])
        np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), single[k][0][order])
    assert restarts == 1                      # only the late announcement restarted the readers
    for net in nets:
        close(net)


def test_resume_reader_position_bitwise(small_db):
    db, _, _ = small_db
    tf = "crop_size: 3 mirror: true mean_value: 10 mean_value: 20 mean_value: 30"
    from caffempi.common import set_random_seed
    set_random_seed(7)
    straight = data_net(db, 4, transform=tf, extra="rand_skip: 9")
    a = run(straight, 8)
    set_random_seed(7)
    first = data_net(db, 4, transform=tf, extra="rand_skip: 9")
    b = run(first, 4)
    state = json.loads(json.dumps(first.data_state()))
    close(first)
    set_random_seed(12345)                 # a different process seed: the state restores it
    second = data_net(db, 4, transform=tf, extra="rand_skip: 9")
    second.set_data_state(state)
    b += run(second, 4)
    for (x, y), (u, v) in zip(a, b):
        np.testing.assert_array_equal(x, u)
        np.testing.assert_array_equal(y, v)
    close(straight), close(second)


def test_thread_timing_does_not_change_batches(small_db):
    db, _, _ = small_db
    tf = "crop_size: 4 mirror: true"
    from caffempi.common import set_random_seed
    from caffempi.config import using_config
    outs = []
    for workers in (1, 4):
        with using_config(data_workers=workers):
            set_random_seed(3)
            net = data_net(db, 3, transform=tf, extra="prefetch: %s" % ("1" if workers == 1 else "8"))
            outs.append(run(net, 9))
            assert net.layers[0]._prefetcher.workers == workers
            close(net)
    for (x, y), (u, v) in zip(*outs):
        np.testing.assert_array_equal(x, u)


# ------------------------------------------------------------- transformer
def tparam(**kw):
    p = caffe_pb2.TransformationParameter()
    for k, v in kw.items():
        if k == "mean_value":
            p.mean_value.extend(v)
        else:
            setattr(p, k, v)
    return p


def test_transformer_center_crop_scale_mean_values():
    x = np.random.RandomState(0).randint(0, 256, (2, 3, 7, 8)).astype(np.uint8)
    t = DataTransformer(tparam(crop_size=4, scale=0.5, mean_value=[1, 2, 3]), TEST)
    out = t.transform(list(x))
    ho, wo = (7 - 4) // 2, (8 - 4) // 2
    want = (x[:, :, ho:ho + 4, wo:wo + 4].astype(np.float32)
            - np.float32([1, 2, 3])[None, :, None, None]) * np.float32(0.5)
    np.testing.assert_array_equal(out, want)
    one = DataTransformer(tparam(mean_value=[5]), TEST).transform(list(x))
    np.testing.assert_array_equal(one, x.astype(np.float32) - 5)


def test_transformer_random_crop_mirror_mean_file(tmp_path):
    rs = np.random.RandomState(1)
    x = rs.randint(0, 256, (6, 2, 9, 8)).astype(np.uint8)
    mean = rs.rand(2, 9, 8).astype(np.float32) * 100
    mp = str(tmp_path / "mean.binaryproto")
    proto_io.write_binary_proto_atomic(mp, mean_to_blob_proto(mean))
    t = DataTransformer(tparam(crop_size=5, mirror=True, mean_file=mp, scale=0.25), TRAIN)
    draws = DataTransformer.draws(99, 3, 6)
    out = t.transform(list(x), draws)
    offsets = set()
    for i in range(6):
        ho, wo, m = draws[0][i] % 5, draws[1][i] % 4, draws[2][i] & 1
        offsets.add((ho, wo, m))
        want = (x[i, :, ho:ho + 5, wo:wo + 5].astype(np.float32) - mean[:, ho:ho + 5, wo:wo + 5]) * np.float32(0.25)
        if m:
            want = want[:, :, ::-1]
        np.testing.assert_array_equal(out[i], want)
    assert len(offsets) > 1
    # mean file shape must fit the data
    bad = DataTransformer(tparam(mean_file=mp), TRAIN)
    with pytest.raises(CaffeError, match="mean file"):
        bad.output_shape((2, 8, 8))
    with pytest.raises(CaffeError, match="crop_size"):
        DataTransformer(tparam(crop_size=10), TRAIN).output_shape((2, 9, 8))
    with pytest.raises(CaffeError, match="mean_value"):
        DataTransformer(tparam(mean_value=[1, 2, 3]), TRAIN).output_shape((2, 9, 8))
    with pytest.raises(CaffeError, match="at the same time"):
        DataTransformer(tparam(mean_file=mp, mean_value=[1]), TRAIN)


def test_mirror_flips_width():
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(1, 2, 3, 4)
    t = DataTransformer(tparam(mirror=True), TRAIN)
    out = t.transform(list(x), np.array([[0], [0], [1]]))
    np.testing.assert_array_equal(out[0], x[0, :, :, ::-1].astype(np.float32))


# ------------------------------------------------------------- errors
def test_missing_and_empty_databases(tmp_path):
    with pytest.raises(CaffeError, match="no such LMDB.*nowhere_lmdb|nowhere_lmdb.*no such"):
        data_net(str(tmp_path / "nowhere_lmdb"), 2)
    empty = tmp_path / "empty_lmdb"
    lmdb_io.LMDBWriter(empty).close()
    with pytest.raises(CaffeError, match="empty"):
        data_net(str(empty), 2)
    with pytest.raises(CaffeError, match="not a LevelDB database .*it is an LMDB: backend: LMDB"):
        p = text_format.Parse('layer { name: "d" type: "Data" top: "data" data_param { source: "%s" '
                              'batch_size: 2 backend: LEVELDB } }' % empty, caffe_pb2.NetParameter())
        Net(p, TRAIN)


def test_bad_record_surfaces_with_key_and_no_hang(tmp_path):
    db = tmp_path / "bad_lmdb"
    with lmdb_io.LMDBWriter(db) as w:
        for i in range(6):
            v = array_to_datum(np.zeros((1, 2, 2), np.uint8), 1).SerializeToString()
            w.put("%08d" % i, v if i != 4 else b"\xff\xff\xff garbage")
    net = data_net(str(db), 2)
    net.forward()
    net.forward()
    t0 = time.time()
    with pytest.raises(CaffeError, match="bad_lmdb key '00000004'"):
        net.forward()
    assert time.time() - t0 < 5
    time.sleep(0.3)
    assert not [t for t in threading.enumerate() if t.name.startswith("d(")]
    close(net)


def test_inconsistent_record_size(tmp_path):
    db = tmp_path / "mixed_lmdb"
    with lmdb_io.LMDBWriter(db) as w:
        w.put("0", array_to_datum(np.zeros((1, 2, 2), np.uint8)).SerializeToString())
        w.put("1", array_to_datum(np.zeros((1, 3, 2), np.uint8)).SerializeToString())
    net = data_net(str(db), 2)
    with pytest.raises(CaffeError, match="key '1'"):
        net.forward()
    close(net)


def test_mean_file_shape_error_in_layer(small_db, tmp_path):
    db, _, _ = small_db
    mp = str(tmp_path / "m.binaryproto")
    proto_io.write_binary_proto_atomic(mp, mean_to_blob_proto(np.zeros((3, 4, 4), np.float32)))
    with pytest.raises(CaffeError, match="layer 'd'.*mean file"):
        data_net(db, 2, transform='mean_file: "%s"' % mp)


def test_readers_stop_cleanly(small_db):
    db, _, _ = small_db
    net = data_net(db, 2, extra="prefetch: 2")
    net.forward()
    names = [t.name for t in threading.enumerate() if t.name.startswith("d(")]
    assert len(names) == 3                 # the cursor thread and two decoders
    close(net)
    assert not [t for t in threading.enumerate() if t.name.startswith("d(")]


# ------------------------------------------------------------- other layers
def image_list(tmp_path, n=5, size=(6, 5)):
    from PIL import Image
    rs = np.random.RandomState(8)
    root = tmp_path / "root"
    root.mkdir()
    arrs = []
    with open(tmp_path / "list.txt", "w") as f:
        for i in range(n):
            rgb = rs.randint(0, 256, size + (3,)).astype(np.uint8)
            Image.fromarray(rgb).save(root / ("a %d.png" % i))      # spaces in names are allowed
            arrs.append(rgb[:, :, ::-1].transpose(2, 0, 1))
            f.write("a %d.png %d\n" % (i, i))
    return str(root) + "/", str(tmp_path / "list.txt"), np.stack(arrs)


def image_net(root, lst, batch, extra="", shard=(0, 1), transform=""):
    p = text_format.Parse('''layer { name: "img" type: "ImageData" top: "data" top: "label"
        transform_param { %s } image_data_param { source: "%s" root_folder: "%s" batch_size: %d %s } }'''
                          % (transform, lst, root, batch, extra), caffe_pb2.NetParameter())
    return Net(p, TRAIN, data_shard=shard)


def test_image_data_layer(tmp_path):
    root, lst, arrs = image_list(tmp_path)
    net = image_net(root, lst, 3)
    out = run(net, 2)
    np.testing.assert_array_equal(out[0][0], arrs[:3].astype(np.float32))
    np.testing.assert_array_equal(out[1][1], [3, 4, 0])
    close(net)
    net = image_net(root, lst, 5, "shuffle: true new_height: 4 new_width: 3 is_color: false")
    (d1, l1), (d2, l2) = run(net, 2)
    assert d1.shape == (5, 1, 4, 3)
    assert sorted(l1) == [0, 1, 2, 3, 4] and sorted(l2) == [0, 1, 2, 3, 4]
    close(net)
    net2 = image_net(root, lst, 2, shard=(1, 2))
    (_, l), = run(net2, 1)
    np.testing.assert_array_equal(l, [1, 3])
    close(net2)


def test_image_data_missing_image(tmp_path):
    root, lst, _ = image_list(tmp_path, n=3)
    with open(lst, "a") as f:
        f.write("missing.png 1\n")
    net = image_net(root, lst, 4)
    with pytest.raises(CaffeError, match=r"list.txt line 4: cannot read image .*missing.png"):
        net.forward()
    close(net)


def hdf5_net(source, batch, tops=("data", "label"), shuffle=False, shard=(0, 1)):
    p = text_format.Parse('''layer { name: "h" type: "HDF5Data" %s
        hdf5_data_param { source: "%s" batch_size: %d shuffle: %s } }'''
                          % (" ".join('top: "%s"' % t for t in tops), source, batch,
                             "true" if shuffle else "false"), caffe_pb2.NetParameter())
    return Net(p, TRAIN, data_shard=shard)


def test_hdf5_data_sample_file(tmp_path):
    if not SAMPLE_H5.exists():
        pytest.skip("../shared/caffe-zoo sample_data.h5 is absent")
    import h5py
    lst = tmp_path / "list.txt"
    lst.write_text("%s\n%s\n" % (SAMPLE_H5, SAMPLE_H5))
    with h5py.File(SAMPLE_H5, "r") as f:
        data, label = np.asarray(f["data"]), np.asarray(f["label"])
    net = hdf5_net(str(lst), 4, ("data", "label"))
    assert net.blobs["data"].shape == (4, 8, 6, 5) and net.blobs["label"].shape == (4, 1)
    rows, labels = [], []
    for _ in range(6):                                   # 24 rows: both files, then wrap
        net.forward()
        rows.append(net.blobs["data"].data.copy())
        labels.append(net.blobs["label"].data.copy())
    order = np.arange(24) % 20
    np.testing.assert_array_equal(np.concatenate(rows), np.concatenate([data, data])[order])
    np.testing.assert_array_equal(np.concatenate(labels).reshape(-1),
                                  np.concatenate([label, label]).reshape(-1)[order])


def test_hdf5_data_shuffle_shard_and_errors(tmp_path):
    import h5py
    for i in range(2):
        with h5py.File(tmp_path / ("f%d.h5" % i), "w") as f:
            f["x"] = np.arange(6 * 2, dtype=np.float32).reshape(6, 2) + 100 * i
            f["y"] = np.arange(6, dtype=np.float32) + 10 * i
    lst = tmp_path / "l.txt"
    lst.write_text("f0.h5\nf1.h5\n")                      # relative to the list file
    net = hdf5_net(str(lst), 4, ("x", "y"), shuffle=True)
    ys = np.concatenate([run_h(net)[1] for _ in range(3)])
    assert sorted(ys) == sorted(list(range(6)) + list(range(10, 16)))
    net.set_data_state({"h": {"batch": 0, "seed": net.data_state()["h"]["seed"]}})
    np.testing.assert_array_equal(np.concatenate([run_h(net)[1] for _ in range(3)]), ys)
    s0, s1 = hdf5_net(str(lst), 2, ("x", "y"), shard=(0, 2)), hdf5_net(str(lst), 2, ("x", "y"), shard=(1, 2))
    np.testing.assert_array_equal(run_h(s0)[1], [0, 2])
    np.testing.assert_array_equal(run_h(s1)[1], [1, 3])
    with pytest.raises(CaffeError, match="no dataset 'z'"):
        hdf5_net(str(lst), 2, ("x", "z"))
    bad = tmp_path / "bad.txt"
    bad.write_text("nothere.h5\n")
    with pytest.raises(CaffeError, match="nothere.h5"):
        hdf5_net(str(bad), 2, ("x",))


def run_h(net):
    net.forward()
    return [net.blobs[n].data.copy() for n in net.top_names[0]]


def test_memory_data_layer():
    p = text_format.Parse('''layer { name: "m" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }''', caffe_pb2.NetParameter())
    net = Net(p, TRAIN)
    with pytest.raises(CaffeError, match="reset"):
        net.forward()
    x = np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 2, 3)
    layer = net.layer("m")
    layer.reset(x, np.arange(4))
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, x[:2])
    net.forward()
    net.forward()
    np.testing.assert_array_equal(net.blobs["label"].data, [0, 1])          # wrapped
    with pytest.raises(CaffeError, match="multiple of batch_size"):
        layer.reset(x[:3], np.arange(3))
    with pytest.raises(CaffeError, match="N x 1 x 2 x 3"):
        layer.reset(x.reshape(4, 2, 1, 3), np.arange(4))


def test_backend_defaults_to_lmdb_for_an_lmdb_source(small_db):
    db, imgs, _ = small_db
    p = text_format.Parse('layer { name: "d" type: "Data" top: "data" data_param { source: "%s" batch_size: 2 } }'
                          % db, caffe_pb2.NetParameter())
    net = Net(p, TEST)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, imgs[:2].astype(np.float32))
    close(net)


# ---------------------------------------------------------- extract_features
FEATURE_NET = """name: "feat"
layer { name: "d" type: "Data" top: "data" top: "label"
        transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 4 backend: LMDB } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
"""


def test_extract_features_writes_caffe_feature_databases(small_db, tmp_path):
    from caffempi.tools import extract_features
    source, imgs, _ = small_db
    proto = tmp_path / "feat.prototxt"
    proto.write_text(FEATURE_NET % source)
    net = Net(str(proto), TEST)
    weights = tmp_path / "feat.caffemodel"
    net.save(str(weights))
    # the reference: the same net's values, image by image (3 batches of 4 of the 13 records)
    x = imgs[:12].astype(np.float32) * np.float32(0.00390625)
    w, b = (p.data for p in net.params["conv"])
    conv = np.stack([[sum(np.correlate(x[n, c, i + r], w[o, c, r], "valid") for c in range(3) for r in range(3))
                      for i in range(4)] for n in range(12) for o in range(2)]).reshape(12, 2, 4, 3)
    conv += b.reshape(1, 2, 1, 1)
    wi, bi = (p.data for p in net.params["ip"])
    ip = np.maximum(conv.reshape(12, -1) @ wi.T + bi, 0)
    close(net)
    dbs = [tmp_path / "conv_db", tmp_path / "ip_db"]
    assert extract_features.main([str(weights), str(proto), "conv,ip", ",".join(map(str, dbs)), "3",
                                  "lmdb"]) == 0
    for db, ref, chw in ((dbs[0], conv, (2, 4, 3)), (dbs[1], ip, (3, 1, 1))):
        records = lmdb_io.read_all(str(db))
        assert [k for k, _ in records] == [b"%010d" % i for i in range(12)]
        for i, (_, value) in enumerate(records):
            d = parse_datum(value)
            assert (d.channels, d.height, d.width) == chw and not d.data and not d.HasField("label")
            np.testing.assert_allclose(d.float_data, ref[i].ravel(), rtol=1e-5, atol=1e-6)


def test_extract_features_errors(small_db, tmp_path, capsys):
    from caffempi.tools import extract_features
    proto = tmp_path / "feat.prototxt"
    proto.write_text(FEATURE_NET % small_db[0])
    net = Net(str(proto), TEST)
    weights = tmp_path / "feat.caffemodel"
    net.save(str(weights))
    close(net)
    out = tmp_path / "out_db"
    for args, msg in (([ "fc7", str(out)], "Unknown feature blob name fc7 in the network"),
                      (["conv,ip", str(out)], "the number of blob names (2) and dataset names (1)"),
                      (["conv", small_db[0]], "database already exists")):
        assert extract_features.main([str(weights), str(proto)] + args + ["1", "lmdb"]) == 1
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    assert not out.exists()
