#!/usr/bin/env python
"""LeNet on 2 MPI ranks under several sets of train flags ("variants"), each
over several seeds: the final test accuracy of every run, its median over
the seeds against the first variant's, and the training loss at every
display line (optionally as JSON and as one SVG of the seeds' median loss).

    .venv/bin/python benchmarks/trajectory.py                  # exact against fp16 (--comm_dtype=fp16)
    .venv/bin/python benchmarks/trajectory.py --iters 2000 --seeds 1
    .venv/bin/python benchmarks/trajectory.py --variants exact= \\
        'r1=--compress=powersgd:1 --sfb=off --link_gbps=0.1' \\
        'r2=--compress=powersgd:2 --sfb=off --link_gbps=0.1' \\
        'r4=--compress=powersgd:4 --sfb=off --link_gbps=0.1' \\
        --json docs/performance/powersgd_lenet.json --plot docs/images/powersgd_lenet_loss.svg

A variant is NAME=FLAGS (FLAGS split as a shell would; empty for none).
Every run trains models/mnist/lenet_demo_solver.prototxt with max_iter and
random_seed rewritten, with `--comm=overlap --sfb=off` and then the
variant's flags (a later flag wins), one OpenBLAS thread a rank, one run at
a time; a run is deterministic given its seed.  Data: examples/mnist's
LMDBs (tools/make_demo_data.py makes the 4,000/1,000 real digits `make demo`
uses when they are missing).
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from caffempi.parallel.launch import mpiexec_path  # noqa: E402

SOLVER = REPO / "models/mnist/lenet_demo_solver.prototxt"
RANKS = 2
BASE_FLAGS = ["--comm=overlap", "--sfb=off"]
DEFAULT_VARIANTS = ["exact=", "fp16=--comm_dtype=fp16"]
# "Iteration 100 (31.9 iter/s, 0.62s/20 iters), loss = 0.31" at a display line,
# "Iteration 500, loss = 0.05" after the last iteration
LOSS = re.compile(r"Iteration (\d+)(?: \([^)]*\))?, loss = (\S+)")
ACCURACY = re.compile(r"Test net output #\d+: accuracy = (\S+)")


def parse_variant(text):
    """'NAME=FLAGS' -> (NAME, [flag, ...])."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise SystemExit("a variant is NAME=FLAGS, got %r" % text)
    return name, shlex.split(flags)


def solver_text(text, iters, seed, prefix):
    """The solver prototxt with max_iter, random_seed (added if absent) and
    snapshot_prefix set, and test_interval set to max_iter where the last
    iteration would not be tested."""
    text = re.sub(r"(?m)^max_iter: \d+", "max_iter: %d" % iters, text)
    interval = re.search(r"(?m)^test_interval: (\d+)", text)
    if interval and iters % int(interval.group(1)):
        text = text.replace(interval.group(0), "test_interval: %d" % iters)
    text = re.sub(r'(?m)^snapshot_prefix: "[^"]*"', 'snapshot_prefix: "%s"' % prefix, text)
    text, n = re.subn(r"(?m)^random_seed: -?\d+", "random_seed: %d" % seed, text)
    return text if n else text.rstrip("\n") + "\nrandom_seed: %d\n" % seed


def parse_log(log):
    """{"loss": [[iteration, loss], ...] (display lines and the last
    iteration's), "accuracy": [test accuracy at each test pass]}."""
    loss = {}
    for m in LOSS.finditer(log):
        loss[int(m.group(1))] = float(m.group(2))
    return {"loss": sorted([i, x] for i, x in loss.items()),
            "accuracy": [float(a) for a in ACCURACY.findall(log)]}


def train(flags, iters, seed, workdir, tag):
    path = Path(workdir) / ("solver_%s.prototxt" % tag)
    path.write_text(solver_text(SOLVER.read_text(), iters, seed, "%s/%s" % (workdir, tag)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [mpiexec_path() or "mpiexec", "-n", str(RANKS), sys.executable, "-m", "caffempi", "train",
           "--solver=%s" % path] + BASE_FLAGS + flags
    t = time.time()
    p = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit("%s failed:\n%s" % (tag, p.stderr[-3000:]))
    run = parse_log(p.stderr)
    run["wall_s"] = round(time.time() - t, 1)
    run["low_rank"] = re.findall(r"Low rank: .*", p.stderr)
    return run


def summarise(runs, base):
    """Per variant: final accuracies, their median, the difference to
    ``base``'s median in points, and the seeds' median loss per iteration."""
    out = {}
    for name, seeds in runs.items():
        acc = {s: r["accuracy"][-1] for s, r in seeds.items()}
        curves = [dict(map(tuple, r["loss"])) for r in seeds.values()]
        its = sorted(set.intersection(*(set(c) for c in curves)))
        out[name] = {"accuracy": acc, "accuracy_median": statistics.median(acc.values()),
                     "loss_median": [[i, statistics.median(c[i] for c in curves)] for i in its]}
    for v in out.values():
        v["accuracy_diff_points"] = round(100 * (v["accuracy_median"] - out[base]["accuracy_median"]), 6)
    return out


def plot(summary, iters, seeds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.fonttype"] = "none"          # text as text, no glyph outlines
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in summary.items():
        its, loss = zip(*v["loss_median"])
        ax.plot(its, loss, marker="o", markersize=3, label="%s (test acc. %.3f)" % (name, v["accuracy_median"]))
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (median of seeds %s)" % ",".join(map(str, seeds)))
    ax.set_title("LeNet, %d ranks, %d iterations" % (RANKS, iters))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated random_seed values")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, metavar="NAME=FLAGS",
                    help="the first is the baseline (default: %s)" % " ".join(DEFAULT_VARIANTS))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--plot", metavar="OUT.svg")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    variants = dict(parse_variant(v) for v in a.variants)
    if not (REPO / "examples/mnist/mnist_train_lmdb").exists():
        subprocess.run([sys.executable, "tools/make_demo_data.py", "--out", "examples/mnist"], cwd=str(REPO),
                       check=True)
    runs = {name: {} for name in variants}
    t = time.time()
    with tempfile.TemporaryDirectory() as d:
        for name, flags in variants.items():
            for s in seeds:
                runs[name][s] = r = train(flags, a.iters, s, d, "%s_%d" % (name, s))
                print("%s seed %d: accuracy %s, %.1f s" % (name, s, r["accuracy"][-1], r["wall_s"]), flush=True)
                for line in r["low_rank"] if s == seeds[0] else ():
                    print("    " + line)
    wall = time.time() - t
    summary = summarise(runs, next(iter(variants)))

    print("\nLeNet, %d ranks, %s, %d iterations: final test accuracy"
          % (RANKS, " ".join(BASE_FLAGS), a.iters))
    print("%-8s %s %8s %8s  flags" % ("variant", " ".join("%7s" % ("seed %d" % s) for s in seeds),
                                      "median", "diff pt"))
    for name, v in summary.items():
        print("%-8s %s %8.4g %+8.2f  %s" % (name, " ".join("%7.4g" % v["accuracy"][s] for s in seeds),
                                             v["accuracy_median"], v["accuracy_diff_points"],
                                             " ".join(variants[name]) or "-"))
    print("\ntraining loss at each display line, median of the seeds")
    print("%9s %s" % ("iteration", " ".join("%10s" % n for n in summary)))
    for row in zip(*(v["loss_median"] for v in summary.values())):
        print("%9d %s" % (row[0][0], " ".join("%10.5g" % x for _, x in row)))
    print("\nwall time %.0f s" % wall)

    if a.json:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(REPO), capture_output=True, text=True)
        doc = {"command": " ".join(shlex.quote(x) for x in [Path(sys.executable).name] + sys.argv),
               "commit": git.stdout.strip() or None, "net": str(SOLVER.relative_to(REPO)), "ranks": RANKS, "iters": a.iters, "seeds": seeds,
               "base_flags": BASE_FLAGS, "wall_s": round(wall, 1),
               "variants": {n: dict(flags=variants[n], runs=runs[n], **summary[n]) for n in variants}}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(doc, indent=1)
        text = re.sub(r"\[[-\d\s,.e]*\]", lambda m: " ".join(m.group().split()), text)   # number lists on one line
        Path(a.json).write_text(text + "\n")
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(summary, a.iters, seeds, a.plot)


if __name__ == "__main__":
    main()
