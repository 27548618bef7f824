"""Memory modes benchmark (issue 7): peak activation / gradient bytes and
ms per iteration of LeNet, CIFAR10-full, AlexNet, GoogLeNet and ResNet-50 on
the CPU under --memory=none|reuse|recompute, and the largest ResNet-50 batch
that trains within a memory budget in each mode.

    .venv/bin/python benchmarks/memory.py                 # table + batch search
    .venv/bin/python benchmarks/memory.py --nets lenet --no-search
    .venv/bin/python benchmarks/memory.py --budget-gb 4 --search-only

Every measurement runs in its own subprocess (a clean heap, tracemalloc
started before the net is built).  Figures:
  act / grad   peak live bytes of activation data (+ layer-held state, +
               recompute stashes) and of activation diffs, sampled at every
               layer step (caffempi.memory.measure), in steady state (2nd pass)
  traced       tracemalloc peak of everything NumPy allocated during the pass
               (includes layer temporaries such as im2col buffers), less the
               static allocations (parameters, ...)
  ms/iter      forward+backward CPU time (user+sys) of one pass: the minimum over
               --rounds rounds of --iters passes, modes alternating (robust to
               other load on the machine); wall-clock medians in the JSON
  Every process uses caffempi.memory.tune_allocator() (glibc keeps freed
  memory for reuse), none included, so the modes are compared on equal terms.
The batch search (one chain of trial subprocesses per mode, run side by side)
starts from a power of two below the linear estimate from batches 1 and 2,
doubles the batch until the traced peak of two training passes (parameters
and all live arrays included, set-up's untouched zero blobs not) exceeds the
budget, then bisects.
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(os.path.dirname(REPO), "shared", "caffe-zoo")
sys.path.insert(0, REPO)

# name: (prototxt under the zoo, per-image data shape or None, batch)
NETS = {
    "lenet": ("bvlc/examples/mnist/lenet_train_test.prototxt", (1, 28, 28), 64),
    "cifar10_full": ("bvlc/examples/cifar10/cifar10_full_train_test.prototxt", (3, 32, 32), 100),
    "alexnet": ("bvlc/models/bvlc_alexnet/train_val.prototxt", None, 16),
    "googlenet": ("bvlc/models/bvlc_googlenet/train_val.prototxt", None, 8),
    "resnet50": ("resnet/ResNet-50-deploy.prototxt", None, 8),
}
MODES = ("none", "reuse", "recompute")


def build(name, mode, batch):
    from caffempi import Net, TRAIN, set_random_seed
    from caffempi.io import proto_io
    from caffempi.memory import training_variant, tune_allocator
    tune_allocator()            # the same allocator settings in every mode, none included
    from caffempi.timing import randomize_inputs, substitute_data_layers
    rel, shape, _ = NETS[name]
    path = os.path.join(ZOO, rel)
    param = proto_io.read_net_param(path)
    param = substitute_data_layers(param, shape, only_unreadable=False, warn=False, batch_size=batch)
    param = training_variant(param, batch, path)
    set_random_seed(1)
    net = Net(param, phase=TRAIN, memory=mode, source_name=path)
    randomize_inputs(net)
    return net


def worker(name, mode, batch):
    """Memory figures of one net in one mode (caffempi.memory.measure)."""
    import tracemalloc
    from caffempi.memory import measure
    tracemalloc.start()
    net = build(name, mode, batch)
    param_bytes = net.param_data.nbytes + net.param_diff.nbytes
    tracemalloc.stop()
    m = measure(net, passes=2)
    m.update(name=name, batch=batch, param_bytes=param_bytes,
             blob_bytes=net.memory_summary()["activation_bytes"])
    return m


def timing(name, mode, batch, iters):
    """ms of each of ``iters`` forward-backward passes after a warm-up pass."""
    net = build(name, mode, batch)
    net.forward_backward()
    times, cpu, sys_ = [], [], []
    for _ in range(iters):
        t, p, c = time.perf_counter(), time.process_time(), os.times()
        net.forward_backward()
        times.append(1e3 * (time.perf_counter() - t))
        cpu.append(1e3 * (time.process_time() - p))
        c2 = os.times()
        sys_.append(1e3 * (c2.system - c.system))
    return {"times": times, "cpu": cpu, "sys": sys_}


def trial(name, mode, batch):
    """Traced peak (everything NumPy allocates, parameters included) over two
    training passes.  Tracing starts before the net is built so every live
    array is counted; the peak is reset after set-up, whose zero-filled blob
    arrays (calloc: never touched, so never resident) would otherwise count."""
    import tracemalloc
    tracemalloc.start()
    net = build(name, mode, batch)
    tracemalloc.reset_peak()
    for _ in range(2):
        net.clear_param_diffs()
        net.forward_backward()
    return {"peak_bytes": tracemalloc.get_traced_memory()[1], "batch": batch, "mode": mode}


def run_sub(args, timeout=3600):
    cmd = [sys.executable, os.path.abspath(__file__)] + [str(a) for a in args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), out.stderr[-3000:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def mb(b):
    return "%.1f" % (b / 2 ** 20)


def table(nets, modes, iters, rounds):
    rows = []
    print("%-13s %5s %-9s %9s %9s %9s %9s %9s %9s %7s %8s" % (
        "net", "batch", "mode", "act MiB", "grad MiB", "act+grad", "planned", "traced",
        "cpu ms", "saved", "time"), flush=True)
    for name in nets:
        batch = NETS[name][2]
        mem = {m: run_sub(["--worker", name, m, batch]) for m in modes}
        cpu = {m: [] for m in modes}
        wall = {m: [] for m in modes}
        for _ in range(rounds):
            for m in modes:
                t = run_sub(["--time", name, m, batch, "--iters", iters])
                cpu[m] += t["cpu"]
                wall[m] += t["times"]
        base = mem[modes[0]]
        for m in modes:
            r = mem[m]
            r["cpu_ms"] = min(cpu[m])
            r["wall_ms_median"] = sorted(wall[m])[len(wall[m]) // 2]
            saved = 1 - r["peak_live_bytes"] / base["peak_live_bytes"]
            extra = r["cpu_ms"] / mem[modes[0]]["cpu_ms"] - 1
            print("%-13s %5d %-9s %9s %9s %9s %9s %9s %9.0f %6.1f%% %+7.1f%%" % (
                name, batch, m, mb(r["peak_activation_bytes"]), mb(r["peak_gradient_bytes"]),
                mb(r["peak_live_bytes"]), mb(r["predicted_peak_bytes"]), mb(r["peak_traced_bytes"]),
                r["cpu_ms"], 100 * saved, 100 * extra), flush=True)
            rows.append(r)
    return rows


def search(name, mode, budget):
    """Largest batch whose two training passes stay within ``budget`` bytes:
    a linear estimate from batches 1 and 2 picks the power of two to start
    from, then doubling until over the budget and bisection."""
    fits = {}

    def ok(b):
        if b not in fits:
            r = run_sub(["--trial", name, mode, b])
            fits[b] = r["peak_bytes"] <= budget
            peaks[b] = r["peak_bytes"]
            print("    %s %-9s batch %4d: peak %8s MiB %s" % (name, mode, b, mb(r["peak_bytes"]),
                                                            "fits" if fits[b] else "over"), flush=True)
        return fits[b]

    peaks = {}
    if not ok(1):
        return 0, peaks
    if not ok(2):
        return 1, peaks
    per = peaks[2] - peaks[1]
    est = max(2, int((budget - (peaks[1] - per)) / max(per, 1)))
    lo = 2
    while lo * 2 <= est:
        lo *= 2
    while lo > 2 and not ok(lo):
        lo //= 2
    while ok(lo * 2):
        lo *= 2
    hi = lo * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, peaks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--budget-gb", type=float, default=4.0)
    ap.add_argument("--search-net", default="resnet50")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--search-only", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("NET", "MODE", "BATCH"))
    ap.add_argument("--trial", nargs=3, metavar=("NET", "MODE", "BATCH"))
    ap.add_argument("--time", nargs=3, metavar=("NET", "MODE", "BATCH"))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], int(a.worker[2]))))
        return
    if a.time:
        print(json.dumps(timing(a.time[0], a.time[1], int(a.time[2]), a.iters)))
        return
    if a.trial:
        print(json.dumps(trial(a.trial[0], a.trial[1], int(a.trial[2]))))
        return
    if not os.path.isdir(ZOO):
        sys.exit("the zoo (%s) is absent" % ZOO)
    modes = a.modes.split(",")
    print("caffempi memory benchmark: CPU (NumPy), OPENBLAS_NUM_THREADS=%s; saved = 1 - act+grad / none's, "
          "time = cpu ms vs none; planned = the planner's predicted act+grad peak" % os.environ.get("OPENBLAS_NUM_THREADS"), flush=True)
    if not a.search_only:
        rows = table(a.nets.split(","), modes, a.iters, a.rounds)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    if not a.no_search:
        budget = int(a.budget_gb * 2 ** 30)
        print("\nLargest %s batch within %.3g GiB (traced peak of 2 training passes, parameters included):"
              % (a.search_net, a.budget_gb), flush=True)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(modes)) as pool:      # one subprocess chain per mode
            found = dict(zip(modes, pool.map(lambda m: search(a.search_net, m, budget), modes)))
        for mode in modes:
            b, peaks = found[mode]
            print("  %-9s largest batch %4d (peak %s MiB)%s" % (
                mode, b, mb(peaks.get(b, 0)),
                "" if mode == modes[0] or not found[modes[0]][0] else
                "  x%.2f of %s" % (b / found[modes[0]][0], modes[0])), flush=True)


if __name__ == "__main__":
    main()
