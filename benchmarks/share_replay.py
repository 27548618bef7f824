#!/usr/bin/env python
"""Replay the batch-share balancer (caffempi.parallel.balance.ShareBalancer,
the real class) over per-step compute times measured on 2 ranks, to compare
its decision rules on the same speeds: how often it decides (plain ``auto``:
every iteration; ``auto:SECONDS``: periods) and how far ahead the data
readers need the shares (0 for DummyData, prefetch + 3 for Data).

Input: the --json of benchmarks/scaling.py or benchmarks/cluster.py, whose
runs record each timed step's compute seconds and records
(``compute_series``, ``images_series``).  From each run (the 2-rank job's
and the independent pair's) each rank's seconds a record at each step are
taken as that rank's speed then; a replayed step with shares (n0, n1)
takes max(n_r x s_r), plus --change_ms when the shares changed (a
reshape).  The efficiency is the replay's records a second over the sum of
the ranks' own rates (each rank at its own pace, as the independent pair):
what a rule recovers of what waiting for the slower rank loses, on these
speeds.  "as run" is the same measure of the shares the run itself took.
It leaves out what the replayed shares would change in the times
themselves (a smaller batch's fixed costs) and all communication.

    .venv/bin/python benchmarks/share_replay.py scaling.json
    .venv/bin/python benchmarks/share_replay.py cluster.json --change_ms 0.7
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from caffempi.parallel.balance import ShareBalancer  # noqa: E402
from caffempi.parallel.comm import PendingScalars  # noqa: E402


class ReplayNet:
    """What the balancer asks of a net: shares applied at a pass, announced
    ones held until then."""

    def __init__(self, batch, lookahead):
        self.batch, self.lookahead = batch, lookahead
        self.batch_shares, self.passes, self.pending = None, 0, []

    def shareable_batch(self):
        return self.batch, None

    def share_lookahead(self):
        return self.lookahead

    def set_batch_shares(self, shares, ahead=0):
        if ahead > 0:
            self.pending.append((self.passes + ahead, shares))
        else:
            self.batch_shares, self.pending = shares, []

    def pending_batch_shares(self):
        return [(at - self.passes, shares) for at, shares in self.pending]

    def next_pass(self):
        for at, shares in list(self.pending):
            if at <= self.passes:
                self.batch_shares = shares
                self.pending.remove((at, shares))
        self.passes += 1


class ReplayWorld:
    """Rank 0 of a pair whose rank 1 runs at the measured speeds: its seconds
    over its records since the last exchange, as the balancer sends its own."""
    rank, size = 0, 2

    def __init__(self):
        self.other = []

    def start_allreduce_scalars(self, values, op="sum", what=""):
        seconds, records = map(sum, zip(*self.other)) if self.other else (0.0, 1)
        self.other = []
        return PendingScalars(np.array([values[0], seconds / records]))

    def waited_seconds(self):
        return 0.0


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def replay(per_record, batch, mode, lookahead, change_s):
    """Records a second of the balancer's replay over per_record[rank, step]."""
    net, world, clock = ReplayNet(batch, lookahead), ReplayWorld(), Clock()
    balancer = ShareBalancer(mode, clock=clock)
    balancer.attach(world, net)
    records = seconds = 0.0
    last = None
    for s0, s1 in per_record.T:
        balancer.before_iteration()
        net.next_pass()
        shares = net.batch_shares or (batch, batch)
        clock.now += shares[0] * s0
        world.other.append((shares[1] * s1, shares[1]))
        balancer.after_backward()
        balancer.after_update()
        seconds += max(shares[0] * s0, shares[1] * s1) + (change_s if last not in (None, shares) else 0.0)
        records += sum(shares)
        last = shares
    return records / seconds


def series(run_pair):
    """([rank, step] seconds a record, [rank, step] records) of a 2-rank run."""
    steps = min(len(r["compute_series"]) for r in run_pair)
    seconds = np.array([r["compute_series"][:steps] for r in run_pair])
    records = np.array([r["images_series"][:steps] for r in run_pair])
    return seconds / records, records


def runs(data):
    """(label, batch, [rank, step] seconds a record, [rank, step] records)
    of every 2-rank run in a scaling.py or cluster.py JSON."""
    if isinstance(data, dict):                     # scaling.py: net -> mode -> {"raw": [...]}
        for net, modes in data.items():
            for mode, result in modes.items():
                raw = result.get("raw", [])
                if len(raw) == 2 and "compute_series" in raw[0]:
                    yield ("%s %s" % (net, mode), raw[0]["batch"]) + series(raw)
    else:                                          # cluster.py: rows with the job's and the pair's runs
        for row in data:
            for kind in ("runs", "pair_runs"):
                raw = row.get(kind, [])
                if len(raw) == 2 and "compute_series" in raw[0]:
                    yield ("%s %s %s %s" % (row["net"], row["rate"], row["mode"], kind), raw[0]["batch"]) + series(raw)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--modes", default="auto,auto:0.1,auto:0.3,auto:1", help="--balance values to replay")
    ap.add_argument("--lookahead", default="0,5", help="passes ahead the shares are announced")
    ap.add_argument("--change_ms", type=float, default=0.0, help="milliseconds a share change adds to its step")
    a = ap.parse_args()
    modes = a.modes.split(",")
    for label, batch, s, records in runs(json.load(open(a.json))):
        pair = sum(1.0 / s[r].mean() for r in range(2))
        as_run = records.sum() / (records * s).max(0).sum()            # the shares the run took
        equal = 2 * batch * s.shape[1] / np.maximum(batch * s[0], batch * s[1]).sum()
        oracle = s.shape[1] / (1.0 / (1.0 / s).sum(0)).sum()        # every step's work split by its speeds
        lag = " (lag of %s iterations; step ms %.1f; %d steps; change %.1f ms)" % (
            a.lookahead, 1e3 * batch * s.mean(), s.shape[1], a.change_ms)
        print("%s%s\n  as run %.3f  equal %.3f  oracle %.3f" % (label, lag, as_run / pair, equal / pair, oracle / pair))
        for lookahead in map(int, a.lookahead.split(",")):
            print("  lag %d: " % lookahead + "  ".join(
                "%s %.3f" % (mode, replay(s, batch, mode, lookahead, 1e-3 * a.change_ms) / pair) for mode in modes))


if __name__ == "__main__":
    main()
