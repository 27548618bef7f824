"""caffempi against BVLC Caffe on this machine, at the same moment: `caffe
time` and `caffempi time` on the same train_test prototxts (models/), reading
the same LMDBs, alternating run by run, at 1 and 2 BLAS threads.

    python benchmarks/caffe_reference.py --caffe PATH [--threads 1,2]
        [--rounds 3] [--iterations 50] [--nets lenet,cifar]

PATH is a BVLC Caffe `caffe` binary built for the CPU with OpenBLAS
(benchmarks/build_caffe.sh builds one from BVLC's sources); its runs get
OPENBLAS_CORETYPE for this CPU (net_speed.openblas_coretype).  Without a
Data layer, on more nets and against PyTorch too: benchmarks/net_speed.py.  Both tools time
the TRAIN net layer by layer, data layer included, and print "Average
Forward-Backward" per iteration; this prints the median and the best of the
rounds for each, Caffe's median over ours, and both per-layer tables.  The LMDBs hold random images
of the nets' sizes (LeNet 1x28x28, batch 64; CIFAR10-quick 3x32x32 with
their mean file, batch 100): GEMM time does not depend on the values.  The
host's speed drifts by +-20% over minutes, so only the runs of one
invocation compare.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from net_speed import openblas_coretype  # noqa: E402

# Debian's OpenBLAS 0.3.21 takes some virtual CPUs for a Prescott (20
# instead of 134 GFLOP/s sgemm on an AVX-512 Xeon): Caffe's runs are told
# the core type, and the header says which.
CORETYPE = openblas_coretype()

NETS = {
    "lenet": ("LeNet", "models/mnist/lenet_train_test.prototxt"),
    "cifar": ("CIFAR10-quick", "models/cifar10/cifar10_quick_train_test.prototxt"),
}
AVERAGE = re.compile(r"Average Forward-Backward: ([0-9.]+) ms")
LAYER = re.compile(r"\]\s+(\S+)\s+(forward|backward): ([0-9.]+) ms")   # the same lines in both


def make_data(root):
    """The LMDBs and mean file that the two train_test prototxts name,
    relative to ``root`` (both tools run with it as working directory)."""
    from caffempi.data.transformer import mean_to_blob_proto
    from caffempi.io import proto_io
    from caffempi.testing.datasets import random_datum_lmdb
    from caffempi.tools.compute_image_mean import compute_mean
    for d in ("mnist", "cifar10"):
        (root / "examples" / d).mkdir(parents=True, exist_ok=True)
    random_datum_lmdb(root / "examples/mnist/mnist_train_lmdb", (1, 28, 28), 640)
    cifar = root / "examples/cifar10/cifar10_train_lmdb"
    random_datum_lmdb(cifar, (3, 32, 32), 1000, seed=1)
    proto_io.write_binary_proto_atomic(str(root / "examples/cifar10/mean.binaryproto"),
                                       mean_to_blob_proto(compute_mean(str(cifar))))


def run_time(command, root, threads):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if command[0] != sys.executable and CORETYPE:
        env["OPENBLAS_CORETYPE"] = CORETYPE     # Caffe's (Debian's) OpenBLAS only
    p = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    log = p.stdout + p.stderr
    found = AVERAGE.findall(log)
    if p.returncode or not found:
        sys.exit("%s failed (exit %d):\n%s" % (" ".join(command), p.returncode, log[-3000:]))
    layers = {}
    for name, direction, ms in LAYER.findall(log):
        layers.setdefault(name, {})[direction] = float(ms)
    return float(found[-1]), layers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caffe", required=True, help="path of BVLC Caffe's caffe binary")
    ap.add_argument("--nets", default="lenet,cifar")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=50)
    args = ap.parse_args()
    caffe = shutil.which(args.caffe) or args.caffe
    if not os.access(caffe, os.X_OK):
        sys.exit("no Caffe binary at %s (benchmarks/build_caffe.sh builds one)" % args.caffe)
    nets = args.nets.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_data(root)
        for key in nets:
            name, model = NETS[key]
            shutil.copy(REPO / model, root / Path(model).name)
            for t in threads:
                times = {"caffe": [], "caffempi": []}
                layers = {"caffe": [], "caffempi": []}
                for r in range(args.rounds):
                    # alternate which goes first, so a drift in the host's
                    # speed does not favour one
                    order = ["caffe", "caffempi"] if r % 2 == 0 else ["caffempi", "caffe"]
                    for tool in order:
                        if tool == "caffe":
                            cmd = [caffe, "time", "-model", Path(model).name, "-iterations", str(args.iterations)]
                        else:
                            cmd = [sys.executable, "-m", "caffempi", "time", "--model=" + Path(model).name,
                                   "--iterations=%d" % args.iterations]
                        total, per_layer = run_time(cmd, root, t)
                        times[tool].append(total)
                        layers[tool].append(per_layer)
                        print("  %-14s %d thread(s)  %-8s %8.2f ms" % (name, t, tool, times[tool][-1]), flush=True)
                rows.append((name, t, times, layers))
    print("\nForward-backward ms per iteration (`time`, TRAIN net with its data layer), %d rounds of %d iterations%s"
          % (args.rounds, args.iterations, "; Caffe with OPENBLAS_CORETYPE=%s" % CORETYPE if CORETYPE else ""))
    print("  %-14s %7s %13s %13s %15s %15s %13s" % ("net", "threads", "Caffe median", "Caffe best",
                                                   "caffempi median", "caffempi best", "Caffe / ours"))
    for name, t, times, _ in rows:
        c, o = statistics.median(times["caffe"]), statistics.median(times["caffempi"])
        print("  %-14s %7d %13.2f %13.2f %15.2f %15.2f %13.2f" % (
            name, t, c, min(times["caffe"]), o, min(times["caffempi"]), c / o))
    for name, t, _, layers in rows:
        print("\n%s, %d thread(s): per layer, median ms over the rounds" % (name, t))
        print("  %-10s %13s %13s %15s %15s" % ("layer", "Caffe fwd", "Caffe bwd", "caffempi fwd", "caffempi bwd"))
        for layer in layers["caffe"][0]:
            cells = [statistics.median(run.get(layer, {}).get(d, float("nan")) for run in layers[tool])
                     for tool in ("caffe", "caffempi") for d in ("forward", "backward")]
            print("  %-10s %13.3f %13.3f %15.3f %15.3f" % ((layer,) + tuple(cells)))


if __name__ == "__main__":
    main()
