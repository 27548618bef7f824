"""The GPU issue's device run in one call (issue 36): install what the GPU
machine lacks, record versions, run tests/gpu, time caffempi against
PyTorch, profile host against GPU time per layer; everything under $OUT.

Here, on a CPU machine, before a session's device call (needs the network
and ../shared/caffe-zoo):

    python benchmarks/device_check.py --prepare

downloads the wheels the device lacks for its Python (lmdb, mpich, protobuf
new enough for caffe_pb2, mpi4py) into .device_wheels/, copies the zoo
prototxts into .device_zoo/ (both ignored by git, carried by the call),
checks the carry's size and prints the exact `run` call.

On the GPU machine, as the session's first device call (standard library
only until the wheels are installed; Python there is the image's python3):

    PYTHONUNBUFFERED=1 python3 benchmarks/device_check.py

in this order, each step in its own time box and all inside --budget
seconds (default 450), so that what finished survives a step that hangs:
pip installs the carried wheels with --prefix (the mpich wheel keeps its
lib/libmpi.so.12 and bin/mpiexec there; MPI4PY_LIBMPI points at it);
versions.txt (python, numpy, cupy, CUDA runtime and driver, the GPU,
whether libcudnn.so.9 loads, NCCL, torch, protobuf, MPI); pytest tests/gpu;
gpu_speed.py --graph on LeNet and CIFAR10-quick in strict FP32 (caffempi
replaying CUDA graphs, rows marked r1g); benchmarks/gpu_speed.py per net
(ResNet-50, AlexNet, CIFAR10-quick, LeNet, ResNet-50 at batch 64) in strict
FP32; benchmarks/gpu_profile.py (per-layer host and GPU time) on ResNet-50
and AlexNet; gpu_speed.py in TF32; the profile of the small nets;
then further rounds of gpu_speed.py while the budget lasts (--rounds).
A step the budget cannot fit is written as 'skipped: budget'.

Without a GPU (CI, this machine):

    python benchmarks/device_check.py --dry-run [--out DIR]

goes through every step: no install (the wheels need not be there), the
versions file written for real, tests/gpu collected but not run, the nets'
prototxts checked, the profiler run on NumPy; each GPU part is a line
'skipped: no GPU'.

Files under $OUT (at most 8 come back from the device): summary.txt (also
printed last), versions.txt, install.log, tests_gpu.log, speed.log,
profile.log, results.json.
"""
import argparse
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".device_wheels"
ZOO_CARRY = REPO / ".device_zoo"
ZOO = ZOO_CARRY / "caffe-zoo"
SHARED_ZOO = REPO.parent / "shared" / "caffe-zoo"
CARRY = [".device_wheels", ".device_zoo"]
PREFIX = Path("/tmp/caffempi-device")

# What the GPU machine's image lacks (docs: .library/device/KINDS.md; issue 36):
# pinned to the versions the project's own environment runs.
PINS = ["lmdb==3.0.0", "mpich==5.0.2", "protobuf==7.36.2", "mpi4py==4.1.2"]
DEVICE_PYTHON = "3.12"          # the image's python3 is 3.12.3
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64"]
CARRY_LIMIT = 64 * 2 ** 20     # the working tree plus carried paths, per call

NETS = ["resnet50", "alexnet", "cifar", "lenet"]      # the order, ResNet-50 (worst) first
# and ResNet-50 at batch 64 too (the issue asks for 32 and 64), last: the
# first the budget drops
SPEED_NETS = NETS + ["resnet50:64"]
GRAPH_NETS = ("lenet", "cifar")    # the host-bound nets CUDA graphs are for
SPEED_BOX = {"resnet50": 100, "resnet50:64": 130, "alexnet": 80, "cifar": 50, "lenet": 50}
PROFILE_BOX = {"resnet50": 75, "alexnet": 60, "cifar": 40, "lenet": 40}
RUN_TIMEOUT = 480               # the run call's timeout_s: the budget plus margin
MIN_BOX = 15                    # a step with less time than this is skipped
RESERVE = 8                     # seconds kept for the summary

FILES = ("summary.txt", "versions.txt", "install.log", "tests_gpu.log", "speed.log",
         "profile.log", "results.json")


def run_call():
    """The device tool call that runs this script (for --prepare to print)."""
    return {"command": "PYTHONUNBUFFERED=1 python3 benchmarks/device_check.py",
            "carry": CARRY, "timeout_s": RUN_TIMEOUT}


# ---------------------------------------------------------------- prepare


def required_protobuf():
    m = re.search(r'"protobuf>=([0-9.]+)[,"]', (REPO / "setup.py").read_text())
    return m.group(1) if m else None


def _version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v))


def tree_bytes():
    """Bytes of what a device call sends besides the carried paths: tracked
    files and untracked files git does not ignore (plus shared/ if any)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for name in names:
        p = REPO / os.fsdecode(name)
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    shared = REPO / "shared"
    return total + (dir_bytes(shared) if shared.is_dir() else 0)


def code_digest():
    """The first 12 hex digits of a SHA-256 over the Python files of
    caffempi/ and benchmarks/ (names and contents, sorted): what a run
    measured, the same here and on the device, whose git metadata can be
    older than the working tree it was sent (``--digest`` prints it here)."""
    h = hashlib.sha256()
    for top in ("caffempi", "benchmarks"):
        for p in sorted((REPO / top).rglob("*.py")):
            if "__pycache__" not in p.parts:
                h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def copy_tree(src, dst):
    """Copy files only (the zoo is read-only; copies stay writable)."""
    if dst.exists():
        shutil.rmtree(dst)
    for root, _dirs, files in os.walk(src):
        target = dst / Path(root).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(os.path.join(root, f), target / f)


def prepare(args):
    need = required_protobuf()
    pinned = next(p.split("==")[1] for p in PINS if p.startswith("protobuf=="))
    if need and _version_tuple(pinned) < _version_tuple(need):
        sys.exit("protobuf pin %s is older than setup.py's >=%s: raise PINS" % (pinned, need))
    if not SHARED_ZOO.is_dir():
        sys.exit("%s is absent: the zoo prototxts cannot be copied" % SHARED_ZOO)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", args.python_version, "--implementation", "cp", "-d", tmp]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        print("$ " + " ".join(cmd + PINS), flush=True)
        subprocess.run(cmd + PINS, check=True)
        got = sorted(os.listdir(tmp))
        if len(got) != len(PINS):
            sys.exit("expected %d wheels, got %s" % (len(PINS), got))
        if WHEELS.exists():
            shutil.rmtree(WHEELS)            # one version of each: two stop the install
        WHEELS.mkdir()
        for name in got:
            shutil.move(os.path.join(tmp, name), WHEELS / name)
    copy_tree(SHARED_ZOO, ZOO)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    (ZOO_CARRY / "PREPARED").write_text(
        "commit: %s\ndate: %s\npython: %s\nwheels: %s\n"
        % (commit, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), args.python_version,
           " ".join(sorted(os.listdir(WHEELS)))))
    sizes = {p: dir_bytes(REPO / p) for p in CARRY}
    tree = tree_bytes()
    total = tree + sum(sizes.values())
    print("\nwheels in %s:" % WHEELS.relative_to(REPO))
    for name in sorted(os.listdir(WHEELS)):
        print("  %-80s %6.2f MiB" % (name, (WHEELS / name).stat().st_size / 2 ** 20))
    for p, n in sizes.items():
        print("carry %-16s %6.2f MiB" % (p, n / 2 ** 20))
    print("working tree     %6.2f MiB (tracked and untracked-not-ignored files)" % (tree / 2 ** 20))
    print("total            %6.2f MiB of %d MiB" % (total / 2 ** 20, CARRY_LIMIT // 2 ** 20))
    if total > CARRY_LIMIT:
        sys.exit("over the device call's limit")
    print("\nThe device call (the session's first, with a GPU):\n  run(%s)"
          % json.dumps(run_call()))
    return 0


# ---------------------------------------------------------------- versions


def versions_child(dry):
    """Print 'name: value' lines (run in a child with the installed
    environment); a probe that fails prints its error and the rest go on."""
    import ctypes
    import importlib.metadata as md
    import platform

    def probe(label, fn):
        try:
            value = fn()
        except BaseException as e:      # noqa: B902 -- a probe must not end the listing
            msg = str(e).strip().splitlines()
            value = "error: %s%s" % (type(e).__name__, (": " + msg[0][:200]) if msg else "")
        print("%s: %s" % (label, value), flush=True)

    def dist(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    def commit():
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip()
        prepared = ZOO_CARRY / "PREPARED"
        if prepared.exists():
            line = prepared.read_text().splitlines()[0]
            return "unknown (no git here); --prepare ran at %s" % line.split(": ", 1)[1]
        return "unknown (no git, no .device_zoo/PREPARED)"

    probe("date", lambda: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    probe("mode", lambda: "dry-run" if dry else "device")
    probe("caffempi commit", commit)
    probe("code digest", code_digest)
    probe("platform", lambda: "%s, %d CPUs" % (platform.platform(), os.cpu_count()))
    probe("python", lambda: "%s (%s)" % (sys.version.split()[0], sys.executable))
    probe("numpy", lambda: __import__("numpy").__version__)

    def caffempi_import():
        import caffempi
        return "ok (%s)" % os.path.dirname(caffempi.__file__)
    probe("caffempi", caffempi_import)

    def protobuf():
        from google import protobuf as pb
        importlib.import_module("caffempi.proto.caffe_pb2")     # refuses too old a runtime
        return "%s from %s (caffe_pb2 imports; setup.py needs >=%s)" % (
            pb.__version__, os.path.dirname(pb.__file__), required_protobuf())
    probe("protobuf", protobuf)
    probe("lmdb", lambda: __import__("lmdb").__version__)
    for name in ("h5py", "pillow", "llvmlite", "threadpoolctl", "pytest", "pytest-xdist",
                 "pytest-timeout"):
        probe(name, lambda name=name: dist(name))

    def llvm():
        from caffempi.backend import llvm as L
        return "CPU kernels compile" if L._native() is not None else "no (CPU kernels fall back)"
    probe("llvmlite kernels", llvm)

    def mpi():
        import mpi4py
        mpi4py.rc.initialize = False        # the library's name needs no MPI_Init
        from mpi4py import MPI
        lib = MPI.Get_library_version().strip().splitlines()[0]
        return "mpi4py %s (%s), library: %s" % (mpi4py.__version__, os.path.dirname(mpi4py.__file__), lib)
    probe("mpi", mpi)
    probe("MPI4PY_LIBMPI", lambda: os.environ.get("MPI4PY_LIBMPI", "unset"))

    def mpiexec():
        from caffempi.parallel.launch import mpiexec_path
        path = mpiexec_path()
        ours = shutil.which("mpiexec") or "none on PATH"
        note = ("" if dry or path == ours else
                " (NOT the first on PATH, %s: the MPI tests may pair another MPI with mpi4py's)" % ours)
        return "%s%s" % (path, note)
    probe("mpiexec", mpiexec)

    def cupy_version():
        import cupy
        return cupy.__version__
    probe("cupy", cupy_version)
    no_gpu = "skipped: no GPU"
    gpu = not dry and _gpu_visible()

    def cuda():
        import cupy
        rt = cupy.cuda.runtime
        return "runtime %d, driver %d" % (rt.runtimeGetVersion(), rt.driverGetVersion())

    def device():
        import cupy
        rt = cupy.cuda.runtime
        n = rt.getDeviceCount()
        p = rt.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        return "%d x %s, compute capability %d.%d, %.1f GiB, %d SMs" % (
            n, name, p["major"], p["minor"], p["totalGlobalMem"] / 2 ** 30, p["multiProcessorCount"])

    def smi():
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,"
                            "clocks.sm,clocks.max.sm,temperature.gpu,power.draw", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return (r.stdout.strip() or r.stderr.strip()).replace("\n", " | ")

    def cudnn_dlopen():
        # as caffempi does: the pip wheel's copy (its sub-libraries first), then the system's
        from caffempi.backend import cudnn
        errors = []
        for path in cudnn._library_paths():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return "loads (%s)" % path
            except OSError as e:
                errors.append(str(e).splitlines()[0])
        return "does not load: %s" % "; ".join(errors)

    def cudnn_caffempi():
        from caffempi.backend import cudnn
        v = cudnn.version()
        return "version %d, used for convolutions" % v if v else "not available (im2col + cuBLAS)"

    def nccl():
        from cupy.cuda import nccl as N
        if not N.available:
            return "not available in CuPy"
        from caffempi.pycaffe import nccl_transport_available
        return "available, version %s; caffempi's NCCL transport available: %s" % (
            N.get_version(), nccl_transport_available())

    def torch():
        import torch as T
        return "%s (CUDA %s, cuDNN %s, device %s)" % (
            T.__version__, T.version.cuda, T.backends.cudnn.version() if T.cuda.is_available() else "-",
            T.cuda.get_device_name(0) if T.cuda.is_available() else "none")

    probe("libcudnn.so.9", cudnn_dlopen)
    for label, fn in (("cuda", cuda), ("gpu", device), ("nvidia-smi", smi),
                      ("cudnn (caffempi)", cudnn_caffempi), ("nccl", nccl), ("torch", torch)):
        if gpu:
            probe(label, fn)
        else:
            print("%s: %s" % (label, no_gpu), flush=True)
    for var in sorted(os.environ):
        if var.startswith(("CAFFEMPI_", "CUPY_")) or var in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES"):
            print("env %s: %s" % (var, os.environ[var]))
    return 0


def _gpu_visible():
    """nvidia-smi lists a GPU (or, without nvidia-smi, a device node exists)."""
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            if r.returncode == 0 and "GPU" in r.stdout:
                return True
        except (OSError, subprocess.SubprocessError):
            pass
    return bool(glob.glob("/dev/nvidia[0-9]*"))


# ---------------------------------------------------------------- the run


class Steps:
    """Runs each step as a child process in its own session, output appended
    to a log under OUT, inside both its own time box and the budget."""

    def __init__(self, out, budget, env):
        self.out, self.env = out, env
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.results = []

    def elapsed(self):
        return time.monotonic() - self.start

    def note(self, name, status, seconds=0.0, detail=""):
        self.results.append({"step": name, "status": status, "seconds": round(seconds, 1),
                             "detail": detail})
        print("[%5.0fs] %-28s %-22s %6.1f s  %s" % (self.elapsed(), name, status, seconds, detail),
              flush=True)

    def run(self, name, cmd, log, box):
        """(status, output of this step); status is ok, failed (rc N),
        timeout (N s) or skipped: budget."""
        box = min(box, self.deadline - time.monotonic() - RESERVE)
        if box < MIN_BOX:
            self.note(name, "skipped: budget")
            return "skipped: budget", ""
        path = self.out / log
        with open(path, "a") as f:
            f.write("\n=== %s\n$ %s\n(time box %.0f s)\n"
                    % (name, " ".join(map(str, cmd)).replace("\n", "\\n"), box))
            f.flush()
            offset = f.tell()
            t = time.monotonic()
            proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=box)
                status = "ok" if rc == 0 else "failed (rc %d)" % rc
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                status = "timeout (%.0f s)" % box
            seconds = time.monotonic() - t
            f.write("\n(%s after %.1f s)\n" % (status, seconds))
        with open(path) as f:
            f.seek(offset)
            text = f.read()
        self.results.append({"step": name, "status": status, "seconds": round(seconds, 1), "detail": ""})
        print("[%5.0fs] %-28s %-22s %6.1f s" % (self.elapsed(), name, status, seconds), flush=True)
        return status, text


def _kill_group(proc):
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def installed_env(base):
    """The environment once the wheels are in PREFIX: its site-packages
    after the repository on PYTHONPATH, its bin first on PATH, mpi4py
    pointed at the mpich wheel's library."""
    env = dict(base)
    # pip's prefix scheme: PREFIX/lib/python3.X/site-packages (a venv's
    # python), else lib64, or Debian's local/lib/python3.X/dist-packages
    sites = sorted(p for pattern in ("lib*/python*/site-packages", "local/lib*/python*/dist-packages",
                                     "lib*/python*/dist-packages")
                   for p in glob.glob(str(PREFIX / pattern)))
    rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + sites + rest)
    bins = [os.path.dirname(p) for p in glob.glob(str(PREFIX / "**" / "bin" / "mpiexec"), recursive=True)]
    env["PATH"] = os.pathsep.join(bins + [str(PREFIX / "bin"), base.get("PATH", "")])
    if bins:         # the carried mpich's, whatever sits beside the device's Python
        env["CAFFEMPI_MPIEXEC"] = os.path.join(bins[0], "mpiexec")
    libmpi = sorted(glob.glob(str(PREFIX / "**" / "libmpi.so.12"), recursive=True), key=len)
    if libmpi:
        env["MPI4PY_LIBMPI"] = libmpi[0]
    return env


def pytest_summary(text):
    """pytest's final line, or counts of the progress lines it printed
    before a time box stopped it."""
    finals = re.findall(r"^=+ (.*(?:passed|failed|error|skipped|deselected|no tests ran|collected).*) =+$",
                        text, re.M)
    if finals:
        return finals[-1]
    collected = re.findall(r"^(\d+ tests? collected.*)$", text, re.M)   # --collect-only -q
    if collected:
        return collected[-1]
    counts = {}
    for line in text.splitlines():
        if "%]" in line:
            m = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return "partial (stopped): " + (", ".join("%d %s" % (n, k.lower()) for k, n in sorted(counts.items()))
                                    or "no results")


def speed_rows(text):
    """gpu_speed.py's table rows (after its 'Training images/s' header)
    and its failure lines."""
    rows, table = [], False
    for line in text.splitlines():
        if line.startswith("Training images/s"):
            table = True
        elif table and line.strip() and not line.strip().startswith(("net ", "(")):
            rows.append(line.rstrip())
        elif " failed: " in line:
            rows.append(line.strip())
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring and docs/gpu.md.")
    ap.add_argument("--prepare", action="store_true",
                    help="here (CPU, network): download the wheels, copy the zoo, print the run call")
    ap.add_argument("--python-version", default=DEVICE_PYTHON, help="the device's Python (for --prepare)")
    ap.add_argument("--dry-run", action="store_true", help="every step, GPU parts skipped; no install")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else /tmp/device_check_out)")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450)")
    ap.add_argument("--steps", default="install,versions,tests,graphs,speed,profile",
                    help="which steps (comma list)")
    ap.add_argument("--nets", default=",".join(SPEED_NETS), help="gpu_speed.py nets (key[:batch]), in order")
    ap.add_argument("--profile-nets", default=",".join(NETS), help="gpu_profile.py nets, in order")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of gpu_speed.py (strict FP32 and TF32 each)")
    ap.add_argument("--iterations", type=int, default=20, help="gpu_speed.py's timed steps")
    ap.add_argument("--tests-box", type=float, default=200, help="seconds for pytest tests/gpu")
    ap.add_argument("--pytest-workers", type=int, default=4, help="pytest-xdist workers (0: none)")
    ap.add_argument("--digest", action="store_true", help="print this checkout's code digest and exit")
    ap.add_argument("--versions-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.digest:
        print(code_digest())
        return 0
    if args.versions_child:
        return versions_child(args.dry_run)
    if args.prepare:
        return prepare(args)

    out = Path(args.out or os.environ.get("OUT") or "/tmp/device_check_out")
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    steps = set(args.steps.split(","))
    dry = args.dry_run
    gpu = not dry and _gpu_visible()
    no_gpu = "skipped: no GPU"
    zoo = ZOO if ZOO.is_dir() else SHARED_ZOO
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    base["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    run = Steps(out, args.budget, base)
    print("device_check: %s, budget %.0f s, OUT=%s, zoo=%s" % ("dry run" if dry else "device run",
                                                               args.budget, out, zoo), flush=True)
    tests_line, speed, profile_notes = "not run", [], []
    py = sys.executable

    # 1. install the carried wheels
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if "install" in steps:
        if dry:
            run.note("install", "skipped: dry run",
                     detail="would install: %s" % (", ".join("-".join(os.path.basename(w).split("-")[:2])
                                                             for w in wheels)
                                                   or "none carried (python benchmarks/device_check.py --prepare)"))
            (out / "install.log").write_text("dry run: nothing installed\n")
        elif not wheels:
            run.note("install", "failed", detail="no wheels in .device_wheels: run --prepare before the call")
        else:
            listing = [py, "-c", "import importlib.metadata as m\n"
                       "for n in ('lmdb','mpich','protobuf','mpi4py','numpy','cupy-cuda13x','torch','llvmlite'):\n"
                       "    try: print('before:', n, m.version(n))\n"
                       "    except m.PackageNotFoundError: print('before:', n, 'not installed')"]
            run.run("image packages", listing, "install.log", 30)
            run.run("install", [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                                "--no-cache-dir", "--ignore-installed", "--disable-pip-version-check",
                                "--prefix", PREFIX] + wheels, "install.log", 90)
            run.env = installed_env(base)
            with open(out / "install.log", "a") as f:
                f.write("\nPYTHONPATH=%s\nPATH=%s\nMPI4PY_LIBMPI=%s\n" % (
                    run.env["PYTHONPATH"], run.env["PATH"], run.env.get("MPI4PY_LIBMPI", "unset")))

    if not dry and "install" not in steps and PREFIX.is_dir():
        run.env = installed_env(base)       # a rerun on the same machine
    # 2. versions
    if "versions" in steps:
        run.run("versions", [py, __file__, "--versions-child"] + (["--dry-run"] if dry else []),
                "versions.txt", 60)

    # 3. tests/gpu
    if "tests" in steps:
        cmd = [py, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider"]
        if gpu:
            cmd += ["-v", "-rfEs"]
            if importlib.util.find_spec("pytest_timeout"):
                cmd += ["--timeout=150"]
            if args.pytest_workers and importlib.util.find_spec("xdist"):
                cmd += ["-n", str(args.pytest_workers)]
            status, text = run.run("tests/gpu", cmd, "tests_gpu.log", args.tests_box)
            tests_line = pytest_summary(text) if text else status
            failed = [ln for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
            tests_line += "".join("\n    " + ln[:160] for ln in failed[:25])
        else:
            status, text = run.run("tests/gpu (collect only)", cmd + ["--collect-only", "-q"],
                                   "tests_gpu.log", 60)
            with open(out / "tests_gpu.log", "a") as f:
                f.write("tests/gpu: %s\n" % no_gpu)
            tests_line = "%s (collection: %s)" % (no_gpu, pytest_summary(text) if text else status)
            run.note("tests/gpu", no_gpu)

    # 4. speed and profile, interleaved by priority
    def speed_step(key, tf32, rnd, layers, graph=False):
        label = "speed %s tf32=%d r%d%s" % (key, tf32, rnd, " graphs" if graph else "")
        cmd = [py, "benchmarks/gpu_speed.py", "--nets", key, "--tf32", str(tf32), "--zoo", zoo,
               "--iterations", str(args.iterations)] + (["--layers"] if layers else []) + \
            (["--graph"] if graph else [])
        if not gpu:
            with open(out / "speed.log", "a") as f:
                f.write("=== %s\n$ %s\n%s\n" % (label, " ".join(map(str, cmd)), no_gpu))
            run.note(label, no_gpu)
            return
        status, text = run.run(label, cmd, "speed.log", SPEED_BOX.get(key, 60))
        rows = speed_rows(text)
        speed.append({"net": key, "tf32": tf32, "round": rnd, "status": status, "rows": rows,
                      "graph": graph})

    def profile_step(key):
        label = "profile %s" % key
        if gpu:
            status, text = run.run(label, [py, "benchmarks/gpu_profile.py", "--nets", key, "--zoo", zoo],
                                   "profile.log", PROFILE_BOX.get(key, 60))
        else:
            # the profiler's host pass on NumPy, small: checks its code without a GPU
            status, text = run.run(label + " (NumPy, host only)",
                                   [py, "benchmarks/gpu_profile.py", "--cpu", "--nets", key, "--zoo", zoo,
                                    "--iterations", "1", "--batch", "2"], "profile.log", 60)
        keep = [ln for ln in text.splitlines()
                if ln.startswith(("== ", "step ", "forward+backward", "host synchronizations", "gpu: ")) or
                " failed: " in ln]
        profile_notes.append("%s: %s%s" % (label, status, "".join("\n    " + ln for ln in keep)))

    nets = [n for n in args.nets.split(",") if n]
    pnets = [n for n in args.profile_nets.split(",") if n]
    if "speed" in steps and not gpu:
        # the nets' prototxts resolve (the zoo carried or beside the checkout)
        check = [py, "-c", "import sys; sys.path.insert(0, 'benchmarks')\n"
                 "from bench_nets import net_param\n"
                 "for k in sys.argv[2].split(','):\n"
                 "    try:\n"
                 "        p, b = net_param(k, sys.argv[1])\n"
                 "        print('net %s: %d layers, batch %d' % (k, len(p.layer), b))\n"
                 "    except Exception as e:\n"
                 "        print('net %s: error: %s: %s' % (k, type(e).__name__, e))",
                 zoo, ",".join(nets)]
        status, text = run.run("speed nets build", check, "speed.log", 60)
        speed.append({"net": "all", "tf32": None, "round": 0, "status": status,
                      "rows": [ln for ln in text.splitlines() if ln.startswith("net ")]})
    if "graphs" in steps:
        # the small nets replayed as CUDA graphs (CAFFEMPI_CUDA_GRAPH), rows marked r1g
        for key in [n for n in nets if n in GRAPH_NETS]:
            speed_step(key, 0, 1, layers=False, graph=True)
    for rnd in range(1, max(1, args.rounds) + 1):
        for tf32 in (0, 1):
            if "speed" in steps:
                for key in nets:
                    speed_step(key, tf32, rnd, layers=(rnd == 1 and tf32 == 0))
            if rnd == 1 and "profile" in steps:
                # the big nets' profiles after strict FP32, the small nets' after TF32;
                # without a GPU, LeNet's host pass alone (fast on NumPy)
                for key in ((pnets[:2] if tf32 == 0 else pnets[2:]) if gpu else
                            (["lenet"] if tf32 == 0 else [])):
                    profile_step(key)
        if not gpu:
            break           # one round shows every step without a GPU

    # 5. summary
    summary = ["device_check %s: %s, %.0f s of a %.0f s budget, OUT=%s"
               % ("dry run" if dry else "device run", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  run.elapsed(), args.budget, out)]
    versions = {}
    if (out / "versions.txt").exists():
        for line in (out / "versions.txt").read_text().splitlines():
            if ": " in line and not line.startswith(("===", "$")):
                k, v = line.split(": ", 1)
                versions[k] = v
    summary.append("versions:")
    for k in ("caffempi commit", "code digest", "python", "numpy", "cupy", "cuda", "gpu", "libcudnn.so.9",
              "cudnn (caffempi)", "nccl", "torch", "protobuf", "mpi", "mpiexec"):
        summary.append("  %-17s %s" % (k + ":", versions.get(k, "?")))
    summary.append("steps:")
    for r in run.results:
        summary.append("  %-28s %-22s %6.1f s  %s" % (r["step"], r["status"], r["seconds"], r["detail"]))
    summary.append("tests/gpu: " + tests_line)
    summary.append("speed (training images/s; columns: net, batch, tf32, caffempi, PyTorch, ratio, "
                   "ours MB, torch MB):")
    for s in speed:
        for row in s["rows"] or ["(%s %s: %s, no rows)" % (s["net"], s["tf32"], s["status"])]:
            summary.append("  r%d%s %s" % (s["round"], "g" if s.get("graph") else "", row.strip()))
    if not speed:
        summary.append("  (not run)")
    summary.append("profile (per-layer table in profile.log):")
    summary.extend("  " + p for p in profile_notes or ["(not run)"])
    text = "\n".join(summary) + "\n"
    (out / "summary.txt").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"mode": "dry-run" if dry else "device", "gpu": gpu, "budget_s": args.budget,
         "elapsed_s": round(run.elapsed(), 1), "steps": run.results, "versions": versions,
         "tests_gpu": tests_line, "speed": speed, "profile": profile_notes}, indent=1))
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
