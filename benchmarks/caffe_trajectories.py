#!/usr/bin/env python
"""caffempi's training trajectories against BVLC Caffe's, solver by solver:
BVLC's LeNet and MNIST-autoencoder solvers (../shared/caffe-zoo) for 20
iterations on this checkout's MNIST LMDBs (`make demo` writes them), both
programs resuming the same iteration-0 snapshot, so they start from the
same weights and read the same records.

For each solver: Caffe writes the snapshot (``max_iter: 0``,
``random_seed: 1701``), then ``caffe train --snapshot`` and ``python -m
caffempi train --snapshot`` run 20 iterations with ``display: 1``; the
line gives the largest relative difference of the 21 losses, that of a
second caffempi run with ``CAFFEMPI_DIRECT_CONV=0`` (the GEMM kernels
only), and that of Caffe itself run again on another OpenBLAS core type
(Haswell's kernels instead of SkylakeX's, Sandybridge's instead of
Haswell's): another summation order in the same program.  A solver whose
Caffe runs differ from each other by more than the tolerance follows a
trajectory that the last bits of its sums decide (RMSProp at lr 0.01
diverges); it is reported as such and not held to the tolerance.
(brocolli-caffe's ``caffe train`` ignores ``--weights``, hence the
snapshot.)

    python benchmarks/caffe_trajectories.py --caffe PATH [--solvers a,b] [--keep DIR]

PATH: a ``caffe`` binary (benchmarks/build_caffe.sh); its runs get
OPENBLAS_CORETYPE for this CPU.  Exits 1 if the losses of a solver whose
Caffe runs agree differ from Caffe's by more than ``--tolerance`` (default
1e-3).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from net_speed import openblas_coretype  # noqa: E402
from trajectory import parse_log  # noqa: E402

ZOO = REPO.parent / "shared" / "caffe-zoo" / "bvlc" / "examples" / "mnist"
LMDBS = {"examples/mnist/mnist_train_lmdb": REPO / "examples/mnist/mnist_train_lmdb",
         "examples/mnist/mnist_test_lmdb": REPO / "examples/mnist/mnist_test_lmdb"}
SOLVERS = ("lenet_solver", "lenet_multistep_solver", "lenet_solver_adam", "lenet_adadelta_solver",
           "lenet_solver_rmsprop", "mnist_autoencoder_solver", "mnist_autoencoder_solver_adadelta",
           "mnist_autoencoder_solver_adagrad", "mnist_autoencoder_solver_nesterov")
ITERATIONS = 20
# Caffe's second run: the OpenBLAS kernels of an older core than this one's
OTHER_CORETYPE = {"SkylakeX": "Haswell", "Haswell": "Sandybridge"}


def solver_text(name, work, max_iter, prefix):
    """BVLC's solver ``name`` for ``max_iter`` iterations on the CPU, its
    net copied into ``work`` with this checkout's LMDBs, no tests, a loss
    line every iteration, no snapshots but the one after training where
    ``prefix`` asks for it."""
    text = (ZOO / (name + ".prototxt")).read_text()
    net = re.search(r'net: "(.*)"', text).group(1)
    net_path = work / Path(net).name
    if not net_path.exists():
        net_text = (ZOO / Path(net).name).read_text()
        for source, path in LMDBS.items():
            net_text = net_text.replace('"%s"' % source, '"%s"' % path)
        net_path.write_text(net_text)
    for pattern, value in ((r'net: ".*"', 'net: "%s"' % net_path), (r"test_iter: \d+\n", ""),
                           (r"test_state: \{[^}]*\}\n?", ""), (r"test_compute_loss: \w+\n", ""),
                           (r"test_interval: \d+", "test_interval: 1000000"), (r"display: \d+", "display: 1"),
                           (r"max_iter: \d+", "max_iter: %d" % max_iter), (r"snapshot: \d+", "snapshot: 0"),
                           (r'snapshot_prefix: ".*"', 'snapshot_prefix: "%s"' % (prefix or work / name)),
                           (r"solver_mode: GPU", "solver_mode: CPU")):
        text = re.sub(pattern, value, text)
    text += "\ntest_initialization: false\nsnapshot_after_train: %s\n" % ("true" if prefix else "false")
    return text + ("random_seed: 1701\n" if prefix else "")


def losses(log):
    """The loss of every iteration a log displays, in order."""
    return [loss for _, loss in parse_log(log)["loss"]]


def largest_relative(a, b):
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def run(cmd, env, cwd):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        sys.exit("%s failed:\n%s" % (" ".join(map(str, cmd)), p.stderr[-2000:]))
    return p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caffe", required=True, help="BVLC Caffe's caffe binary")
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--keep", help="a folder for the solvers, snapshots and logs (default: a temporary one)")
    args = ap.parse_args()
    if not ZOO.is_dir() or not all(p.exists() for p in LMDBS.values()):
        sys.exit("needs %s and the MNIST LMDBs of `make demo` in examples/mnist" % ZOO)
    base = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    coretype = openblas_coretype()
    caffe_env = dict(base, OPENBLAS_CORETYPE=coretype)
    other_env = dict(base, OPENBLAS_CORETYPE=OTHER_CORETYPE.get(coretype, "Sandybridge"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("%-36s %12s %12s %12s  Caffe's first losses" % ("solver", "ours", "GEMM only", "Caffe again"))
        worst = 0.0
        for name in args.solvers.split(","):
            init = work / (name + "_init.prototxt")
            init.write_text(solver_text(name, work, 0, work / ("init_" + name)))
            run([args.caffe, "train", "--solver=%s" % init], caffe_env, work)
            solver = work / (name + ".prototxt")
            solver.write_text(solver_text(name, work, ITERATIONS, None))
            resume = "--snapshot=%s" % (work / ("init_%s_iter_0.solverstate" % name))
            reference, again = (losses(run([args.caffe, "train", "--solver=%s" % solver, resume], env, work))
                                for env in (caffe_env, other_env))
            ours = [losses(run([sys.executable, "-m", "caffempi", "train", "--solver=%s" % solver, resume],
                               dict(base, CAFFEMPI_DIRECT_CONV=direct), REPO)) for direct in ("1", "0")]
            differences = [largest_relative(o, reference) for o in ours + [again]]
            stable = differences[2] <= args.tolerance
            if stable:
                worst = max(worst, differences[0])
            print("%-36s %12.2e %12.2e %12.2e  %s%s" % (
                name, *differences, " ".join("%.4g" % x for x in reference[:4]),
                "" if stable else "  (Caffe differs from itself: not judged)"), flush=True)
    sys.exit(1 if worst > args.tolerance else 0)


if __name__ == "__main__":
    main()
