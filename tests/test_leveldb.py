"""LevelDB (data_param backend: LEVELDB) through plyvel: databases written by
our tools and by plyvel directly in Caffe's layout, read by the Data layer in
a Net (values, labels, sharding over ranks), training identical to an LMDB
copy, a second process holding the database, and the errors."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import CaffeError, Net, TEST
from caffempi.data import db
from caffempi.data.datum import array_to_datum, datum_to_array, parse_datum
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver
from caffempi.tools import (compute_image_mean, convert_cifar_data, convert_imageset, convert_mnist_data,
                            extract_features)

plyvel = pytest.importorskip("plyvel", reason="backend: LEVELDB needs plyvel (pip install plyvel)")


def write_caffe_leveldb(path, images, labels):
    """A LevelDB as Caffe's tools write one: keys %08d, serialized Datums,
    written with plyvel directly (not through caffempi)."""
    d = plyvel.DB(str(path), create_if_missing=True, error_if_exists=True)
    with d.write_batch() as batch:
        for i, (image, label) in enumerate(zip(images, labels)):
            datum = caffe_pb2.Datum(channels=image.shape[0], height=image.shape[1], width=image.shape[2],
                                    data=image.tobytes(), label=int(label))
            batch.put(b"%08d" % i, datum.SerializeToString())
    d.close()
    return str(path)


@pytest.fixture
def records():
    """11 records (not a multiple of 2: the reader wraps), 2x3x4 uint8."""
    rs = np.random.RandomState(0)
    return rs.randint(0, 256, (11, 2, 3, 4)).astype(np.uint8), rs.randint(0, 10, 11)


def data_net(source, batch, backend="LEVELDB", shard=(0, 1), phase=TEST, extra=""):
    backend_field = "backend: %s" % backend if backend else ""
    p = text_format.Parse('''layer { name: "d" type: "Data" top: "data" top: "label"
        data_param { source: "%s" batch_size: %d %s %s } }''' % (source, batch, backend_field, extra),
                          caffe_pb2.NetParameter())
    return Net(p, phase, data_shard=shard)


def batches(net, n):
    out = []
    for _ in range(n):
        net.forward()
        out.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
    return out


def close(net):
    for layer in net.layers:
        if hasattr(layer, "close"):
            layer.close()


def test_data_layer_reads_a_caffe_leveldb(tmp_path, records):
    images, labels = records
    source = write_caffe_leveldb(tmp_path / "caffe_leveldb", images, labels)
    for backend in ("LEVELDB", None):      # None: found from the directory's files
        net = data_net(source, 4, backend)
        got = batches(net, 3)                # 12 records: wraps after 11
        close(net)
        order = np.arange(12) % 11
        np.testing.assert_array_equal(np.concatenate([d for d, _ in got]), images[order].astype(np.float32))
        np.testing.assert_array_equal(np.concatenate([l for _, l in got]), labels[order])
    assert [k for k, _ in db.read_all(source)] == [b"%08d" % i for i in range(11)]


def test_tools_write_leveldb_as_caffe(tmp_path, records):
    from PIL import Image
    images, labels = records
    root = tmp_path / "imgs"
    root.mkdir()
    rs = np.random.RandomState(1)
    for i in range(3):
        Image.fromarray(rs.randint(0, 256, (5, 4, 3)).astype(np.uint8)).save(root / ("im%d.png" % i))
    (tmp_path / "list.txt").write_text("".join("im%d.png %d\n" % (i, labels[i]) for i in range(3)))
    out = str(tmp_path / "imageset_leveldb")
    assert convert_imageset.main([str(root) + "/", str(tmp_path / "list.txt"), out, "--backend=leveldb"]) == 0
    recs = db.read_all(out, "leveldb")
    assert [k for k, _ in recs] == [b"%08d_im%d.png" % (i, i) for i in range(3)]     # Caffe's keys
    lmdb_copy = str(tmp_path / "imageset_lmdb")
    assert convert_imageset.main([str(root) + "/", str(tmp_path / "list.txt"), lmdb_copy]) == 0
    assert db.read_all(lmdb_copy, "lmdb") == recs                       # the same Datums

    import struct
    flat = images[:, 0]                                                  # 11 x 3 x 4 "digits"
    (tmp_path / "i.idx").write_bytes(struct.pack(">iiii", 2051, 11, 3, 4) + flat.tobytes())
    (tmp_path / "l.idx").write_bytes(struct.pack(">ii", 2049, 11) + labels.astype(np.uint8).tobytes())
    mnist = str(tmp_path / "mnist_leveldb")
    assert convert_mnist_data.main([str(tmp_path / "i.idx"), str(tmp_path / "l.idx"), mnist,
                                    "--backend=leveldb"]) == 0
    caffe_made = write_caffe_leveldb(tmp_path / "by_plyvel", flat[:, None], labels)
    assert db.read_all(mnist, "leveldb") == db.read_all(caffe_made, "leveldb")     # byte for byte

    mean_file = str(tmp_path / "mean.binaryproto")
    assert compute_image_mean.main([mnist, mean_file, "--backend=leveldb"]) == 0
    bp = caffe_pb2.BlobProto()
    bp.ParseFromString(open(mean_file, "rb").read())
    np.testing.assert_array_equal(np.asarray(bp.data, np.float32).reshape(1, 3, 4),
                                  flat.astype(np.float32).sum(0)[None] / np.float32(11))


def test_convert_cifar_data_writes_leveldbs(tmp_path):
    rs = np.random.RandomState(4)
    src = tmp_path / "cifar"
    src.mkdir()
    for name in ["data_batch_%d.bin" % i for i in range(1, 6)] + ["test_batch.bin"]:
        (src / name).write_bytes(rs.randint(0, 256, (2, 3073)).astype(np.uint8).tobytes())
    convert_cifar_data.convert_dataset(str(src), str(tmp_path / "out"), "leveldb", batch_size=2)
    for name, n in (("cifar10_train_leveldb", 10), ("cifar10_test_leveldb", 2)):     # Caffe's names
        recs = db.read_all(tmp_path / "out" / name, "leveldb")
        assert [k for k, _ in recs] == [b"%05d" % i for i in range(n)]
    raw = (src / "test_batch.bin").read_bytes()
    d = parse_datum(recs[1][1])
    assert d.label == raw[3073] and d.data == raw[3074:2 * 3073]


def test_extract_features_into_leveldb(tmp_path, records):
    images, labels = records
    source = write_caffe_leveldb(tmp_path / "in_leveldb", images, labels)
    net = data_net(source, 4)
    out = str(tmp_path / "feat_leveldb")
    assert extract_features.extract_features(net, ["data"], [out], 2, "leveldb") == [8]
    close(net)
    recs = db.read_all(out, "leveldb")
    assert [k for k, _ in recs] == [b"%010d" % i for i in range(8)]
    np.testing.assert_array_equal(datum_to_array(parse_datum(recs[5][1])), images[5].astype(np.float32))


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharding_disjoint_and_complete(tmp_path, records, ranks):
    images, labels = records
    source = write_caffe_leveldb(tmp_path / "shard_leveldb", np.arange(11, dtype=np.uint8).reshape(11, 1, 1, 1),
                                 np.arange(11))
    b, iters = 2, 4
    one = data_net(source, b * ranks)
    single = batches(one, iters)
    close(one)
    shards = []
    for r in range(ranks):
        net = data_net(source, b, shard=(r, ranks))
        shards.append(batches(net, iters))
        close(net)
    for k in range(iters):
        want = (k * ranks * b + np.arange(ranks * b)) % 11
        np.testing.assert_array_equal(single[k][1], want)
        got = np.concatenate([shards[r][k][1] for r in range(ranks)])
        assert sorted(got) == sorted(want)                       # complete, and disjoint
        for r in range(ranks):
            np.testing.assert_array_equal(shards[r][k][1], want[r::ranks])
            np.testing.assert_array_equal(shards[r][k][0].reshape(-1), want[r::ranks])


TRAIN_NET = '''name: "tiny"
layer { name: "d" type: "Data" top: "data" top: "label"
        transform_param { scale: 0.01 mirror: true crop_size: 2 }
        data_param { source: "%s" batch_size: 4 backend: %s } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


def test_training_on_leveldb_and_lmdb_copies_gives_the_same_weights(tmp_path, records):
    images, labels = records
    leveldb_path = write_caffe_leveldb(tmp_path / "train_leveldb", images, labels)
    lmdb_path = str(tmp_path / "train_lmdb")
    with db.open_writer(lmdb_path, "lmdb") as w:
        for key, value in db.read_all(leveldb_path):
            w.put(key, value)
    weights = []
    for source, backend in ((leveldb_path, "LEVELDB"), (lmdb_path, "LMDB")):
        sp = text_format.Parse('base_lr: 0.1 lr_policy: "fixed" momentum: 0.9 max_iter: 5 random_seed: 5 '
                               'solver_mode: CPU', caffe_pb2.SolverParameter())
        sp.net_param.CopyFrom(text_format.Parse(TRAIN_NET % (source, backend), caffe_pb2.NetParameter()))
        solver = get_solver(sp)
        solver.step(5)
        weights.append([p.data.copy() for p in solver.net.params["ip"]])
        close(solver.net)
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(weights[0][1], np.zeros(10))       # it did train


def test_a_second_process_holding_the_leveldb(tmp_path, records):
    """LevelDB admits one process: an MPI rank finding it locked reads a
    private view (hard links beside it), removed on close."""
    images, labels = records
    source = write_caffe_leveldb(tmp_path / "held_leveldb", images, labels)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent('''
        import sys, plyvel
        d = plyvel.DB(sys.argv[1])
        print("open", flush=True)
        sys.stdin.read()
        ''') , source], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(plyvel.IOError, match="lock"):
            plyvel.DB(source)
        net = data_net(source, 11)
        (data, label), = batches(net, 1)
        np.testing.assert_array_equal(data, images.astype(np.float32))
        np.testing.assert_array_equal(label, labels)
        views = [p for p in tmp_path.iterdir() if p.name.startswith(".held_leveldb.view-")]
        assert len(views) == 1
        close(net)
        assert not views[0].exists()
    finally:
        holder.communicate("", timeout=10)
    assert holder.returncode == 0


def test_errors_name_the_source(tmp_path, records, monkeypatch):
    images, labels = records
    missing = str(tmp_path / "nowhere_leveldb")
    with pytest.raises(CaffeError, match=r"layer 'd' \(Data\): .*nowhere_leveldb: no such LevelDB database"):
        data_net(missing, 2)
    plain = tmp_path / "plain_dir"
    plain.mkdir()
    with pytest.raises(CaffeError, match=r"plain_dir: not a LevelDB database \(no CURRENT file"):
        data_net(str(plain), 2)
    assert list(plain.iterdir()) == []                     # nothing was created in it
    lmdb_path = str(tmp_path / "an_lmdb")
    with db.open_writer(lmdb_path, "lmdb") as w:
        w.put(b"0", array_to_datum(images[0], 1).SerializeToString())
    with pytest.raises(CaffeError, match="an_lmdb: not a LevelDB database .*it is an LMDB: backend: LMDB"):
        data_net(lmdb_path, 2)
    leveldb_path = write_caffe_leveldb(tmp_path / "a_leveldb", images, labels)
    with pytest.raises(CaffeError, match="a_leveldb: not an LMDB database .*it is a LevelDB: backend: LEVELDB"):
        data_net(leveldb_path, 2, "LMDB")
    empty = str(tmp_path / "empty_leveldb")
    db.open_writer(empty, "leveldb").close()
    with pytest.raises(CaffeError, match="empty_leveldb: the database is empty"):
        data_net(empty, 2)
    with pytest.raises(CaffeError, match="a_leveldb: database already exists"):
        db.open_writer(leveldb_path, "leveldb")
    bad = tmp_path / "bad_leveldb"
    write_caffe_leveldb(bad, images[:2], labels[:2])
    d = plyvel.DB(str(bad))
    d.put(b"00000001", b"\xff\xff\xff garbage")
    d.close()
    net = data_net(str(bad), 2)
    with pytest.raises(CaffeError, match="bad_leveldb key '00000001'"):
        net.forward()
    close(net)
    monkeypatch.setitem(sys.modules, "plyvel", None)          # as if not installed
    with pytest.raises(CaffeError, match=r"LEVELDB backend needs the 'plyvel' package \(pip install plyvel\)"):
        data_net(leveldb_path, 2)
    with pytest.raises(CaffeError, match="pip install plyvel"):
        convert_mnist_data.write_mnist_db(images[:, 0], labels, str(tmp_path / "new_leveldb"), backend="leveldb")
