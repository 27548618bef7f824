#!/usr/bin/env python
"""2 emulated hosts over TCP links of a given rate (caffempi.testing.cluster;
run as root): for each net, the independent pair (two single processes at
once on this machine, the same per-rank batch and 1 BLAS thread each) and
the 2-host job in each mode, with its efficiency (aggregate images/s over
the pair's) and the bytes each host sent per step.

    sudo .venv/bin/python benchmarks/cluster.py --nets caffenet --rates 1gbit
    sudo .venv/bin/python benchmarks/cluster.py --nets lenet,cifar10_quick,caffenet \\
        --rates 100mbit,1gbit,10gbit --json cluster.json

Modes: blocking (--sfb=off, one allreduce after backward), overlap (--sfb=off,
bucketed Iallreduce polled during backward), default (--comm=auto --sfb=auto,
caffempi train's defaults: across hosts a communication thread sums the
buckets, and the cost model chooses sufficient factors per layer; the
choices are printed).  CaffeNet is BVLC's
reference prototxt from ../shared, with random input, 8 images a rank.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import scaling  # noqa: E402
from caffempi.testing.cluster import Cluster, unavailable_reason  # noqa: E402

MODES = {"blocking": ("blocking", "off"), "overlap": ("overlap", "off"), "default": ("auto", "auto")}


def run_job(cluster, a, net, mode):
    comm, sfb = MODES[mode]
    a.sfb = sfb
    out = tempfile.mktemp(suffix=".json")
    t = time.time()
    p = cluster.mpiexec(scaling.worker_args(a, net, comm, out), env=scaling.bench_env(), timeout=a.timeout)
    if p.returncode:
        raise SystemExit("the %s job on %s failed:\n%s" % (mode, net, p.stderr[-3000:]))
    res = scaling.collect([], [out], a)
    choices = [line.split("] ", 1)[-1] for line in p.stderr.splitlines() if "Sufficient factors:" in line]
    return res, time.time() - t, choices


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="caffenet")
    ap.add_argument("--rates", default="1gbit", help="tc rates, e.g. 100mbit,1gbit,10gbit ('none': no limit)")
    ap.add_argument("--modes", default="blocking,overlap,default")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket_mb", type=float, default=4.0)
    ap.add_argument("--first_bucket_mb", type=float, default=1.0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", help="write all results here")
    a = ap.parse_args()
    a.allreduce_reps = 1          # the whole gradient alone, once: 244 MB on a slow link
    reason = unavailable_reason()
    if reason:
        raise SystemExit("benchmarks/cluster.py: %s" % reason)
    results = []
    print("2 emulated hosts, one rank each, 1 BLAS thread a process; efficiency = 2-host images/s "
          "over the independent pair's")
    print("%-14s %-8s %-9s %9s %8s %10s %12s" % ("net", "rate", "run", "img/s", "eff.", "step ms",
                                                 "MB/step/host"))
    for net in a.nets.split(","):
        pair = scaling.summarize(scaling.collect(*scaling.start_independent(a, net, 2), a))
        print("%-14s %-8s %-9s %9.1f %8s %10.1f %12s" % (net, "-", "pair", pair["images_per_s"], "",
                                                         pair["step_ms"], ""))
        for rate in a.rates.split(","):
            with Cluster(2, None if rate == "none" else rate) as cluster:
                for mode in a.modes.split(","):
                    res, wall, choices = run_job(cluster, a, net, mode)
                    s = scaling.summarize(res)
                    eff = s["images_per_s"] / pair["images_per_s"]
                    sent = [r["link_bytes_per_step"] for r in res if r.get("link_bytes_per_step") is not None]
                    mb = max(sent) / 2 ** 20 if sent else float("nan")
                    print("%-14s %-8s %-9s %9.1f %8.3f %10.1f %12.2f" % (net, rate, mode, s["images_per_s"],
                                                                        eff, s["step_ms"], mb))
                    for c in choices:
                        print("    " + c)
                    results.append({"net": net, "rate": rate, "mode": mode, "efficiency": eff,
                                    "images_per_s": s["images_per_s"], "step_ms": s["step_ms"],
                                    "pair_images_per_s": pair["images_per_s"], "pair_step_ms": pair["step_ms"],
                                    "link_mb_per_step": mb, "wall_s": wall, "choices": choices, "runs": res})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
