"""benchmarks/device_check.py, the GPU issue's one device call, checked
without a GPU: its dry run goes through every step (no install, the carried
wheels need not be there) and writes the files a device run writes; and
gpu_profile.py's GPU pass, driven by a fake timer on NumPy."""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device_check.py"


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_every_file(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget", "120"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("summary.txt", "versions.txt", "install.log", "tests_gpu.log", "speed.log",
                 "profile.log", "results.json"):
        assert (out / name).is_file(), name
    assert len(list(out.iterdir())) <= 8            # what comes back from the device

    versions = (out / "versions.txt").read_text()
    for line in ("mode: dry-run", "python: %d.%d" % sys.version_info[:2], "numpy: ", "protobuf: ",
                 "caffempi: ok", "libcudnn.so.9: ", "gpu: skipped: no GPU", "cuda: skipped: no GPU",
                 "nccl: skipped: no GPU", "torch: skipped: no GPU"):
        assert line in versions, line

    summary = (out / "summary.txt").read_text()
    assert p.stdout.rstrip().endswith(summary.rstrip())     # printed last: the reply's output tail
    digest = subprocess.run([sys.executable, str(SCRIPT), "--digest"], cwd=REPO, capture_output=True,
                            text=True, timeout=60).stdout.strip()
    assert len(digest) == 12 and "code digest:      %s" % digest in summary
    assert "install                      skipped: dry run" in summary
    assert "tests/gpu: skipped: no GPU (collection: " in summary
    assert "tests collected" in summary             # tests/gpu imports and collects
    assert "profile lenet (NumPy, host only)" in summary
    assert "gpu: skipped: no GPU" in (out / "profile.log").read_text()

    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "dry-run" and results["gpu"] is False
    statuses = {r["step"]: r["status"] for r in results["steps"]}
    for net in ("resnet50", "alexnet", "cifar", "lenet"):
        for tf32 in (0, 1):
            assert statuses["speed %s tf32=%d r1" % (net, tf32)] == "skipped: no GPU"
            assert "speed %s tf32=%d r1" % (net, tf32) in summary
    assert statuses["tests/gpu"] == "skipped: no GPU"
    assert not [s for s in statuses.values() if "budget" in s or "timeout" in s or "failed" in s]
    assert statuses["versions"] == "ok"
    assert statuses["tests/gpu (collect only)"] == "ok"
    assert statuses["profile lenet (NumPy, host only)"] == "ok"
    assert statuses["speed nets build"] == "ok"


def test_speed_rows_and_pytest_summary():
    dc = load("device_check")
    row = "  ResNet-50          32     0        327.0        647.0     0.51          900         800"
    text = ("caffempi AlexNet tf32=0 failed: boom\n\nTraining images/s (forward, backward, SGD update), one GPU\n"
            "  net             batch  tf32     caffempi      PyTorch    ratio      ours MB     torch MB\n"
            + row + "\n\n(ok after 40.0 s)\n")
    assert dc.speed_rows(text) == ["caffempi AlexNet tf32=0 failed: boom", row]
    assert dc.pytest_summary("x\n===== 3 passed, 1 failed in 2.00s =====\n") == "3 passed, 1 failed in 2.00s"
    partial = ("[gw0] [ 10%] PASSED tests/gpu/a.py::t1\n[gw1] [ 20%] FAILED tests/gpu/a.py::t2\n"
               "tests/gpu/b.py::t3 PASSED [ 30%]\n")
    assert dc.pytest_summary(partial) == "partial (stopped): 1 failed, 2 passed"


def test_run_call_fits_the_device_tool():
    call = load("device_check").run_call()
    assert len(call["command"]) <= 2000 and len(call["carry"]) <= 8
    assert 0 < call["timeout_s"] <= 600
    ignored = subprocess.run(["git", "check-ignore"] + call["carry"], cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout.split() == call["carry"]       # carried, never committed


class FakeTimer:
    """The host clock standing in for CUDA events: 'GPU time' is then the
    host time of each call, enough to check the pass's bookkeeping."""

    class Event:
        def record(self):
            self.t = time.perf_counter()

    def spin(self, ns):
        assert ns > 0

    def event(self):
        return self.Event()

    def elapsed(self, start, end):
        return (end.t - start.t) * 1e3

    def synchronize(self):
        pass


class SteadyClock:
    """perf_counter advancing 1 us a reading: the pass's bookkeeping without
    the host's timing (a call slowed by a busy host past its spin budget
    would read as a synchronization)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1e-6
        return self.now


def test_profile_gpu_pass_bookkeeping(capsys, monkeypatch):
    gp = load("gpu_profile")
    monkeypatch.setattr(gp, "time", SteadyClock())
    solver, batch = gp.build("lenet", gp.ZOO, np, batch=2)
    r = gp.profile(solver, 2, FakeTimer())
    n = len(solver.net.layers)
    assert len(r["calls"]) == 2 * n and r["gpu"].shape == r["host"].shape == (2 * n,)
    assert np.all(r["gpu"] >= 0) and np.all(r["host"] >= 0) and r["step_ms"] > 0
    assert not r["sync"].any()              # no spin holds the host: nothing outlasts it
    gp.report("lenet", batch, solver.net, r)
    text = capsys.readouterr().out
    assert "host synchronizations (calls that outlasted their spin): none" in text
    assert "Convolution" in text and "skipped: no GPU" not in text
    assert "forward_backward" in text and r["pass_ms"] > 0 and r["update_ms"] > 0


def test_profile_times_a_fused_chain_as_one_call():
    """ResNet's BatchNorm → Scale → ReLU: one forward call on the
    BatchNorm, one backward call on the ReLU, the Scale's own calls gone;
    every layer in one forward call."""
    from google.protobuf import text_format
    from caffempi.common import TRAIN
    from caffempi.net import Net
    from caffempi.proto import caffe_pb2
    gp = load("gpu_profile")
    text = """layer { name: "in" type: "Input" top: "x" top: "t"
            input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } shape { dim: 2 dim: 2 } } }
    layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 4 kernel_size: 1 } }
    layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" }
    layer { name: "sc" type: "Scale" bottom: "c" top: "c" }
    layer { name: "r" type: "ReLU" bottom: "c" top: "c" }
    layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 2 } }
    layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "l" }"""
    net = Net(text_format.Merge(text, caffe_pb2.NetParameter()), TRAIN)
    spans = gp.units(net)
    bn, sc, relu = (net.layer_names.index(n) for n in ("bn", "sc", "r"))
    assert spans["F", bn] == (bn, relu) and spans["B", relu] == (bn, relu)
    assert ("F", sc) not in spans and ("B", sc) not in spans and ("B", bn) not in spans
    forward = [i for kind, i in spans if kind == "F"]
    assert forward == sorted(forward)
    covered = [j for (kind, _), (a, b) in spans.items() if kind == "F" for j in range(a, b + 1)]
    assert covered == list(range(len(net.layers)))
    # each unit runs its layers: the chain's backward gives the Scale its gradient
    rs = np.random.RandomState(0)
    for name in ("x", "t"):
        net.blobs[name].data[...] = rs.randn(*net.blobs[name].shape)
    for name in ("c", "ip"):
        net.params[name][0].data[...] = rs.randn(*net.params[name][0].shape)
    for kind, i in spans:
        if kind == "F":
            gp.run_unit(net, kind, spans[kind, i])
    net.clear_param_diffs()
    for kind, i in spans:                   # backward units: from the last layer down
        if kind == "B" and i >= relu:
            gp.run_unit(net, kind, spans[kind, i])
    assert np.abs(net.params["sc"][0].diff).max() > 0


def test_budget_skips_and_time_box_kills_the_group(tmp_path):
    dc = load("device_check")
    steps = dc.Steps(tmp_path, budget=dc.RESERVE + dc.MIN_BOX - 1, env=dict(__import__("os").environ))
    assert steps.run("late", [sys.executable, "-c", "pass"], "x.log", 60) == ("skipped: budget", "")
    # a child that starts a grandchild: the whole group goes at the time box
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                             "subprocess.Popen(['sleep', '60']); time.sleep(60)"], start_new_session=True)
    time.sleep(0.3)
    t = time.monotonic()
    dc._kill_group(proc)
    assert proc.poll() is not None and time.monotonic() - t < 5
    time.sleep(0.2)
    if Path("/proc").is_dir():
        assert live_in_group(proc.pid) == []


def live_in_group(pgid):
    """Processes of the group that are not zombies (an orphan may wait for
    a reaper), from /proc."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(stat.parent.name)
    return live
