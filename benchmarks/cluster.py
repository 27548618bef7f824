#!/usr/bin/env python
"""2 emulated hosts over TCP links of a given rate (caffempi.testing.cluster;
run as root): for each net, the independent pair (two single processes at
once on this machine, the same per-rank batch and 1 BLAS thread each) and
the 2-host job in each mode, alive together and taking turns in time slots
(as benchmarks/scaling.py pairs them) so that both see the same load, with
the job's efficiency (aggregate images/s over the pair's) and the bytes each
host sent per step.

    sudo .venv/bin/python benchmarks/cluster.py --nets caffenet --rates 1gbit
    sudo .venv/bin/python benchmarks/cluster.py --nets lenet,cifar10_quick,caffenet \\
        --rates 100mbit,1gbit,10gbit --json cluster.json

Modes: blocking (--sfb=off, one allreduce after backward), overlap (--sfb=off,
bucketed Iallreduce polled during backward), default (--comm=auto --sfb=auto,
caffempi train's defaults: across hosts a communication thread sums the
buckets, and the cost model chooses sufficient factors per layer; the
choices are printed), fp16 (the defaults with --comm_dtype=fp16), powersgd
(the defaults with --compress=powersgd: the plan may put weights on low
rank), powersgd_fp16 (both), barrier (no gradients: a barrier after each
backward, the job's ceiling on these hosts: what the ranks lose waiting
for the slower one).  CaffeNet is BVLC's
reference prototxt from ../shared, with random input, 8 images a rank.

--balance off,auto runs each mode with each batch-share setting (a mode
'default/auto'; the nets then read DummyData, as scaling.py's), and
--throttle F holds host 2's rank and the pair's second process to F of a
core (scaling.py's cgroups): a slow host.  Each emulated host's processes
(and the pair's process for it) run on a CPU of their own (--pin host,
the default since 2026-11-29; --pin none: where the OS puts them), as on
machines of their own: unpinned, a host's threads use the other's idle
cycles.

    sudo .venv/bin/python benchmarks/cluster.py --nets lenet,cifar10_quick --rates 1gbit \
        --modes default --balance off,auto --throttle 0.6
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import scaling  # noqa: E402
from caffempi.testing.cluster import Cluster, unavailable_reason  # noqa: E402

# mode: (--comm, --sfb, --comm_dtype, --compress)
MODES = {"blocking": ("blocking", "off", "fp32", "none"), "overlap": ("overlap", "off", "fp32", "none"),
         "default": ("auto", "auto", "fp32", "none"), "fp16": ("auto", "auto", "fp16", "none"),
         "fp16_polled": ("overlap", "auto", "fp16", "none"), "powersgd": ("auto", "auto", "fp32", "powersgd"),
         "powersgd_fp16": ("auto", "auto", "fp16", "powersgd"), "barrier": ("barrier", "off", "fp32", "none")}


def slot_seconds(a, net):
    """A turn's seconds: several steps of the net (a CaffeNet step takes
    1.1-1.9 s with the defaults).  Where the whole gradient crosses a slow
    link a step is longer than that (CaffeNet blocking and overlap at 100
    Mbit/s: 22 s), so pass --slot 30 --startup 90 there: a turn that holds
    a step, and a start-up that holds the warm-up steps."""
    return a.slot or {"lenet": 0.8, "cifar10_quick": 3.0}.get(net, 10.0)


def host_cpus(a):
    """The CPU of each emulated host (and of the pair's process for it):
    with --pin host and a CPU for each, host k's processes on CPU k, as on
    machines of their own; else None (the OS places them)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:2] if a.pin == "host" and len(cpus) >= 2 else None


def run_paired(cluster, a, net, mode):
    """The independent pair (here) and the 2-host job alive together, taking
    turns in time slots (scaling.py's pairing), so both see the same load."""
    mode, _, balance = mode.partition("/")
    comm, a.sfb, a.comm_dtype, a.compress = MODES[mode]
    if balance and comm != "barrier":
        comm += "/" + balance
    slot = slot_seconds(a, net)
    t0 = time.time() + a.startup
    cpus = host_cpus(a)
    procs, outs = scaling.start_independent(a, net, 2, (slot, a.slots, t0, 1), cpus)
    out = tempfile.mktemp(suffix=".json")
    job = cluster.popen(scaling.worker_args(a, net, comm, out, (slot, a.slots, t0, 0), scaling.throttled(a, "job"),
                                            cpus),
                        env=scaling.bench_env(), stderr=subprocess.PIPE, text=True)
    _, err = job.communicate(timeout=a.timeout)
    if job.returncode:
        raise SystemExit("the %s job on %s failed:\n%s" % (mode, net, err[-3000:]))
    pair = scaling.collect(procs, outs, a)
    res = scaling.collect([], [out], a)
    choices = [line.split("] ", 1)[-1] for line in err.splitlines() if "Plan: " in line or "Batch shares: " in line]
    return pair, res, choices


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default="caffenet")
    ap.add_argument("--rates", default="1gbit", help="tc rates, e.g. 100mbit,1gbit,10gbit ('none': no limit)")
    ap.add_argument("--modes", default="blocking,overlap,default,fp16",
                    help="modes of the 2-host job, or 'pair' (the independent pair's profile alone)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket_mb", type=float, default=4.0)
    ap.add_argument("--first_bucket_mb", type=float, default=1.0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--slot", type=float, default=None, help="seconds a turn (default by net and mode)")
    ap.add_argument("--slots", type=int, default=10, help="turns of each kind")
    ap.add_argument("--startup", type=float, default=25.0, help="seconds allowed for start-up (CaffeNet's "
                    "initial weights take 2 s to cross a 1 Gbit/s link)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--balance", default="off", help="batch shares: off, auto, B0:B1, or a comma list (each mode "
                    "runs with each; anything but off: DummyData input)")
    ap.add_argument("--throttle", default=None, help="a fraction of a core for host 2's rank and the pair's "
                    "second process (cgroups)")
    ap.add_argument("--pin", default="host", choices=("host", "none"),
                    help="host: each emulated host's processes on a CPU of their own, and the pair's process "
                    "for host k on host k's (where there are CPUs enough); none: where the OS puts them")
    a = ap.parse_args()
    balances = a.balance.split(",")
    a.data = "input" if balances == ["off"] else "dummy"
    modes = [m if b == "off" else m + "/" + b for m in a.modes.split(",") for b in balances]
    if a.throttle:
        with scaling.Throttle(float(a.throttle), ("pair", "job")) as a.cgroups:
            return run(a, modes)
    return run(a, modes)


def run(a, modes):
    a.allreduce_reps = 1          # the whole gradient alone, once: 244 MB on a slow link
    reason = None if a.modes == "pair" else unavailable_reason()
    if reason:
        raise SystemExit("benchmarks/cluster.py: %s" % reason)
    results = []
    print("2 emulated hosts, one rank each, 1 BLAS thread a process, the pair and the job taking turns; "
          "efficiency = 2-host images/s over the independent pair's")
    print("%-14s %-8s %-9s %9s %9s %8s %10s %10s %12s" % ("net", "rate", "mode", "pair img/s", "img/s", "eff.",
                                                          "pair ms", "step ms", "MB/step/host"))
    for net in a.nets.split(","):
        if a.modes == "pair":           # the profile alone (tools/scaling_model.py's host table)
            pair_runs = scaling.collect(*scaling.start_independent(a, net, 2), a)
            pair = scaling.summarize(pair_runs)
            print("%-14s %-8s %-9s %9.1f %9s %8s %10.1f" % (net, "-", "pair", pair["images_per_s"], "", "",
                                                           pair["step_ms"]), flush=True)
            results.append({"net": net, "rate": None, "mode": "pair", "pair_runs": pair_runs,
                            "pair_images_per_s": pair["images_per_s"], "pair_step_ms": pair["step_ms"]})
            continue
        for rate in a.rates.split(","):
            with Cluster(2, None if rate == "none" else rate) as cluster:
                for mode in modes:
                    pair_runs, res, choices = run_paired(cluster, a, net, mode)
                    pair, s = scaling.summarize(pair_runs), scaling.summarize(res)
                    eff = s["images_per_s"] / pair["images_per_s"]
                    sent = [r["link_bytes_per_step"] for r in res if r.get("link_bytes_per_step") is not None]
                    mb = max(sent) / 2 ** 20 if sent else float("nan")
                    print("%-14s %-8s %-9s %9.1f %9.1f %8.3f %10.1f %10.1f %12.2f" % (
                        net, rate, mode, pair["images_per_s"], s["images_per_s"], eff, pair["step_ms"],
                        s["step_ms"], mb), flush=True)
                    for c in choices:
                        print("    " + c)
                    overran = (max(r.get("slot_overrun_s", 0.0) for r in res + pair_runs)
                               / (a.slots * slot_seconds(a, net)))
                    if overran > 0.05:
                        print("    warning: steps ran into the other kind's slots for %.0f%% of their time, "
                              "slowing it; pass a --slot longer than a step and a --startup that holds the "
                              "warm-up" % (100 * overran))
                    results.append({"net": net, "rate": rate, "mode": mode, "efficiency": eff, "throttle": a.throttle,
                                    "images_per_s": s["images_per_s"], "step_ms": s["step_ms"],
                                    "pair_images_per_s": pair["images_per_s"], "pair_step_ms": pair["step_ms"],
                                    "link_mb_per_step": mb, "choices": choices, "runs": res,
                                    "pair_runs": pair_runs})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
