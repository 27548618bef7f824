"""Per-layer host and GPU time of a training net, without a device
synchronization after each layer (``caffempi time`` and ``gpu_speed.py
--layers`` synchronize per layer, which mixes the two).

    python benchmarks/gpu_profile.py [--nets resnet50,alexnet] [--iterations 5]
        [--zoo DIR] [--batch N] [--cpu]

The nets are gpu_speed.py's (benchmarks/bench_nets.py), built by the same
solver (memory "reuse"), strict float32.  After 3 warm-up iterations, three
passes over each layer's forward and backward (median over iterations):

- host: the host clock around each call, no synchronization: what issuing
  the layer costs in Python, plus any wait for the device the layer makes;
- gpu: before each call a spin kernel holds the stream for 1.5x the call's
  host time plus 0.5 ms (at most 0.2 s), so the CUDA events around the call
  time its kernels back to back, free of the gaps of the host issuing them.
  A call whose host time outlasts its spin waited for the device: it
  synchronizes the host, marked 'sync' (its gpu time then includes the
  host's time after the wait);
- step: Solver.step(1) on the wall clock, synchronized once per step;
  then its parts, net.forward_backward() and solver.apply_update(), each
  synchronized.

A chain the net runs fused (Net.fused_chains) is one call, shown on its
first layer forward and on its last layer backward.

With --cpu, or without CuPy and a device, the nets run on NumPy and the gpu
pass prints 'gpu: skipped: no GPU'.
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_nets import ZOO, net_param, random_inputs  # noqa: E402

SPIN = r"""
extern "C" __global__ void caffempi_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}
"""


def gpu_module():
    """CuPy when it sees a device, else None."""
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


class CudaTimer:
    """What the gpu pass needs of the device: a spin of ``ns`` nanoseconds
    on the current stream, timing events, their elapsed ms, a synchronize."""

    def __init__(self, cp):
        self.cp = cp
        self._spin = cp.RawKernel(SPIN, "caffempi_spin")

    def spin(self, ns):
        self._spin((1,), (1,), (np.int64(ns),))

    def event(self):
        return self.cp.cuda.Event()

    def elapsed(self, start, end):
        return self.cp.cuda.get_elapsed_time(start, end)

    def synchronize(self):
        self.cp.cuda.get_current_stream().synchronize()


def build(key, zoo, xp, batch=None):
    from caffempi.proto import caffe_pb2
    from caffempi.solvers import get_solver
    param, batch = net_param(key, zoo, batch)
    sp = caffe_pb2.SolverParameter(net_param=param, base_lr=1e-4, momentum=0.9, lr_policy="fixed",
                                   max_iter=10 ** 6, display=0, snapshot_prefix="/tmp/gpu_profile")
    solver = get_solver(sp, xp=xp)
    for name, a in random_inputs(solver.net).items():
        solver.net.blobs[name].data = xp.asarray(a)
    return solver, batch


def units(net):
    """The calls a pass is timed in, (F|B, layer index), in the order a
    training pass runs them: each layer alone, but a chain the net runs
    fused (Net.fused_chains) as one call, on its first layer forward and on
    its last layer backward, as ``caffempi time`` reports it: a dict
    (kind, index) -> (first, last), in that order."""
    forward, backward = (dict(chains) for chains in net.fused_chains())
    ends = {last: first for first, last in backward.items()}
    spans = {}
    i = 0
    while i < len(net.layers):
        spans["F", i] = (i, forward.get(i, i))
        i = spans["F", i][1] + 1
    i = len(net.layers) - 1
    while i >= 0:
        spans["B", i] = (ends.get(i, i), i)
        i = spans["B", i][0] - 1
    return spans


def run_unit(net, kind, span):
    """One call of :func:`units`: the forward or backward of layers
    span = (first, last)."""
    first, last = span
    if kind == "F":
        net.forward_range(first, last)
    else:
        net.backward_range(last, first)      # Caffe's order: from the last down


def profile(solver, iterations, timer=None):
    """{'calls': [(F|B, layer index)], 'host', 'gpu', 'sync': per call (ms,
    ms, bool; gpu None without a timer), 'eager_ms', 'step_ms'}.  ``timer``:
    a :class:`CudaTimer` (None on NumPy: the host pass and steps only)."""
    net = solver.net
    spans = units(net)
    calls = list(spans)

    def run(kind, i):
        run_unit(net, kind, spans[kind, i])

    def sync():
        if timer is not None:
            timer.synchronize()

    for _ in range(3):
        for kind, i in calls:
            run(kind, i)
    sync()
    host = np.zeros((iterations, len(calls)))
    eager = []
    for it in range(iterations):
        t_it = time.perf_counter()
        for k, (kind, i) in enumerate(calls):
            t = time.perf_counter()
            run(kind, i)
            host[it, k] = time.perf_counter() - t
        sync()
        eager.append(time.perf_counter() - t_it)
    host_s = np.median(host, axis=0)
    out = {"calls": calls, "host": host_s * 1e3, "gpu": None, "sync": np.zeros(len(calls), bool),
           "eager_ms": float(np.median(eager)) * 1e3}
    if timer is not None:
        starts = [timer.event() for _ in calls]
        ends = [timer.event() for _ in calls]
        gpu = np.zeros((iterations, len(calls)))
        synced = np.zeros((iterations, len(calls)), bool)
        # ns of spin per call (at most 0.2 s: a call that waits longer syncs anyway)
        budget = [int(min(1.5 * h + 0.5e-3, 0.2) * 1e9) for h in host_s]
        for it in range(iterations):
            for k, (kind, i) in enumerate(calls):
                timer.spin(budget[k])
                starts[k].record()
                t = time.perf_counter()
                run(kind, i)
                dt = time.perf_counter() - t
                ends[k].record()
                synced[it, k] = dt * 1e9 >= 0.9 * budget[k]
            timer.synchronize()
            gpu[it] = [timer.elapsed(s, e) for s, e in zip(starts, ends)]
        out["gpu"] = np.median(gpu, axis=0)
        out["sync"] = synced.mean(axis=0) > 0.5
    steps = []
    for _ in range(iterations):
        t = time.perf_counter()
        solver.step(1)
        sync()
        steps.append(time.perf_counter() - t)
    out["step_ms"] = float(np.median(steps)) * 1e3
    passes, updates = [], []
    for _ in range(iterations):
        sync()
        t = time.perf_counter()
        net.clear_param_diffs()
        net.forward_backward()
        sync()
        t1 = time.perf_counter()
        solver.apply_update()
        sync()
        passes.append(t1 - t)
        updates.append(time.perf_counter() - t1)
    out["pass_ms"], out["update_ms"] = float(np.median(passes)) * 1e3, float(np.median(updates)) * 1e3
    return out


def report(name, batch, net, r, top=15):
    layers, types = net.layer_names, [layer.type for layer in net.layers]
    has_gpu = r["gpu"] is not None
    gpu = r["gpu"] if has_gpu else np.full(len(r["calls"]), np.nan)
    host = r["host"]
    print("\n== %s, batch %d: per-layer host and GPU ms (median of iterations; no sync per layer)" % (name, batch))
    print("step (Solver.step, synced once): %.2f ms = %.1f images/s" % (r["step_ms"], batch * 1e3 / r["step_ms"]))
    print("step's parts, synced after each: forward_backward %.2f ms, apply_update %.2f ms"
          % (r["pass_ms"], r["update_ms"]))
    print("forward+backward issued without sync: %.2f ms wall; host %.2f ms; gpu %s"
          % (r["eager_ms"], host.sum(),
             "%.2f ms (kernels back to back)" % gpu.sum() if has_gpu else "skipped: no GPU"))
    syncs = ["%s %s" % (layers[i], "forward" if kind == "F" else "backward")
             for (kind, i), s in zip(r["calls"], r["sync"]) if s]
    if has_gpu:
        print("host synchronizations (calls that outlasted their spin): %s" % (", ".join(syncs) or "none"))
    by_type = defaultdict(lambda: np.zeros(4))
    for (kind, i), h, g in zip(r["calls"], host, gpu):
        j = 0 if kind == "F" else 2
        by_type[types[i]][j:j + 2] += (h, g)
    print("\nby layer type         fwd host   fwd gpu  bwd host   bwd gpu   (ms, summed over layers)")
    for t, v in sorted(by_type.items(), key=lambda kv: -np.nansum(kv[1])):
        print("  %-18s %9.3f %9.3f %9.3f %9.3f" % ((t,) + tuple(v)))
    order = np.argsort(-(np.nan_to_num(gpu) if has_gpu else host))[:top]
    print("\nslowest calls (by %s)    host ms    gpu ms" % ("gpu" if has_gpu else "host"))
    for k in order:
        kind, i = r["calls"][k]
        print("  %-28s %-3s %9.3f %9.3f%s" % (layers[i][:28], kind, host[k], gpu[k],
                                             "  sync" if r["sync"][k] else ""))
    print("\nall calls: layer, type, pass, host ms, gpu ms, sync")
    for k, (kind, i) in enumerate(r["calls"]):
        print("  %-28s %-16s %s %9.3f %9.3f %d" % (layers[i][:28], types[i][:16], kind, host[k], gpu[k],
                                                  int(r["sync"][k])))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default="resnet50,alexnet")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--zoo", default=str(ZOO))
    ap.add_argument("--batch", type=int, default=None, help="override each net's batch")
    ap.add_argument("--cpu", action="store_true", help="NumPy, host pass only")
    args = ap.parse_args(argv)
    xp = None if args.cpu else gpu_module()
    use_gpu = xp is not None
    if not use_gpu:
        xp = np
        print("gpu: skipped: no GPU (%s); host pass on NumPy" % ("--cpu" if args.cpu else "no CuPy device"))
    status = 0
    for key in args.nets.split(","):
        try:
            solver, batch = build(key, args.zoo, xp, args.batch)
            r = profile(solver, args.iterations, CudaTimer(xp) if use_gpu else None)
            report(key, batch, solver.net, r)
        except Exception as e:      # report and go on to the next net
            print("%s: failed: %s: %s" % (key, type(e).__name__, e))
            status = 1
        sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
