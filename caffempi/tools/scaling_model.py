"""Predict data-parallel time per iteration and efficiency for N ranks.

Inputs: a net's measured per-layer backward times and parameter sizes
(benchmarks/scaling.py --json), and an alpha-beta network model of ring
allreduce: one allreduce of n bytes on N ranks takes

    T(n, N) = 2 (N-1) alpha + 2 (N-1)/N * n * beta

(reduce-scatter then allgather; alpha the per-message latency, beta the
time per byte, reduction included).  Overlap: buckets of whole layers in
reverse layer order (the gradient sync's rule) start when their lowest layer's
backward ends and go through the network one after another; what is left
after backward is exposed.  Blocking: one allreduce of everything after
backward.  Stragglers: every iteration waits for the slowest of the N
ranks, so a rank's step-time jitter (its part independent of the other
ranks, standard deviation sigma) adds sigma * E[max of N standard normals]
(0.56 sigma on 2 ranks, 3.2 sigma on 1024).  sigma is read from the 2-rank
runs' skew (the mean wait for the other rank's backward, 0.56 sigma) unless
--jitter_ms gives it.  Efficiency = step time on one rank / step time on N
ranks (each rank keeps its batch).

Ranks of unequal speed (speeds s_r relative to the fastest, a slow host's
persistent part; share_time_scale): with equal shares a step computes at
the slowest rank's pace, 1 / min(s) of the fastest's time; with batch
shares by speed (--balance=auto) every rank takes whole records in
proportion to its speed, so a step computes in max_r b_r / (s_r b) of the
fastest rank's time at batch b, the ideal N / sum(s) plus the rounding of
whole records.  What the balancer cannot follow, jitter from one step to
the next (it decides from the last step's speeds), stays in the straggler
term, now a *balance residual*: its sigma comes from the skew of runs
balanced the same way.

Sufficient factors (--sfb): a layer whose weight comes from the ranks'
factors (M rows of N + K numbers a rank) sends no weight gradient; its
factors cross the link as an allgather, (N-1) alpha + (N-1) M (N+K) 4 beta,
started at its backward; after backward each rank forms dW with one GEMM
over all N*M rows (the layer's own dW product, M rows, is not done during
backward).  The link is one resource: buckets and gathers cross it one
after another, in the order backward makes them ready.

Low rank (--compress=powersgd[:RANK], PowerSGD): a weight on low rank
(rows x cols, rank r) sends no gradient in the buckets; after its layer's
backward the rank forms M' = M + E and P = M'Q (the hook's work, which
delays the rest of backward), then P's sum (r rows numbers) crosses the
link; once it is in, the orthonormalisation and Q = M'^T P take the
computing thread (between backward's kernels, one Q after another) and
Q's sum (r cols numbers) crosses; after backward, once every sum is in,
P Q^T and the error's update.  Each sum is an allreduce with its latency
on the same link as the buckets and gathers.  The rank's work is the
reducer's estimate (powersgd.lowrank_seconds at the GEMM and memory rates)
split by when it is done (lowrank_stages).  Which weights go which way is
the reducer's plan (plan: BucketedAllreduce._plan's rule over the
plug-ins' own estimates, a lossy way only where it saves more than
LOSSY_MARGIN): a 2-host run's own plan lines, and the plan per host count
in the host table.

Emulated links (caffempi.testing.cluster) shape traffic with tc's token
bucket: after an idle spell its ``burst`` bytes leave at once, then the
rate (link_intervals).  A factor layer's weight gradient at a few rows is
bound by writing its M x N result, not by its FLOPs, so its time is
measured (sfb.measure_weight_grad_seconds) for the emulated-host report.
A transport's own work on a rank's cores (polls, a communication thread)
costs compute while a sum is under way (measure_comm_cost, per byte of a
long sum, hence a share of the sum's time); it stretches backward and the
factor GEMM by that share of the link's work during them, latency
included, and costs nothing while the computing thread only waits.

    python tools/scaling_model.py --calibrate           # alpha/beta for shared memory, 2 ranks
    python tools/scaling_model.py --bench bench.json --validate --plot scaling.png
    # 2 emulated hosts (benchmarks/cluster.py --json): predictions against the
    # measurements, alpha/beta measured on each emulated link, and the table
    # for 16 and 64 hosts on 10GbE and 100Gb InfiniBand
    sudo python tools/scaling_model.py --cluster_bench cluster.json --calibrate_links
"""
import heapq
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..common import CaffeError
from ..flags import FlagSet
from ._util import run_tool

# alpha (s), beta (s/byte): latency and inverse effective bandwidth per link
PRESETS = {
    "1GbE": (50e-6, 1 / 0.118e9),
    "10GbE": (30e-6, 1 / 1.1e9),
    "25GbE": (15e-6, 1 / 2.8e9),
    "100Gb-IB": (2e-6, 1 / 11.5e9),
}
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def ring_time(nbytes, n, alpha, beta):
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2.0 * (n - 1) / n * nbytes * beta


def buckets_from_layers(layers, bucket_mb, first_bucket_mb=1.0, itemsize=4):
    """(ready time after backward start (s), bytes) per bucket, by the
    gradient sync's rule (caffempi.parallel.buckets.group_buckets).  A bucket is
    ready after its lowest layer's backward."""
    from ..parallel.buckets import group_buckets
    t, params = 0.0, []
    for L in sorted(layers, key=lambda L: -L["index"]):
        t += L["backward_ms"] / 1e3
        if L["params"]:
            params.append((t, L["params"] * itemsize))
    groups = group_buckets([b for _, b in params], bucket_mb, first_bucket_mb)
    return [[params[g[-1]][0], sum(params[i][1] for i in g)] for g in groups]


#: the host table's slow host: its speed relative to the others'
SLOW_HOST = 0.6


def share_time_scale(speeds, batch, balance):
    """A synchronous step's compute time relative to the fastest rank's own
    at the nominal batch ``batch``, for ranks of relative ``speeds``: equal
    shares wait for the slowest (1 / min(s)); balanced shares (the
    balancer's proportional_shares over the global batch) end together up
    to a record."""
    from ..parallel.balance import proportional_shares
    top = max(speeds)
    speeds = [s / top for s in speeds]
    if not balance:
        return 1.0 / min(speeds)
    shares = proportional_shares(len(speeds) * batch, [1.0 / s for s in speeds], floor=max(1, batch // 10))
    return max(n / (s * batch) for n, s in zip(shares, speeds))


def scaled_profile(profile, factor):
    """``profile`` with every compute time (forward, each layer's backward,
    the step) times ``factor``."""
    if factor == 1.0:
        return profile
    out = dict(profile, **{k: profile[k] * factor for k in ("forward_ms", "compute_ms", "step_ms") if k in profile})
    out["layers"] = [dict(L, backward_ms=L["backward_ms"] * factor) for L in profile["layers"]]
    return out


def expected_max_normal(n):
    """E[max of n independent standard normal variables] (0 for n = 1)."""
    if n <= 1:
        return 0.0
    from math import erf, pi, sqrt
    x = np.linspace(-12.0, 12.0, 24001)
    cdf = 0.5 * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / sqrt(2.0 * pi)
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


def jitter_from_skew(skew_ms):
    """Per-rank independent step-time sigma (ms) from a 2-rank run's mean
    skew: for two such ranks E[max(a, b)] - E[a] = sigma / sqrt(pi)."""
    return skew_ms / expected_max_normal(2)


def gather_time(nbytes, n, alpha, beta):
    """A ring allgather of ``nbytes`` from each of n ranks."""
    return (n - 1) * alpha + (n - 1) * nbytes * beta if n > 1 else 0.0


def link_intervals(items, beta, burst=0.0, idle_before=0.0, then=None):
    """Run ``items`` (ready time, latency seconds, bytes a rank sends, is a
    factor gather[, tag]) through one link, one after another in ready order;
    yields (the time the link takes it up, the time it ends, item) in the
    order they cross.  ``burst``: the link's token bucket in bytes (tc's tbf
    ``burst``; 0 for a plain link): after an idle spell it sends up to
    ``burst`` bytes at once, refilled at the link rate while idle
    (``idle_before``: seconds idle before time 0).  ``then(item, end)``:
    the items that an item's end makes (a low-rank Q sum after its P sum),
    queued by their ready time."""
    link_end = 0.0
    tokens = min(burst, idle_before / beta) if burst else 0.0
    queue = [(item[0], k, item) for k, item in enumerate(sorted(items, key=lambda item: item[:4]))]
    heapq.heapify(queue)
    count = len(queue)
    while queue:
        _, _, item = heapq.heappop(queue)
        ready, latency, nbytes = item[:3]
        start = max(link_end, ready)
        if burst:
            tokens = min(burst, tokens + (start - link_end) / beta)
        free = min(tokens, nbytes)
        tokens -= free
        link_end = start + latency + (nbytes - free) * beta
        yield start, link_end, item
        for new in then(item, link_end) if then else ():
            heapq.heappush(queue, (new[0], count, new))
            count += 1


def lowrank_stages(rows, cols, rank, gemm_rate, memory_rate, itemsize=4):
    """A low-rank matrix's work on the rank, (at its layer's backward hook,
    when its P sum is in, after backward) in seconds: M' = M + E and P = M'Q
    at the hook; the orthonormalisation and Q = M'^T P when P's sum is in;
    P Q^T and the error's update in ``finish``.  Their total is
    parallel.powersgd.lowrank_seconds less its sums, the reducer's estimate
    (the last stage takes what the first two leave of it)."""
    from ..parallel.costs import Costs
    from ..parallel.powersgd import lowrank_seconds
    own = Costs(2, float("inf"), 0.0, gemm_rate, memory_rate)        # no link: the rank's own work
    r = min(rank, rows, cols)
    total = lowrank_seconds(own, rows, cols, rank, itemsize)
    # three touches of M and E for M' = M + E, a read of M' by the product
    hook = own.gemm_seconds(2.0 * rows * cols * r) + own.pass_seconds(16.0 * rows * cols)
    q = own.gemm_seconds(2.0 * rows * cols * r + 4.0 * rows * r * r) + own.pass_seconds(4.0 * rows * cols)
    return hook, q, max(0.0, total - hook - q)


def _advance(start, work, busy):
    """When ``work`` seconds of the computing thread's own work, begun at
    ``start``, end while ``busy`` ((start, end) spans in time order, not
    overlapping: the low-rank Q products, done as their P sums come in,
    between backward's kernels) take the thread from it."""
    t = start
    for s, e in busy:
        if e <= t:
            continue
        if s >= t + work:
            break
        work -= max(0.0, s - t)
        t = e
    return t + work


def predict(profile, n, alpha, beta, mode="overlap", bucket_mb=4.0, first_bucket_mb=1.0, jitter=0.0,
            factors=(), gemm_rate=100e9, bytes_per_value=4, burst=0.0, weight_grad_seconds=None,
            comm_cpu_seconds_per_byte=0.0, sum_link=None, lowrank=(), memory_rate=10e9):
    """Step seconds and exposed seconds for n ranks from one rank's
    ``profile`` (forward_ms; layers with backward_ms and params; step_ms,
    the whole measured step, preferred since it also holds zeroing the
    diffs, else compute_ms: forward, backward and update only); ``jitter``
    is the per-rank independent step-time sigma in seconds (the straggler term);
    ``factors``: the indices of the layers using sufficient factors (their
    layer records carry ``factors``: (M, N, K)); ``lowrank``: the weights
    on low rank, (layer index, rows, cols, rank) each (PowerSGD: its work
    on the rank at ``gemm_rate`` and ``memory_rate``, lowrank_stages; its P
    sum, r rows numbers, starts after its layer's backward and P product;
    its Q sum, r cols numbers, after P's is in and the Q product, which
    takes the computing thread meanwhile, one Q after another; both cross
    the link as the buckets and gathers do, an allreduce's latency each;
    P Q^T and the error's update after backward, once every sum is in);
    ``bytes_per_value``: 2 for
    --comm_dtype=fp16 (factors and, unless ``sum_link`` is given, buckets
    and low-rank sums);
    ``burst``: the link's token bucket (link_intervals);
    ``weight_grad_seconds(rows, M, N, accumulate)``: the measured time of a
    factor layer's weight gradient (sfb.measure_weight_grad_seconds), else
    its FLOPs at ``gemm_rate``; ``comm_cpu_seconds_per_byte``: what the
    transport's work costs the computing thread per byte of gradient summed
    (measure_comm_cost, on a long sum: polls, or a communication thread's
    share of the cores), taken as a share of the time the transport works
    on a sum, latency included, which stretches backward and the factor
    GEMM after it by that share of the link's work while they run (what
    crosses after them costs nothing: the thread only waits, and the link's
    beta already holds the transport's own work); ``sum_link``: (alpha,
    beta per float32 byte) of the bucket sums where they are not a plain
    ring on the link (the float16 transport, conversions included:
    calibrate)."""
    if weight_grad_seconds is None:
        def weight_grad_seconds(rows, m, k, accumulate):
            return 2.0 * rows * m * k / gemm_rate
    fwd = profile["forward_ms"] / 1e3
    bwd = sum(L["backward_ms"] for L in profile["layers"]) / 1e3
    # the rest of the measured step: zeroing the diffs, the update, bookkeeping
    other = max(0.0, profile.get("step_ms", profile["compute_ms"]) / 1e3 - fwd - bwd)
    if n <= 1:
        return fwd + bwd + other, 0.0
    # the low-rank matrices in the order their sums start (backward's, then the layer's params)
    mats, hooks, taken = [], {}, {}
    for k, (i, rows, cols, rank) in sorted(enumerate(lowrank), key=lambda e: (-e[1][0], e[0])):
        r = min(rank, rows, cols)
        hook, q_work, final = lowrank_stages(rows, cols, rank, gemm_rate, memory_rate, bytes_per_value)
        mats.append({"layer": i, "p": r * rows * 4, "q": r * cols * 4, "q_work": q_work, "final": final})
        hooks[i] = hooks.get(i, 0.0) + hook
        taken[i] = taken.get(i, 0) + rows * cols
    layers, gathers, gemm = [], [], 0.0
    for L in profile["layers"]:
        if L["index"] in factors:
            m, nn, k = L["factors"]
            saved = weight_grad_seconds(m, nn, k, True)      # its own dW, not done in backward
            L = dict(L, params=L["params"] - nn * k, backward_ms=max(0.0, L["backward_ms"] - 1e3 * saved))
            gathers.append((L["index"], m * (nn + k) * bytes_per_value))
            gemm += weight_grad_seconds(n * m, nn, k, False)
        if L["index"] in hooks:
            # out of the buckets; the P products at its backward hook
            L = dict(L, params=L["params"] - taken[L["index"]],
                     backward_ms=L["backward_ms"] + 1e3 * hooks[L["index"]])
        layers.append(L)
    bwd = sum(L["backward_ms"] for L in layers) / 1e3
    # the link's bytes (or their time's equivalent) per float32 byte of gradient
    sum_alpha, scale = (alpha, bytes_per_value / 4.0) if sum_link is None else (sum_link[0], sum_link[1] / beta)

    def ring(ready, nbytes, tag=None):
        return (ready, 2 * (n - 1) * sum_alpha, 2.0 * (n - 1) / n * nbytes * scale, False, tag)

    def gather(ready, nbytes):
        return (ready, (n - 1) * alpha, (n - 1) * nbytes, True, None)

    # ready times in the computing thread's own work since backward began
    ready_at, t = {}, 0.0
    for L in sorted(layers, key=lambda L: -L["index"]):
        t += L["backward_ms"] / 1e3
        ready_at[L["index"]] = t
    if mode == "blocking":
        # the gathers, then one allreduce of everything, after backward
        items = [gather(bwd, b) for _, b in gathers]
        items.append(ring(bwd + 1e-12, sum(L["params"] for L in layers) * 4))
    else:
        # the link's work in the order backward makes it ready
        items = [ring(ready, nb) for ready, nb in buckets_from_layers(layers, bucket_mb, first_bucket_mb)]
        items += [gather(ready_at[i], b) for i, b in gathers]
    # the P sums start at their layer's hook (the plug-in hooks backward whatever the transport)
    items += [ring(ready_at[m["layer"]], m["p"], ("p", k)) for k, m in enumerate(mats)]
    # The transport's cost a byte was measured on a long sum: as a share of
    # the time the transport works on a sum (its latency included), it lands
    # on the computing thread while that computes, backward and the factor
    # GEMM after it, and stretches them (a fixed point: a longer backward
    # overlaps more of the link's work).  After them the thread only waits.
    # The Q products take the thread too (busy), as P sums come in: another
    # fixed point, as they move what backward makes ready after them.
    share = 0.0 if mode == "blocking" else comm_cpu_seconds_per_byte / (2.0 * (n - 1) / n * scale * beta)
    base_bwd, base_gemm, base_items, stretch, busy = bwd, gemm, items, 1.0, []
    for it in range(20 if mats else 8 if share else 1):
        bwd = _advance(0.0, stretch * base_bwd, busy)
        items = [(_advance(0.0, stretch * item[0], busy),) + item[1:] for item in base_items]
        q_free, q_busy = 0.0, []

        def then(item, end):
            nonlocal q_free
            if item[4] is None or item[4][0] != "p":
                return ()
            m = mats[item[4][1]]
            start = max(end, q_free)          # in start order, one after another
            q_free = start + m["q_work"]
            q_busy.append((start, q_free))
            return [ring(q_free, m["q"], ("q", item[4][1]))]
        crossing = list(link_intervals(items, beta, burst, idle_before=fwd + other, then=then))
        link_end = crossing[-1][1] if crossing else 0.0
        gathers_end = max([end for _, end, item in crossing if item[3]], default=0.0)
        lowrank_end = max([end for _, end, item in crossing if item[4] is not None], default=0.0)
        sums = [(start, end) for start, end, item in crossing if not item[3]]
        g0, gemm = max(bwd, gathers_end), base_gemm
        for _ in range(4 if share and gathers else 0):
            gemm = base_gemm + share * _busy(sums, g0, g0 + gemm)
        new_stretch = 1.0 + share * _busy(sums, 0.0, bwd) / max(base_bwd, 1e-12)
        settled = (not share or it >= 7) and abs(new_stretch - stretch) < 1e-12 and q_busy == busy
        stretch, busy = new_stretch, q_busy
        if mats and settled:
            break
    finish = _advance(g0, gemm, busy) if gathers else bwd
    if mats:
        # LowRank.finish after the factors': every sum in, then P Q^T and the errors
        finish = _advance(max(finish, lowrank_end), sum(m["final"] for m in mats), busy)
    exposed = max(0.0, max(finish, link_end) - bwd) + jitter * expected_max_normal(n)
    return fwd + bwd + other + exposed, exposed


def _busy(spans, start, end):
    """Seconds of ``spans`` ((start, end) each) inside start..end."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


def single_step(profile):
    return predict(profile, 1, 0, 0)[0]


# ------------------------------------------------------------ calibration
# calibrate's pause before each timed sum: an emulated link's token bucket
# (256 KB) refills in 21 ms at 100 Mbit/s, and fit takes a full bucket out
# of every sum, as a step finds it after forward
REFILL_SECONDS = 0.05


def _allreduce_worker(arg):
    """One rank of calibrate; ``arg`` is "WHERE:OUT".  MPI_Allreduce of 256 B
    .. 16 MB ("points"); on an emulated link (WHERE "link") also the same
    buffers through --comm_dtype=fp16's transport as --comm=auto takes it
    across hosts ("fp16_points": seconds by float32 bytes), each timed sum
    after a pause of REFILL_SECONDS."""
    from ..parallel.comm import get_world
    from ..parallel.transports import make_transport
    where, out = arg.split(":", 1)
    link = where == "link"
    world = get_world("thread")
    MPI, comm = world.MPI, world.comm
    fp16 = make_transport(world, "auto", np, 0, "fp16") if link else None
    res = {"points": [], "fp16_points": []}
    for k in range(8, 25, 2):                     # 256 B .. 16 MB
        buf = np.ones(2 ** k // 4, np.float32)
        reps = 50 if k < 20 else 20
        sums = [("points", lambda: comm.Allreduce(MPI.IN_PLACE, buf))]
        if fp16 is not None:
            sums.append(("fp16_points", lambda: fp16.allreduce(buf)))
        for key, allreduce in sums:
            allreduce()
            ts = []
            for _ in range(reps):
                if link:
                    comm.Barrier()
                    time.sleep(REFILL_SECONDS)
                comm.Barrier()
                t = time.perf_counter()
                allreduce()
                ts.append(time.perf_counter() - t)
            res[key].append((buf.nbytes, float(np.median(ts))))
    if fp16 is not None:
        fp16.close()
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(dict(res, size=comm.size), f)


# benchmarks/cluster.py's overlapped modes: the transport (--comm,
# --comm_dtype) whose work takes time from the computing thread
COMM_COST_MODES = {"overlap": ("overlap", "fp32"), "fp16_polled": ("overlap", "fp16"),
                   "default": ("thread", "fp32"), "fp16": ("thread", "fp16")}
# modes whose buckets take another mode's transport: its cost (low rank's
# sums go through transports of their own, a communication thread as well)
COMM_COST_SAME = {"powersgd": "default", "powersgd_fp16": "fp16"}
# paired timings (alone, with a sum) a mode's cost is the median of: fewer
# spread too much to tell one rate's cost from another's (docs/design/parallel.md,
# "The scaling model")
COMM_COST_REPEATS = 11


def _comm_cost_worker(arg):
    """One rank of measure_comm_cost; ``arg`` is "COMM:OUT": the modes of
    COMM_COST_MODES whose --comm is COMM (the thread level is the job's).
    A loop of small GEMMs standing in for backward, polling the transport
    between products as backward's kernels do, timed alone and while a sum
    of a 16 MB buffer crosses the link (the loop lasts twice a blocking sum,
    so the sum ends inside it)."""
    from ..parallel.comm import get_world
    from ..parallel.transports import make_transport
    comm, out = arg.split(":", 1)
    world = get_world(comm)
    a, b = np.ones((64, 1024), np.float32), np.ones((1024, 1024), np.float32)
    nbytes = 16 * 2 ** 20
    buf = np.ones(nbytes // 4, np.float32)

    def loop(poll, count):
        t = time.perf_counter()
        for _ in range(count):
            np.dot(a, b)
            poll()
        return time.perf_counter() - t

    per_call = loop(lambda: None, 50) / 50
    result = {}
    for mode, (mode_comm, dtype) in COMM_COST_MODES.items():
        if mode_comm != comm:
            continue
        transport = make_transport(world, comm, np, nbytes, dtype)
        world.barrier()
        t = time.perf_counter()
        transport.allreduce(buf)
        count = int(max(0.3, 2 * (time.perf_counter() - t)) / per_call)
        count = world.bcast(count, 0)
        extra = []
        for _ in range(COMM_COST_REPEATS):
            world.barrier()
            alone = loop(lambda: None, count)
            world.barrier()
            handle = transport.allreduce_start(buf)
            polled = loop(transport.poll, count)
            transport.backward_end()
            transport.wait(handle)
            extra.append(polled - alone)
        result[mode] = max(0.0, float(np.median(extra))) / nbytes    # below 0: noise
        transport.close()
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _run_worker(flag, n, cluster, prefix=""):
    """Run this module's ``--<flag>=<prefix><json file>`` worker on n local
    ranks or on the hosts of an emulated cluster; returns the JSON it wrote."""
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    worker = [sys.executable, "-m", "caffempi.tools.scaling_model", "--%s=%s%s" % (flag, prefix, out)]
    if cluster is not None:
        p = cluster.mpiexec(worker, env=env, timeout=600)
        if p.returncode:
            raise SystemExit("%s failed:\n%s" % (flag, p.stderr[-2000:]))
    else:
        from ..parallel.launch import mpiexec_path
        subprocess.run([mpiexec_path() or "mpiexec", "-n", str(n)] + worker, check=True, timeout=300, env=env)
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def measure_comm_cost(cluster):
    """Seconds the computing thread loses per byte of gradient summed in each
    of COMM_COST_MODES on the emulated ``cluster``'s link: {mode: s}."""
    costs = {}
    for comm in sorted({c for c, _ in COMM_COST_MODES.values()}):
        costs.update(_run_worker("comm_cost_worker", 2, cluster, comm + ":"))
    return costs


def calibrate(n=2, cluster=None):
    """Measure Allreduce on n local ranks (shared memory), or on the hosts of
    an emulated ``cluster`` (caffempi.testing.cluster), and fit alpha, beta;
    returns ((alpha, beta), (alpha, beta) of the float16 transport's sums
    per float32 byte or None, the measurements)."""
    data = _run_worker("allreduce_worker", n, cluster, "shm:" if cluster is None else "link:")
    burst = cluster.burst_bytes if cluster is not None and cluster.rate else 0.0
    # a float16 sum sends half the bytes: the bucket lets twice the float32 bytes through
    fp16 = fit(data["fp16_points"], data["size"], 2 * burst) if data["fp16_points"] else None
    return fit(data["points"], data["size"], burst), fp16, data


def fit(points, n, burst=0.0, largest=4 << 20):
    """alpha from the small messages (<= 4 KB), beta by least squares over
    the gradient buckets' range (64 KB to ``largest``, the default bucket:
    TCP moves longer messages through a token-bucket link at a lower rate,
    its queue dropping packets) of ring_time, less the ``burst`` bytes a
    token-bucket link sends at once after the pause before each measured
    sum (REFILL_SECONDS)."""
    small = [t for b, t in points if b <= 4096]
    alpha = float(np.median(small)) / (2 * (n - 1)) if small else 0.0
    big = [(b, t) for b, t in points if 65536 <= b <= largest] or points
    x = np.array([max(0.0, 2.0 * (n - 1) / n * b - burst) for b, _ in big])
    y = np.array([t - 2 * (n - 1) * alpha for _, t in big])
    beta = float(np.dot(x, y) / np.dot(x, x))
    return max(alpha, 0.0), max(beta, 1e-13)


# ---------------------------------------------------------------- reports
def table(profile, name, presets, buckets, ranks=RANKS, jitter=0.0):
    t1 = single_step(profile)
    lines = ["%s: one rank %.2f ms/iter (forward %.2f, backward %.2f), %.2f MB of gradients, "
             "straggler sigma %.2f ms" % (
                 name, 1e3 * t1, profile["forward_ms"], sum(L["backward_ms"] for L in profile["layers"]),
                 sum(L["params"] for L in profile["layers"]) * 4 / 2 ** 20, 1e3 * jitter)]
    hdr = "%-10s %-9s %7s" % ("network", "mode", "bucket") + "".join("%8d" % n for n in ranks)
    lines += [hdr, "-" * len(hdr)]
    rows = {}
    for pname, (alpha, beta) in presets.items():
        for mode in ("blocking", "overlap"):
            for b in (buckets if mode == "overlap" else [None]):
                effs = [t1 / predict(profile, n, alpha, beta, mode, b or 4.0, min(1.0, b or 4.0),
                                     jitter)[0] for n in ranks]
                rows[(pname, mode, b)] = effs
                lines.append("%-10s %-9s %7s" % (pname, mode, "-" if b is None else "%gMB" % b)
                             + "".join("%8.3f" % e for e in effs))
    return "\n".join(lines), rows


def plot(rows_by_net, path, ranks=RANKS):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(rows_by_net), figsize=(6 * len(rows_by_net), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], rows_by_net.items()):
        colors = {p: "C%d" % i for i, p in enumerate(PRESETS)}
        bucket_list = sorted({b for (_, m, b) in rows if b is not None})
        markers = dict(zip(bucket_list, "os^vD*"))
        for (pname, mode, b), effs in rows.items():
            ax.plot(ranks, effs, ("-" if mode == "overlap" else "--"), color=colors.get(pname),
                    marker=markers.get(b, "x"), ms=3,
                    label="%s %s%s" % (pname, mode, "" if b is None else " %gMB" % b))
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("ranks")
        ax.set_ylabel("efficiency (ring allreduce, alpha-beta model)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------- emulated hosts
POSEIDON = "Poseidon (Zhang et al., USENIX ATC 2017): 15.5x on 16 machines, VGG19-22K, 10GbE, GPUs"


def rate_bits(rate):
    """tc's rate ("100mbit", "1gbit", "10gbit") in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    raise ValueError("unknown rate %r" % rate)


def mean_profile(runs):
    """The per-layer profile of single-process runs (scaling.py worker JSON)."""
    prof = {k: float(np.mean([r[k] for r in runs])) for k in ("forward_ms", "compute_ms", "step_ms")}
    prof["batch"] = runs[0].get("batch", 1)
    prof["layers"] = [dict(L, backward_ms=float(np.mean([r["layers"][i]["backward_ms"] for r in runs])))
                      for i, L in enumerate(runs[0]["layers"])]
    return prof


def plan_costs(n, alpha, beta, gemm_rate, memory_rate):
    """The parallel.costs.Costs the reducer plans with on n ranks of this
    link, as it measures them (costs.measure_link): the bandwidth, and an
    8-byte sum's time as the latency a message."""
    from ..parallel.costs import Costs
    return Costs(n, 1.0 / beta, ring_time(8, n, alpha, beta), gemm_rate, memory_rate)


def layer_weights(L):
    """[(rows, cols)] of a layer record's learnable params of two or more
    axes (``weights``), or, without them, a factor layer's weight (N, K)."""
    if L.get("weights") is not None:
        return [tuple(w) for w in L["weights"]]
    return [tuple(L["factors"][1:])] if L.get("factors") and L["params"] else []


def plan(profile, n, alpha, beta, gemm_rate, memory_rate=10e9, sfb="auto", compress="none", bytes_per_value=4):
    """(factor layer indices, low-rank matrices [(layer index, rows, cols,
    rank)]) that the reducer's plan takes on n ranks of this link:
    BucketedAllreduce._plan's rule over config.make_plugins' plug-ins
    (sufficient factors unless ``sfb`` is off, then low rank, which only
    advises under --compress=none): each weight the cheapest way by the
    plug-ins' own estimates (sfb.factor_seconds, powersgd.lowrank_seconds)
    against the allreduce (Costs.allreduce_seconds), a lossy way only
    where it beats the best exact way by more than LOSSY_MARGIN."""
    from ..parallel.powersgd import LowRank, lowrank_seconds, parse_compress
    from ..parallel.sfb import SufficientFactors, factor_seconds
    from ..parallel.sync import BucketedAllreduce
    costs = plan_costs(n, alpha, beta, gemm_rate, memory_rate)
    mode, rank = parse_compress(compress)
    factors, matrices = set(), []
    for L in sorted(profile["layers"], key=lambda L: L["index"]):
        for w, (rows, cols) in enumerate(layer_weights(L)):
            ways = []
            if w == 0 and sfb != "off" and L.get("factors") and L["params"]:
                ways.append((SufficientFactors, "factors", float("-inf") if sfb == "on" else
                             factor_seconds(costs, *L["factors"], itemsize=bytes_per_value)))
            if mode == "powersgd":
                ways.append((LowRank, "low rank", lowrank_seconds(costs, rows, cols, rank, bytes_per_value)))
            best, chosen = costs.allreduce_seconds(rows * cols * bytes_per_value), None
            for plugin, way, seconds in ways:
                if seconds < (best * (1 - BucketedAllreduce.LOSSY_MARGIN) if plugin.lossy else best):
                    best, chosen = seconds, way
            if chosen == "factors":
                factors.add(L["index"])
            elif chosen == "low rank":
                matrices.append((L["index"], rows, cols, rank))
    return factors, matrices


def factor_choice(profile, n, alpha, beta, gemm_rate):
    """The layers --sfb=auto would take (plan, without low rank)."""
    return plan(profile, n, alpha, beta, gemm_rate)[0]


# the reducer's plan lines (benchmarks/cluster.py keeps them as a record's "choices")
PLAN_LINE = re.compile(r"Plan: (.+)\[(\d+)\] \((\d+(?:x\d+)*)\): .*: (allreduce|sufficient factors|low rank)$")


def plan_lines(choices):
    """[(layer name, (rows, cols), way)] of the reducer's plan lines, a
    line a weight of two or more axes (every run with the reducer's
    plug-ins logs them: low rank always offers, if only to advise)."""
    out = []
    for line in choices or ():
        m = PLAN_LINE.search(line.strip())
        if m:
            shape = [int(d) for d in m.group(3).split("x")]
            out.append((m.group(1), (shape[0], int(np.prod(shape[1:]))), m.group(4)))
    return out


def with_weights(profile, weights):
    """``profile`` with each layer's ``weights`` from {layer name: [(rows,
    cols)]} (a net without an entry keeps what it had)."""
    if not weights:
        return profile
    return dict(profile, layers=[dict(L, weights=[list(w) for w in weights.get(L["name"], [])])
                                 for L in profile["layers"]])


def bench_net_weights(name):
    """{layer name: [(rows, cols)]}: the learnable params of two or more
    axes (rows the first axis, as LowRank takes them) of benchmarks/
    scaling.py's net ``name``, built here at one image."""
    from ..net import Net
    from ..proto import caffe_pb2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import scaling
    finally:
        sys.path.pop(0)
    param = scaling.load_net_param(name)
    for lp in param.layer:
        if lp.type == "Input":
            for shape in lp.input_param.shape:
                if len(shape.dim):
                    shape.dim[0] = 1
    net = Net(param, caffe_pb2.TRAIN)
    out = {}
    for blob, li in zip(net.learnable_params, net.param_layer_index):
        if len(blob.shape) >= 2:
            out.setdefault(net.layer_names[li], []).append((blob.shape[0], blob.count // blob.shape[0]))
    return out


def _plan_summary(profile, factors, matrices):
    """One line: the layers on factors and on low rank, and the share of
    the weights low rank takes."""
    names = {L["index"]: L["name"] for L in profile["layers"]}
    total = sum(L["params"] for L in profile["layers"])
    low = sorted({i for i, _, _, _ in matrices}, key=lambda i: i)

    def listed(indices):
        indices = sorted(indices)
        if len(indices) <= 8:
            return ", ".join(names[i] for i in indices) or "none"
        return "%d layers (%s ... %s)" % (len(indices), names[indices[0]], names[indices[-1]])
    return "factors: %s; low rank: %s (%.0f%% of the values)" % (
        listed(factors), listed(low), 100.0 * sum(r * c for _, r, c, _ in matrices) / max(total, 1))


def _record_compress(mode):
    """--compress and the wire's bytes a value of a benchmarks/cluster.py mode."""
    return ("powersgd" if "powersgd" in mode else "none"), (2 if "fp16" in mode else 4)


def cluster_report(records, links, gemm_rate, weight_grad_seconds=None, burst=0.0, comm_costs=None,
                   fp16_links=None, hosts=(16, 64), memory_rate=10e9, weights=None, compress="powersgd"):
    """Predicted against measured 2-host figures (benchmarks/cluster.py
    --json), then each net's predicted efficiency on more hosts.  Each 2-host
    prediction: the independent pair's per-layer profile of the same run, the
    link's alpha, beta and token bucket (``burst``), the float16 transport's
    sums (``fp16_links``: rate -> (alpha, beta per float32 byte), calibrate),
    the run's own plan (its plan lines: the weights on factors and on low
    rank), the factor layers' measured weight-gradient times, the
    transports' cost to the computing thread (``comm_costs``: rate ->
    {mode: s per byte}, measure_comm_cost), and the straggler term with
    sigma from the skew of the *other* 2-host runs of the same net (so no
    run's own wait predicts it).  The host table: --sfb off/auto by
    --compress none/``compress``, the reducer's plan per host count
    (``weights``: {net: {layer name: [(rows, cols)]}} of the weights low
    rank could take, else the runs' plan lines say them; ``memory_rate``:
    bytes/s of a pass, for low rank's)."""
    from ..parallel.powersgd import parse_compress
    lines = ["2 emulated hosts: predicted from the independent pair's profile (run alongside), against "
             "the measurement (GEMM %.0f GFLOP/s, memory %.1f GB/s)" % (gemm_rate / 1e9, memory_rate / 1e9),
             "%-14s %-7s %-13s %10s %10s %8s %9s %9s  %s" % ("net", "rate", "mode", "pred. ms", "meas. ms", "error",
                                                          "pred. eff", "meas. eff", "plan")]
    profiles, within, seen = {}, [], {}
    measured = [r for r in records if r.get("runs")]
    for r in records:
        for name, shape, _ in plan_lines(r.get("choices")):
            seen.setdefault(r["net"], {}).setdefault(name, [])
            if shape not in seen[r["net"]][name]:
                seen[r["net"]][name].append(shape)
    weights = dict(seen, **(weights or {}))
    for r in records:
        base_mode, _, balance = r["mode"].partition("/")
        uneven = r.get("throttle") is not None
        speeds = [x["images_per_s"] for x in r["pair_runs"]] if uneven else []
        # a throttled pair: the fastest process's profile, at each rank's speed; else the pair's mean
        profile = with_weights(mean_profile([max(r["pair_runs"], key=lambda x: x["images_per_s"])]
                                            if uneven else r["pair_runs"]), weights.get(r["net"]))
        profiles[r["net"]] = profile
        if not r.get("runs"):
            continue
        if uneven:
            profile = scaled_profile(profile, share_time_scale(speeds, r["runs"][0]["batch"], balance == "auto"))
        alpha, beta = links[r["rate"]]
        # the straggler term (a balance residual under auto) from the other runs balanced alike
        others = [np.mean([x["skew_ms"] for x in o["runs"]]) for o in measured
                  if o["net"] == r["net"] and o is not r and o["mode"].partition("/")[2] == balance]
        jitter = jitter_from_skew(float(np.mean(others))) / 1e3 if others else 0.0
        mode_compress, wire = _record_compress(base_mode)
        rank = parse_compress(mode_compress)[1]
        index = {L["name"]: L["index"] for L in profile["layers"]}
        taken = [(index[name], shape, way) for name, shape, way in plan_lines(r.get("choices")) if name in index]
        used = {L["index"] for L in r["runs"][0]["layers"] if L.get("factors_used")}
        used |= {i for i, _, way in taken if way == "sufficient factors"}
        # the run's low-rank layers (its layer records' rank, its plan lines' shapes)
        ranks = {L["index"]: L["low_rank"] for L in r["runs"][0]["layers"] if L.get("low_rank")}
        shapes = {i: shape for i, shape, way in taken if way == "low rank"}
        for L in profile["layers"]:
            if L["index"] in ranks and L["index"] not in shapes and layer_weights(L):
                shapes[L["index"]] = layer_weights(L)[0]
        lowrank = [(i, rows, cols, ranks.get(i, rank)) for i, (rows, cols) in sorted(shapes.items())]
        if not taken and not ranks and mode_compress != "none":
            # no plan lines: the plan's rule at this link
            used, lowrank = plan(profile, 2, alpha, beta, gemm_rate, memory_rate, "auto", mode_compress, wire)
        fp16 = wire == 2
        cost = (comm_costs or {}).get(r["rate"], {}).get(COMM_COST_SAME.get(base_mode, base_mode), 0.0)
        if base_mode == "barrier":
            # a barrier after backward, no gradients: free communication, the straggler term only
            step = predict(profile, 2, 0.0, 1e-18, jitter=jitter)[0]
            used, lowrank = set(), []
        else:
            step = predict(profile, 2, alpha, beta, "blocking" if base_mode == "blocking" else "overlap",
                           jitter=jitter, factors=used, gemm_rate=gemm_rate, bytes_per_value=wire,
                           burst=burst, weight_grad_seconds=weight_grad_seconds, comm_cpu_seconds_per_byte=cost,
                           sum_link=(fp16_links or {}).get(r["rate"]) if fp16 else None, lowrank=lowrank,
                           memory_rate=memory_rate)[0]
        meas = r["step_ms"] / 1e3
        within.append(abs(step - meas) <= 0.1 * meas)
        # efficiency against the pair's summed rates: the fastest's step over the job's, times 2 / sum(s)
        ideal = single_step(profiles[r["net"]]) * (2.0 * max(speeds) / sum(speeds) if uneven else 1.0)
        lines.append("%-14s %-7s %-13s %10.1f %10.1f %+7.1f%% %9.3f %9.3f  %s" % (
            r["net"], r["rate"], r["mode"], 1e3 * step, 1e3 * meas, 100 * (step - meas) / meas,
            ideal / step, r["efficiency"],
            "factors %d, low rank %d" % (len(used), len(lowrank))))
    lines.append("%d of %d predictions within 10%%" % (sum(within), len(within)))
    cols = "".join("%9s" % ("%d hosts" % h) for h in hosts) + ("%12s" % "speedup@16" if 16 in hosts else "")
    lines += ["", "Predicted efficiency on more hosts, one rank a host, the per-rank batch of the runs above "
              "(the reducer's plan per host count: --sfb=auto's factors, --compress=%s's low rank; straggler "
              "sigma from the net's 2-host runs' skew):" % compress,
              "%-14s %-9s %-5s %-13s" % ("net", "network", "sfb", "compress") + cols]
    plans = []
    for name, profile in profiles.items():
        skews = [np.mean([x["skew_ms"] for x in o["runs"]]) for o in measured if o["net"] == name]
        jitter = jitter_from_skew(float(np.mean(skews))) / 1e3 if skews else 0.0
        if not any(L.get("weights") for L in profile["layers"]):
            lines.append("%-14s (no weight shapes: low rank not modelled)" % name)
        for pname in ("10GbE", "100Gb-IB"):
            alpha, beta = PRESETS[pname]
            for sfb in ("off", "auto"):
                for comp in ("none", compress):
                    effs = []
                    for h in hosts:
                        used, lowrank = plan(profile, h, alpha, beta, gemm_rate, memory_rate, sfb, comp)
                        effs.append(single_step(profile) / predict(
                            profile, h, alpha, beta, "overlap", jitter=jitter, factors=used, gemm_rate=gemm_rate,
                            weight_grad_seconds=weight_grad_seconds, lowrank=lowrank,
                            memory_rate=memory_rate)[0])
                        if sfb == "auto" and comp != "none":
                            plans.append("%-14s %-9s %3d hosts: %s" % (name, pname, h,
                                                                      _plan_summary(profile, used, lowrank)))
                    lines.append("%-14s %-9s %-5s %-13s" % (name, pname, sfb, comp)
                                 + "".join("%9.3f" % e for e in effs)
                                 + ("%11.1fx" % (16 * effs[list(hosts).index(16)]) if 16 in hosts else ""))
            for balance in (False, True):
                # one host at SLOW_HOST of a core's speed, against the hosts' summed rates
                effs = []
                for h in hosts:
                    speeds = [1.0] * (h - 1) + [SLOW_HOST]
                    used, lowrank = plan(profile, h, alpha, beta, gemm_rate, memory_rate, "auto", "none")
                    slow = scaled_profile(profile, share_time_scale(speeds, int(profile.get("batch", 1)), balance))
                    effs.append(single_step(profile) * h / sum(speeds) / predict(
                        slow, h, alpha, beta, "overlap", jitter=jitter, factors=used, gemm_rate=gemm_rate,
                        weight_grad_seconds=weight_grad_seconds, memory_rate=memory_rate)[0])
                lines.append("%-14s %-9s %-5s %-13s" % (name, pname, "auto", "slow host, %s" % (
                    "balance" if balance else "equal")) + "".join("%9.3f" % e for e in effs))
    lines += ["(%s: %.2f of linear on 16 machines; 'slow host' rows: one host at %.1f of the others' speed, "
              "--balance=off ('equal') or auto ('balance'), against the hosts' summed rates)"
              % (POSEIDON, 15.5 / 16, SLOW_HOST), "",
              "The plan of the sfb=auto, compress=%s rows:" % compress] + plans
    return "\n".join(lines)


def one_thread(measure, *args, **kwargs):
    """``measure(*args)`` on one BLAS and kernel thread (a rank's setting in
    the runs)."""
    from threadpoolctl import threadpool_limits
    from ..backend import threads
    with threadpool_limits(1):
        threads.set_thread_count(1)
        return measure(*args, **kwargs)


def measure_gemm_rate():
    """FLOP/s of one thread's float32 GEMM, as the reducer's plan measures it (parallel.costs)."""
    from ..parallel.costs import measure_gemm_rate as measure
    return one_thread(measure, repeats=3)


def weight_grad_timer():
    """A memoised weight_grad_seconds(rows, M, N, accumulate) for predict:
    one thread, measured here (sfb.measure_weight_grad_seconds)."""
    from ..parallel.sfb import measure_weight_grad_seconds
    cache = {}

    def seconds(rows, m, k, accumulate):
        if (rows, m, k, accumulate) not in cache:
            cache[rows, m, k, accumulate] = one_thread(measure_weight_grad_seconds, rows, m, k, accumulate)
        return cache[rows, m, k, accumulate]
    return seconds


FLAGS = FlagSet("scaling_model", __doc__.strip())
FLAGS.define("allreduce_worker", "", "Internal: run as one rank of --calibrate's measurement, shm|link:JSON_FILE.")
FLAGS.define("comm_cost_worker", "", "Internal: run as one rank of --calibrate_links' measurement of the "
             "transports' cost to the computing thread, COMM:JSON_FILE.")
FLAGS.define("bench", "", "JSON of benchmarks/scaling.py --json")
FLAGS.define("calibrate", False, "measure shared-memory alpha/beta on 2 ranks")
FLAGS.define("alpha_us", None, "shared-memory alpha (skip --calibrate)", kind=float)
FLAGS.define("beta_ns", None, "shared-memory beta in ns per byte", kind=float)
FLAGS.define("validate", False, "compare the 2-rank prediction (shared-memory alpha/beta) to the measurement")
FLAGS.define("jitter_ms", None, "per-rank independent step-time sigma (ms) for the straggler term; default: "
             "from the bench's 2-rank skew", kind=float)
FLAGS.define("buckets", "0.25,1,4,25", "bucket sizes (MB) for the overlap rows")
FLAGS.define("plot", "", "save a PNG of efficiency vs ranks")
FLAGS.define("cluster_bench", "", "JSON of benchmarks/cluster.py --json: predict its 2-host runs and print the "
             "predictions for 16 and 64 hosts")
FLAGS.define("calibrate_links", False, "with --cluster_bench: measure alpha/beta on an emulated link of each "
             "rate (root); else beta from the rate and --link_latency_us")
FLAGS.define("link_latency_us", 50.0, "the link latency assumed without --calibrate_links")
FLAGS.define("link", [], "with --cluster_bench: links measured before (by --calibrate_links), "
             "RATE:ALPHA_US:GBITS each, e.g. 1gbit:25.3:0.95, or RATE:ALPHA_US:GBITS:FP16_ALPHA_US:FP16_GBITS "
             "with the float16 transport's sums (Gbit/s of float32 gradient)")
FLAGS.define("comm_cost", [], "with --cluster_bench: the transports' costs measured before (by "
             "--calibrate_links), RATE:MODE=NS,MODE=NS,... (ns of compute lost per byte of gradient summed "
             "while backward computes)")
FLAGS.define("gemm_gflops", 0.0, "the GEMM rate (0: measured here, 1 thread)")
FLAGS.define("memory_gbps", 0.0, "with --cluster_bench: the memory rate of a pass over an array, GB/s, for "
             "low rank's passes (0: measured here, as the reducer's plan measures it)")
FLAGS.define("compress", "powersgd", "with --cluster_bench: the host table's low-rank rows, powersgd[:RANK]")


def _numbers(flag, given, fields):
    """``fields`` of the flag value ``given`` as floats, or a CaffeError naming it."""
    values = []
    for v in fields:
        try:
            values.append(float(v))
        except ValueError:
            raise CaffeError("%s '%s': '%s' is not a number" % (flag, given, v)) from None
    return values


def _main(a):
    if a.allreduce_worker:
        return _allreduce_worker(a.allreduce_worker)
    if a.comm_cost_worker:
        return _comm_cost_worker(a.comm_cost_worker)
    if a.cluster_bench:
        with open(a.cluster_bench) as f:
            records = json.load(f)
        from ..testing.cluster import Cluster
        links, fp16_links, comm_costs = {}, {}, {}
        for given in a.link:
            rate, *fields = given.split(":")
            values = _numbers("--link", given, fields)
            if len(values) not in (2, 4) or 0.0 in values[1::2]:
                raise CaffeError("--link '%s': expected RATE:ALPHA_US:GBITS[:FP16_ALPHA_US:FP16_GBITS], "
                                 "Gbit/s above 0" % given)
            links[rate] = (values[0] * 1e-6, 8e-9 / values[1])
            if len(values) == 4:
                fp16_links[rate] = (values[2] * 1e-6, 8e-9 / values[3])
        cost_rate = None
        for given in a.comm_cost:
            # a list flag splits at commas: a MODE=NS without RATE: is the previous item's rate
            head, _, cost = given.rpartition(":")
            cost_rate = head or cost_rate
            mode, sep, ns = cost.partition("=")
            if not (cost_rate and mode and sep):
                raise CaffeError("--comm_cost '%s': expected RATE:MODE=NS,MODE=NS,..." % given)
            comm_costs.setdefault(cost_rate, {})[mode] = _numbers("--comm_cost", given, [ns])[0] * 1e-9
        for rate in sorted({r["rate"] for r in records if r["rate"]}):
            if a.calibrate_links and (rate not in links or rate not in comm_costs):
                with Cluster(2, rate) as cluster:
                    if rate not in links:
                        links[rate], fp16_links[rate], _ = calibrate(2, cluster)
                    if rate not in comm_costs:
                        comm_costs[rate] = measure_comm_cost(cluster)
            elif rate not in links:
                links[rate] = (a.link_latency_us * 1e-6, 8.0 / rate_bits(rate))
        for rate, (alpha, beta) in sorted(links.items()):
            fp16 = fp16_links.get(rate)
            print("link %s: alpha %.1f us, %.3g Gbit/s%s%s" % (
                rate, 1e6 * alpha, 8e-9 / beta,
                "" if fp16 is None else "; float16 sums: alpha %.1f us, %.3g Gbit/s of float32 gradient"
                % (1e6 * fp16[0], 8e-9 / fp16[1]),
                "".join("; %s costs the computing thread %.2f ns a byte" % (mode, 1e9 * cost)
                        for mode, cost in sorted(comm_costs.get(rate, {}).items()))))
        rate = a.gemm_gflops * 1e9 if a.gemm_gflops else measure_gemm_rate()
        from ..parallel.costs import measure_memory_rate
        from ..parallel.powersgd import parse_compress
        parse_compress(a.compress)
        memory = a.memory_gbps * 1e9 if a.memory_gbps else one_thread(measure_memory_rate)
        weights = {}
        for net in sorted({r["net"] for r in records}):
            try:
                weights[net] = bench_net_weights(net)
            except Exception as e:          # not a benchmarks/scaling.py net here: the runs' plan lines
                why = (str(e).splitlines() or [type(e).__name__])[0]
                print("%s: no net to read the weights' shapes from here (%s)" % (net, why))
        print(cluster_report(records, links, rate, weight_grad_timer(), burst=Cluster.burst_bytes,
                             comm_costs=comm_costs, fp16_links=fp16_links, memory_rate=memory, weights=weights,
                             compress=a.compress))
        return 0
    shm = None
    if a.calibrate:
        (alpha, beta), _, data = calibrate(2)
        shm = (alpha, beta)
        print("shared-memory allreduce on 2 ranks (measured):")
        for b, t in data["points"]:
            print("  %10d B  %9.1f us   model %9.1f us" % (b, 1e6 * t, 1e6 * ring_time(b, 2, alpha, beta)))
        print("fit: alpha = %.2f us, beta = %.3f ns/B (%.2f GB/s)" % (alpha * 1e6, beta * 1e9, 1e-9 / beta))
    elif a.alpha_us is not None and a.beta_ns is not None:
        shm = (a.alpha_us * 1e-6, a.beta_ns * 1e-9)
    if not a.bench:
        return 0
    with open(a.bench) as f:
        bench = json.load(f)
    buckets = [float(b) for b in a.buckets.split(",")]
    rows_by_net = {}
    for name, runs in bench.items():
        base = runs["independent"]["raw"]
        profile = {k: float(np.mean([r[k] for r in base])) for k in ("forward_ms", "compute_ms", "step_ms")}
        profile["layers"] = [dict(L, backward_ms=float(np.mean([r["layers"][i]["backward_ms"] for r in base])))
                             for i, L in enumerate(base[0]["layers"])]
        mpi_runs = [r for m, run in runs.items() if m != "independent" for r in run["raw"]]
        if a.jitter_ms is not None:
            jitter = a.jitter_ms / 1e3
        else:
            jitter = jitter_from_skew(float(np.mean([r["skew_ms"] for r in mpi_runs]))) / 1e3 if mpi_runs else 0.0
        txt, rows = table(profile, name, PRESETS, buckets, jitter=jitter)
        print(txt)
        print()
        rows_by_net[name] = rows
        if a.validate and shm:
            print("%s, 2 ranks on this machine (shared memory alpha %.1f us, beta %.3f ns/B):"
                  % (name, shm[0] * 1e6, shm[1] * 1e9))
            # without the straggler term: its sigma is read from these same
            # runs' skew, so it could not be checked against them
            for mode in [m for m in runs if m != "independent"]:
                meas = runs[mode]["raw"]
                bmb = 4.0
                pm = "blocking" if mode in ("blocking", "barrier") else "overlap"
                # scaling.py's barrier run sends nothing: free communication
                alpha, beta = (0.0, 0.0) if mode == "barrier" else shm
                step, exp = predict(profile, 2, alpha, beta, pm, bmb)
                m_step = float(np.mean([r["step_ms"] for r in meas]))
                # the same with this run's own compute time: checks the
                # communication part of the model apart from the machine's
                # load changing between runs
                own = float(np.mean([r["compute_ms"] for r in meas])) + 1e3 * exp
                print("  %-9s predicted %7.2f ms/iter (exposed %5.2f), measured %7.2f ms/iter: %+5.1f%%; "
                      "efficiency predicted %.3f, measured %.3f; from this run's compute: predicted "
                      "%7.2f ms/iter, %+5.1f%%" % (
                          mode, 1e3 * step, 1e3 * exp, m_step, 100 * (1e3 * step - m_step) / m_step,
                          single_step(profile) / step, runs[mode].get("efficiency", float("nan")),
                          own, 100 * (own - m_step) / m_step))
            print()
    if a.plot:
        plot(rows_by_net, a.plot)
        print("plot saved to %s" % a.plot)
    return 0



def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
