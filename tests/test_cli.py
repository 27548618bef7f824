"""`python -m caffempi train|test` as a subprocess, with tiny prototxts."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from caffempi.cli import parse_args
from caffempi.common import CaffeError
from caffempi.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]

NET = """name: "cls"
layer { name: "data" type: "DummyData" top: "x" top: "label"
  dummy_data_param { shape { dim: 8 dim: 5 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """net: "net.prototxt"
base_lr: 0.1
lr_policy: "step" gamma: 0.5 stepsize: 2
momentum: 0.9
max_iter: 4
display: 1
test_iter: 2
test_interval: 2
snapshot: 2
snapshot_prefix: "snap"
random_seed: 5
solver_mode: CPU
"""


def caffempi(tmp_path, *args, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "caffempi"] + list(args), cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET % 3)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    return tmp_path


def assert_one_line_error(res, pattern):
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    errors = [l for l in res.stderr.splitlines() if l.startswith("caffempi: error: ")]
    assert len(errors) == 1, res.stderr
    assert re.search(pattern, errors[0]), errors[0]


def test_train_then_resume_gives_identical_weights(workdir):
    res = caffempi(workdir, "train", "--solver=solver.prototxt")
    assert res.returncode == 0, res.stderr
    assert "Optimization Done." in res.stderr
    assert "Snapshotting to binary proto file snap_iter_2.caffemodel" in res.stderr
    assert "Snapshotting solver state to binary proto file snap_iter_4.solverstate" in res.stderr
    straight = (workdir / "snap_iter_4.caffemodel").read_bytes()
    (workdir / "snap_iter_4.caffemodel").unlink()
    res = caffempi(workdir, "train", "-solver", "solver.prototxt", "--snapshot", "snap_iter_2.solverstate")
    assert res.returncode == 0, res.stderr
    assert "Resuming from snap_iter_2.solverstate" in res.stderr
    assert (workdir / "snap_iter_4.caffemodel").read_bytes() == straight


def test_test_command_output(workdir):
    assert caffempi(workdir, "train", "--solver", "solver.prototxt").returncode == 0
    res = caffempi(workdir, "test", "-model=net.prototxt", "-weights", "snap_iter_4.caffemodel",
                   "--iterations=3")
    assert res.returncode == 0, res.stderr
    err = res.stderr
    assert "Running for 3 iterations." in err
    for b in range(3):
        assert re.search(r"\] Batch %d, accuracy = [\d.]+\n" % b, err)
        assert re.search(r"\] Batch %d, loss = [\d.]+\n" % b, err)
    assert re.search(r"\] Loss: [\d.]+\n", err)
    assert re.search(r"\] accuracy = [\d.]+\n", err)
    m = re.search(r"\] loss = ([\d.]+) \(\* 1 = ([\d.]+) loss\)\n", err)
    assert m and m.group(1) == m.group(2)


def test_weights_finetune_and_shape_mismatch(workdir):
    assert caffempi(workdir, "train", "--solver=solver.prototxt").returncode == 0
    res = caffempi(workdir, "train", "--solver=solver.prototxt", "--weights=snap_iter_4.caffemodel")
    assert res.returncode == 0 and "Finetuning from snap_iter_4.caffemodel" in res.stderr
    (workdir / "net.prototxt").write_text(NET % 4)
    res = caffempi(workdir, "train", "--solver=solver.prototxt", "--weights=snap_iter_4.caffemodel")
    assert_one_line_error(res, r"layer 'ip'.*\(3, 5\).*\(4, 5\)")


@pytest.mark.parametrize("solver_text,args,pattern", [
    (None, ["train", "--solver=nope.prototxt"], "nope.prototxt does not exist"),
    ('net: "missing_net.prototxt" base_lr: 0.1 lr_policy: "fixed"', [], "missing_net.prototxt"),
    ('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" type: "Fancy"', [], "unknown solver type 'Fancy'"),
    ('net: "net.prototxt" base_lr: 0.1 lr_policy: "zigzag"', [], "unknown lr_policy 'zigzag'"),
    ('train_net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" test_iter: 2 test_interval: 2', [],
     "test_iter .*no test net"),
    ('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" bogus_field: 1', [], r"bogus_field"),
    (None, ["train", "--solver=solver.prototxt", "--bogus=1"], "unknown flag --bogus"),
    (None, ["train", "--solver=solver.prototxt", "--snapshot=x.solverstate", "--weights=y"], "not both"),
    (None, ["frobnicate"], "unknown command 'frobnicate'"),
    (None, ["train", "--sigint_effect=explode", "--solver=solver.prototxt"], "explode"),
    (None, ["test", "--model=net.prototxt"], "weights"),
])
def test_bad_input_is_one_clean_line(workdir, solver_text, args, pattern):
    if solver_text is not None:
        (workdir / "s.prototxt").write_text(solver_text)
        args = ["train", "--solver=s.prototxt"]
    assert_one_line_error(caffempi(workdir, *args), pattern)


def test_solverstate_with_missing_learned_net(workdir):
    state = caffe_pb2.SolverState(iter=2, learned_net="gone_iter_2.caffemodel")
    (workdir / "gone.solverstate").write_bytes(state.SerializeToString())
    res = caffempi(workdir, "train", "--solver=solver.prototxt", "--snapshot=gone.solverstate")
    assert_one_line_error(res, "learned_net gone_iter_2.caffemodel does not exist")
    res = caffempi(workdir, "train", "--solver=solver.prototxt", "--snapshot=gone.solverstate", "--debug")
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_flag_forms():
    for argv in (["train", "--solver=s", "--iterations=3"], ["train", "--solver", "s", "-iterations", "3"],
                 ["-solver=s", "train", "-iterations=3"]):
        cmd, flags = parse_args(argv)
        assert cmd == "train" and flags.solver == "s" and flags.iterations == 3
    assert parse_args(["test", "--debug"])[1].debug is True
    assert parse_args(["help"])[1].help is True
    with pytest.raises(CaffeError, match="needs a value"):
        parse_args(["train", "--solver"])
    with pytest.raises(CaffeError, match="invalid value for --iterations"):
        parse_args(["test", "--iterations=many"])


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_sighup_snapshots_and_sigint_stops(workdir):
    (workdir / "solver.prototxt").write_text(SOLVER.replace("max_iter: 4", "max_iter: 1000000")
                                             .replace("snapshot: 2", "snapshot: 0")
                                             .replace("test_interval: 2", "test_interval: 1000000"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.Popen([sys.executable, "-m", "caffempi", "train", "--solver=solver.prototxt"],
                            cwd=str(workdir), env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.time() + 30
    try:
        for line in proc.stderr:
            lines.append(line)
            if "Iteration 3 (" in line:
                break
            if time.time() > deadline:
                pytest.fail("no 'Iteration 3' line within 30 s:\n" + "".join(lines[-20:]))
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines) + rest
    assert proc.returncode == 0, err
    assert "Optimization stopped early." in err
    snaps = sorted(p.name for p in workdir.glob("snap_iter_*.solverstate"))
    assert len(snaps) == 2, snaps   # SIGHUP's, then the stop's (snapshot_after_train)


def test_gpu_flag_parsing_and_errors_without_a_gpu(monkeypatch):
    """--gpu's ids and its errors, shared by train/test/time, device_query and
    pycaffe's set_device; here as on a machine without CuPy."""
    from caffempi import backend
    from caffempi.cli import main
    assert backend.parse_gpu_ids("all", 3) == [0, 1, 2]
    assert backend.parse_gpu_ids("1,2", 3) == [1, 2]
    with pytest.raises(CaffeError, match="invalid --gpu value 'x'"):
        backend.parse_gpu_ids("x", 3)
    with pytest.raises(CaffeError, match="device_query: no GPU 4 \\(this host has 2\\)"):
        backend.check_device_id("device_query", 4, 2)
    monkeypatch.setattr(backend, "_cupy", False)
    for argv, what in ((["device_query", "--gpu=0"], "device_query"),
                       (["test", "--model=m.prototxt", "--weights=w.caffemodel", "--gpu=all"], "--gpu=all"),
                       (["train", "--solver=s.prototxt", "--gpu=all"], "--gpu=all")):     # ranks_to_launch
        with pytest.raises(CaffeError, match="%s: no usable GPU" % what):
            main(argv + ["--debug"])


def test_time_reads_only_the_timed_phases_data_layers(tmp_path):
    """As `caffe time`: timing TRAIN needs the TRAIN LMDB only; a TEST
    layer's missing source is not the timed net's business."""
    import numpy as np
    from caffempi.data import lmdb_io
    from caffempi.data.datum import array_to_datum
    with lmdb_io.LMDBWriter(str(tmp_path / "train_lmdb")) as w:
        for i in range(8):
            w.put("%08d" % i, array_to_datum(np.full((1, 4, 4), i, np.uint8), i % 3).SerializeToString())
    data = ('layer { name: "d" type: "Data" top: "x" top: "label" include { phase: %s }\n'
            '  data_param { source: "%s" backend: LMDB batch_size: 4 } }\n')
    (tmp_path / "net.prototxt").write_text(
        data % ("TRAIN", "train_lmdb") + data % ("TEST", "missing_test_lmdb") + NET.split("\n", 4)[4] % 3)
    res = caffempi(tmp_path, "time", "--model=net.prototxt", "--iterations=2")
    assert res.returncode == 0, res.stderr
    assert "Average Forward-Backward" in res.stderr
    assert "random input" not in res.stderr
    assert_one_line_error(caffempi(tmp_path, "time", "--model=net.prototxt", "--iterations=2", "--phase=TEST"),
                          "layer 'd': cannot read 'missing_test_lmdb'.*--data_shape")


# ------------------------------------------------- the solver's weights field
def caffemodel_blobs(path):
    p = caffe_pb2.NetParameter()
    p.ParseFromString(Path(path).read_bytes())
    return [list(b.data) for layer in p.layer for b in layer.blobs]


def test_solver_weights_field_as_caffe_train(workdir):
    """tools/caffe.cpp: the solver's weights: files are loaded in order;
    --weights replaces them; --snapshot ignores them.  With base_lr 0 and no
    momentum the final weights are the loaded ones."""
    assert caffempi(workdir, "train", "--solver=solver.prototxt").returncode == 0
    two, four = (caffemodel_blobs(workdir / ("snap_iter_%d.caffemodel" % i)) for i in (2, 4))
    assert two != four
    frozen = (SOLVER.replace("base_lr: 0.1", "base_lr: 0").replace("momentum: 0.9", "momentum: 0")
              .replace("max_iter: 4", "max_iter: 3").replace('"snap"', '"ft"'))
    cases = [('weights: "snap_iter_2.caffemodel"', [], ["snap_iter_2.caffemodel"], two),
             ('weights: "snap_iter_2.caffemodel" weights: "snap_iter_4.caffemodel"', [],
              ["snap_iter_2.caffemodel", "snap_iter_4.caffemodel"], four),
             ('weights: "snap_iter_4.caffemodel,snap_iter_2.caffemodel"', [],
              ["snap_iter_4.caffemodel", "snap_iter_2.caffemodel"], two),
             ('weights: "snap_iter_2.caffemodel"', ["--weights=snap_iter_4.caffemodel"],
              ["snap_iter_4.caffemodel"], four),
             ('weights: "snap_iter_4.caffemodel"', ["--snapshot=snap_iter_2.solverstate"], [], two)]
    for field, args, loaded, want in cases:
        (workdir / "ft.prototxt").write_text(frozen + field + "\n")
        res = caffempi(workdir, "train", "--solver=ft.prototxt", *args)
        assert res.returncode == 0, res.stderr
        assert re.findall(r"\] Finetuning from (\S+)\n", res.stderr) == loaded, (field, args)
        assert caffemodel_blobs(workdir / "ft_iter_3.caffemodel") == want, (field, args)
    (workdir / "ft.prototxt").write_text(frozen + 'weights: "missing.caffemodel"\n')
    assert_one_line_error(caffempi(workdir, "train", "--solver=ft.prototxt"),
                          "weights file missing.caffemodel does not exist")


# ------------------------------------------------------ flagfile, glog flags
def test_flagfile_and_log_dir(workdir):
    """Flags from a flagfile; the log written to --log_dir under glog's
    names, with stderr holding only ERROR and up (--alsologtostderr=false),
    and parse_log reading the file."""
    from caffempi.tools.parse_log import parse_log
    (workdir / "logs").mkdir()
    (workdir / "train.flags").write_text("# how we train\n--solver=solver.prototxt\n--log_dir=logs\n"
                                         "--noalsologtostderr\n")
    res = caffempi(workdir, "train", "--flagfile=train.flags")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    link = workdir / "logs" / "caffempi.INFO"
    assert re.fullmatch(r"caffempi\.[^.]+.*\.log\.INFO\.\d{8}-\d{6}\.\d+", os.readlink(link))
    text = link.read_text()
    assert "Optimization Done." in text and "Snapshotting to binary proto file snap_iter_4.caffemodel" in text
    train, test = parse_log(str(link))
    assert [r["NumIters"] for r in train] == [0, 1, 2, 3] and [r["NumIters"] for r in test] == [0, 2, 4]
    res = caffempi(workdir, "test", "--model=net.prototxt", "--weights=snap_iter_4.caffemodel", "--iterations=1",
                   "--minloglevel=1")
    assert res.returncode == 0 and res.stderr == "", res.stderr


# ------------------------------------------------------ --ranks, --gpu lists
def unset_launcher_env(monkeypatch):
    """As if started without mpiexec: no launcher's variables."""
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMIX_SIZE",
                "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)


def test_ranks_to_launch_without_and_under_a_launcher(monkeypatch):
    from caffempi.config import using_config
    from caffempi.parallel.launch import ranks_to_launch
    unset_launcher_env(monkeypatch)
    with using_config(mpi=None):
        assert [ranks_to_launch(r, g) for r, g in ((0, ""), (1, ""), (3, ""), (0, "0,1,2"), (0, "2"),
                                                   (2, "0,1,2,3"), (1, "0,1"))] == [0, 0, 3, 3, 0, 2, 0]
        with pytest.raises(CaffeError, match="--ranks=-1"):
            ranks_to_launch(-1, "")
        monkeypatch.setenv("PMI_SIZE", "2")
        monkeypatch.setenv("PMI_RANK", "0")
        assert ranks_to_launch(2, "") == 0 and ranks_to_launch(0, "0,1") == 0     # started already
    monkeypatch.delenv("PMI_SIZE")
    with using_config(mpi=False):
        with pytest.raises(CaffeError, match="CAFFEMPI_MPI=0"):
            ranks_to_launch(0, "0,1")


def test_ranks_relaunch_command_and_errors(monkeypatch, capsys):
    """--ranks and a --gpu list take the same path: the command line less
    --ranks, run under mpiexec; without an mpiexec, one clear line."""
    from caffempi.cli import main
    from caffempi.config import using_config
    from caffempi.parallel import launch
    monkeypatch.delenv("PMI_SIZE", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    calls = []
    real_run = launch.run_under_mpiexec
    monkeypatch.setattr(launch, "run_under_mpiexec", lambda n, cmd: calls.append((n, cmd)) or 7)
    with using_config(mpi=None):
        assert main(["train", "-ranks", "3", "--solver=s.prototxt", "--sigterm_effect=stop"]) == 7
        assert main(["train", "--gpu=4,5", "--solver=s.prototxt"]) == 7
        assert calls == [(3, [sys.executable, "-m", "caffempi", "train", "--solver=s.prototxt",
                              "--sigterm_effect=stop"]),
                         (2, [sys.executable, "-m", "caffempi", "train", "--gpu=4,5", "--solver=s.prototxt"])]
        monkeypatch.setattr(launch, "run_under_mpiexec", real_run)
        monkeypatch.setattr(launch, "mpiexec_path", lambda: None)
        assert main(["train", "--ranks=2", "--solver=s.prototxt"]) == 1
        assert main(["time", "--ranks=2", "--model=m.prototxt"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("caffempi: error: 2 ranks need mpiexec: none beside ")
    assert err[1] == "caffempi: error: --ranks=2: 'time' runs on one process (--ranks is for train)"


class FakeCupy:
    """Just what --gpu needs of CuPy: a device count and Device(i).use()."""

    def __init__(self, count):
        import types
        self.used = []
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: count),
            Device=lambda i: types.SimpleNamespace(use=lambda: self.used.append(i)))


def test_gpu_all_launches_one_rank_per_device_and_each_rank_takes_its_own(monkeypatch):
    """--gpu=all without a launcher: one rank per device of this host; under
    the launcher each rank uses the GPU of its local rank (the list's entry,
    round robin; a single id: every rank on it).  CuPy faked with 4 devices."""
    import types
    from caffempi import backend
    from caffempi.cli import main, select_backend
    from caffempi.config import using_config
    from caffempi.parallel import launch
    unset_launcher_env(monkeypatch)
    cupy = FakeCupy(4)
    monkeypatch.setattr(backend, "_cupy", cupy)
    calls = []
    monkeypatch.setattr(launch, "run_under_mpiexec", lambda n, cmd: calls.append((n, cmd)) or 0)
    with using_config(mpi=None):
        assert launch.ranks_to_launch(0, "all") == 4
        assert main(["train", "--gpu=all", "--solver=s.prototxt"]) == 0
    assert calls == [(4, [sys.executable, "-m", "caffempi", "train", "--gpu=all", "--solver=s.prototxt"])]

    def devices(gpu, ranks):
        cupy.used.clear()
        for r in range(ranks):
            world = types.SimpleNamespace(local_rank=lambda r=r: (r, ranks))
            assert select_backend(types.SimpleNamespace(gpu=gpu), None, world) is cupy
        return list(cupy.used)
    assert devices("all", 4) == [0, 1, 2, 3]
    assert devices("2,3", 3) == [2, 3, 2]
    assert devices("1", 2) == [1, 1]
    with pytest.raises(CaffeError, match=r"--gpu=0,7: no GPU 7 \(this host has 4\)"):
        devices("0,7", 2)


def test_caffempi_mpiexec_names_the_launcher():
    """CAFFEMPI_MPIEXEC (a path, or a name on PATH) wins over the mpiexec
    beside this Python: a machine whose Python sits beside another MPI's."""
    import shutil
    from caffempi.config import Config, using_config
    from caffempi.parallel import launch
    assert Config({"CAFFEMPI_MPIEXEC": " /opt/mpi/bin/mpiexec "}).mpiexec == "/opt/mpi/bin/mpiexec"
    assert Config({}).mpiexec is None
    with using_config(mpiexec="/opt/mpi/bin/mpiexec"):
        assert launch.mpiexec_path() == "/opt/mpi/bin/mpiexec"
    with using_config(mpiexec="sh"):
        assert launch.mpiexec_path() == shutil.which("sh")
    with using_config(mpiexec=None):
        assert launch.mpiexec_path() != "/opt/mpi/bin/mpiexec"
