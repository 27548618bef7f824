#!/usr/bin/env python
"""How long one bucket's sum takes on 2 ranks, by --comm_dtype and size,
against another revision of caffempi in the same invocation.

Two timings a sum, each the median of ``--rounds`` sums after a barrier:

  alone    start the sum, then wait for it (the transport's own wait loop):
           the sum's latency with nothing else to do
  polled   start the sum, then alternate ``--work_us`` of busy work (the
           layers' backward) with the transport's poll until it is done:
           a step that completes between polls is noticed only at the next
           one, so a sum of more steps costs more poll intervals

``--baseline DIR`` runs the same measurements with caffempi from another
checkout (``git worktree add DIR COMMIT``, as for net_speed.py),
alternating the two trees ``--runs`` times, so both see
the same machine; each run prints one line per (dtype, size).

    .venv/bin/python benchmarks/sum_latency.py
    git worktree add /tmp/base 7834c87
    .venv/bin/python benchmarks/sum_latency.py --baseline /tmp/base --runs 3
    sudo .venv/bin/python benchmarks/sum_latency.py --rate 1gbit --baseline /tmp/base   # 2 emulated hosts
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args):
    import numpy as np
    from caffempi.parallel.comm import get_world
    from caffempi.parallel.transports import make_transport

    world = get_world()
    rows = []
    for dtype in args.dtypes.split(","):
        for n in (int(s) for s in args.sizes.split(",")):
            transport = make_transport(world, args.comm, np, 4 * n, dtype)
            buf = np.empty(n, np.float32)
            alone, polled = [], []
            for i in range(args.rounds + args.warmup):
                for times, poll in ((alone, False), (polled, True)):
                    buf[...] = np.float32(1e-3 * (world.rank + 1))
                    world.barrier()
                    t0 = time.perf_counter()
                    handle = transport.allreduce_start(buf, 0.5)
                    if poll:
                        while True:
                            until = time.perf_counter() + args.work_us * 1e-6
                            while time.perf_counter() < until:
                                pass
                            if transport.poll():
                                break
                    transport.wait(handle)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
            transport.close()
            rows.append({"dtype": dtype, "n": n, "transport": transport.name,
                         "alone_us": 1e6 * float(np.median(alone)), "polled_us": 1e6 * float(np.median(polled))})
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(rows))


def run_tree(args, tree, out, cluster):
    """One measurement with caffempi from ``tree`` (rows: list of dicts), on
    this host or across ``cluster``'s emulated hosts."""
    env = dict(os.environ, PYTHONPATH=str(tree), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", out,
           "--dtypes", args.dtypes, "--sizes", args.sizes, "--comm", args.comm,
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--work_us", str(args.work_us)]
    if cluster is None:
        subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", "2"] + cmd, env=env, check=True, cwd=tree)
    else:
        cluster.mpiexec(cmd, env=env, check=True, cwd=tree, capture_output=False)
    return json.loads(Path(out).read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,fp16")
    p.add_argument("--sizes", default="8,65536,1048576")
    p.add_argument("--comm", default="overlap", help="--comm mode of the transport (default overlap: polled)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--work_us", type=float, default=200.0, help="busy work between polls (us)")
    p.add_argument("--baseline", help="another caffempi checkout to measure beside this one "
                                      "(as net_speed.py's: git worktree add DIR COMMIT)")
    p.add_argument("--runs", type=int, default=3, help="alternating runs of each tree")
    p.add_argument("--rate", help="on 2 emulated hosts with links of this tc rate (as root), e.g. 1gbit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        cluster = None
        if args.rate:
            from caffempi.testing.cluster import Cluster
            cluster = stack.enter_context(Cluster(2, rate=args.rate))
        trees = [("this tree", REPO)] + ([("baseline", Path(args.baseline))] if args.baseline else [])
        results = {name: [] for name, _ in trees}
        for run in range(args.runs):
            for name, tree in (trees if run % 2 == 0 else trees[::-1]):
                results[name].append(run_tree(args, tree, str(Path(tmp) / "rows.json"), cluster))
    print("%-10s %-6s %9s  %-22s %s" % ("tree", "dtype", "values", "transport", "alone us / polled us, each run"))
    for name, runs in results.items():
        for k, row in enumerate(runs[0]):
            cells = "  ".join("%7.1f /%7.1f" % (r[k]["alone_us"], r[k]["polled_us"]) for r in runs)
            print("%-10s %-6s %9d  %-22s %s" % (name, row["dtype"], row["n"], row["transport"], cells))


if __name__ == "__main__":
    main()
