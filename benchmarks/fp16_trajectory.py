#!/usr/bin/env python
"""LeNet on 2 MPI ranks with float32 and with float16 communication
(--comm_dtype=fp16), the same solver, data and seed: the training loss at
every display line and the test accuracy of both, side by side.

    .venv/bin/python benchmarks/fp16_trajectory.py                # 500 iterations, the demo data
    .venv/bin/python benchmarks/fp16_trajectory.py --iters 2000

Data: examples/mnist's LMDBs (tools/make_demo_data.py makes the 4,000/1,000
real digits `make demo` uses when they are missing).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from caffempi.parallel.launch import mpiexec_path  # noqa: E402


def train(dtype, iters, workdir, sfb):
    solver = (REPO / "models/mnist/lenet_demo_solver.prototxt").read_text()
    solver = re.sub(r"max_iter: \d+", "max_iter: %d" % iters, solver)
    solver = re.sub(r'snapshot_prefix: "[^"]*"', 'snapshot_prefix: "%s/%s"' % (workdir, dtype), solver)
    path = Path(workdir) / ("solver_%s.prototxt" % dtype)
    path.write_text(solver)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run([mpiexec_path() or "mpiexec", "-n", "2", sys.executable, "-m", "caffempi", "train",
                        "--solver=%s" % path, "--comm=overlap", "--sfb=%s" % sfb, "--comm_dtype=%s" % dtype],
                       cwd=str(REPO), env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit("training with %s failed:\n%s" % (dtype, p.stderr[-3000:]))
    losses = [(int(m.group(1)), float(m.group(2)))
              for m in re.finditer(r"Iteration (\d+) \([^)]*\), loss = (\S+)", p.stderr)]
    acc = [float(m.group(1)) for m in re.finditer(r"Test net output #\d+: accuracy = (\S+)", p.stderr)]
    return losses, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--sfb", default="off")
    a = ap.parse_args()
    if not (REPO / "examples/mnist/mnist_train_lmdb").exists():
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out", "examples/mnist"], cwd=str(REPO),
                       check=True)
    with tempfile.TemporaryDirectory() as d:
        runs = {dtype: train(dtype, a.iters, d, a.sfb) for dtype in ("fp32", "fp16")}
    (l32, acc32), (l16, acc16) = runs["fp32"], runs["fp16"]
    print("LeNet, 2 ranks, --comm=overlap --sfb=%s: smoothed training loss at each display line" % a.sfb)
    print("%9s %10s %10s %10s" % ("iteration", "fp32", "fp16", "fp16-fp32"))
    for (i, x), (_, y) in zip(l32, l16):
        print("%9d %10.6g %10.6g %+10.3g" % (i, x, y, y - x))
    print("test accuracy at each test pass: fp32 %s, fp16 %s" % (acc32, acc16))


if __name__ == "__main__":
    main()
