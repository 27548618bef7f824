"""CPU training speed: caffempi against BVLC Caffe and PyTorch, side by side.

    python benchmarks/net_speed.py [--nets lenet,cifar,caffenet:8,caffenet:32,resnet50:8,googlenet:8]
        [--threads 1,2] [--rounds 3] [--iterations N] [--caffe PATH] [--torch]
        [--baseline DIR] [--layers] [--memory reuse] [--json FILE]

Every framework times the same thing, forward + backward of the same net
(benchmarks/bench_nets.py: models/ and ../shared/caffe-zoo, data layers
replaced by DummyData drawing N(0, 1) images every forward, labels 0):

* caffempi: ``caffempi.timing.time_net`` on the Net, in a child process
  given the huge-page heap and allocator tuning that the CLI gives itself;
* BVLC Caffe (``--caffe PATH``, built by benchmarks/build_caffe.sh):
  ``caffe time -model`` on the same prototxt.  Debian's OpenBLAS 0.3.21
  takes some virtual CPUs for a Prescott (20 instead of 134 GFLOP/s sgemm on
  an AVX-512 Xeon), so its runs get ``OPENBLAS_CORETYPE`` for this CPU
  (SkylakeX with AVX-512, Haswell with AVX2), printed in the header;
* PyTorch (``--torch``): benchmarks/torch_net.py's module built from the
  same Net and weights, a step being the images' N(0, 1) redraw, forward,
  loss and backward into zeroed gradients;
* an earlier caffempi (``--baseline DIR``: another checkout, e.g. ``git
  worktree add DIR COMMIT``), timed as ours is, for before/after figures
  taken in the same run.

Each (framework, net, thread count) runs in its own process with
``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` (torch: set_num_threads) at
the thread count.  A round runs every combination once, frameworks
alternating inside each (net, threads); the table gives the median of the
rounds and the ratio of ours to each reference (below 1: we are faster).
The host is shared and its speed drifts by +-20% over minutes, so only the
figures of one invocation compare.  Each net's GEMM bound is its products'
FLOPs at the sgemm rate measured in our child just before it timed.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_nets import NETS, ZOO, net_param, random_inputs, with_dummy_data  # noqa: E402

DEFAULT_NETS = "lenet,cifar,caffenet:8,caffenet:32,resnet50:8"
# forward-backward passes timed per run, by net (after warm-up passes)
DEFAULT_ITERATIONS = {"lenet": 50, "cifar": 20, "caffenet": 5, "alexnet": 3, "resnet50": 3, "googlenet": 3}
AVERAGE = re.compile(r"Average Forward-Backward: ([0-9.]+) ms")
LAYER = re.compile(r"\]\s+(\S+)\s+(forward|backward): ([0-9.]+) ms")


def gemm_flops(net):
    """Floating-point operations of one forward-backward pass's products:
    2 * (output elements) * (weights per output) per product."""
    total = 0
    for i, layer in enumerate(net.layers):
        kind = layer.type
        if kind not in ("Convolution", "Deconvolution", "InnerProduct"):
            continue
        w = layer.blobs[0]
        big = net.bottom_vecs[i][0] if kind == "Deconvolution" else net.top_vecs[i][0]
        per_output = w.count // big.shape[1] if kind != "InnerProduct" else w.count // layer.num_output
        fwd = 2 * big.count * per_output
        products = 1 + bool(net.layer_param_need_backward[i][0]) + bool(net.bottom_need_backward[i][0])
        total += fwd * products
    return total


def sgemm_rate(repeats=5):
    """FLOP/s of a 1024^3 float32 product on the kernels' threads, best of a few."""
    import numpy as np
    from caffempi.backend import cpu
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        cpu.matmul(a, a)
        best = min(best, time.perf_counter() - t)
    return 2 * 1024 ** 3 / best


def openblas_coretype():
    """The OpenBLAS core type for this CPU: SkylakeX with AVX-512, Haswell
    with AVX2 (AMD Zen included), else None (let OpenBLAS detect it)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return None
    if "avx512f" in flags:
        return "SkylakeX"
    return "Haswell" if "avx2" in flags else None


# ------------------------------------------------------------------ children
def child_ours(prototxt, iterations, memory):
    from caffempi import Net, TRAIN
    from caffempi.io import proto_io
    from caffempi.memory import tune_allocator
    from caffempi.timing import time_net
    tune_allocator()
    net = Net(proto_io.read_net_param(prototxt), phase=TRAIN, memory=memory)
    for _ in range(2):  # warm-up
        net.forward_backward()
    rate = sgemm_rate()
    r = time_net(net, iterations, report=lambda *a: None, measure_memory=False)
    return {"ms": r["median_forward_backward_ms"], "layers": r["layers"], "sgemm_gflops": rate / 1e9,
            "gemm_bound_ms": 1e3 * gemm_flops(net) / rate}


def child_torch(key, batch, iterations, threads):
    import numpy as np
    import torch
    import torch_net
    from caffempi import Net, TRAIN
    torch.set_num_threads(threads)
    param, _ = net_param(key, batch=batch)
    net = Net(param, phase=TRAIN, xp=np)
    model = torch_net.build(net, torch).train()
    inputs = {k: torch.from_numpy(v) for k, v in random_inputs(net).items()}
    images = [k for k, v in inputs.items() if v.dim() > 1]
    del net

    def step():
        for k in images:
            inputs[k].normal_()
        model.zero_grad(set_to_none=False)
        model(inputs).backward()
    for _ in range(2):
        step()
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "version": torch.__version__}


def run_caffe(caffe, prototxt, iterations, env):
    p = subprocess.run([caffe, "time", "-model", prototxt, "-iterations", str(iterations)],
                       env=env, capture_output=True, text=True)
    log = p.stdout + p.stderr
    found = AVERAGE.findall(log)
    if p.returncode or not found:
        raise RuntimeError("caffe time failed (exit %d): %s" % (p.returncode, log[-2000:]))
    layers = {}
    for name, direction, ms in LAYER.findall(log):
        layers.setdefault(name, {})[direction] = float(ms)
    return {"ms": float(found[-1]), "layers": [(n, d.get("forward", 0.0), d.get("backward", 0.0))
                                               for n, d in layers.items()]}


def run_child(args, env):
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError((p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------- parent
def parse_nets(spec):
    out = []
    for item in spec.split(","):
        key, _, batch = item.partition(":")
        if key not in NETS:
            sys.exit("unknown net '%s' (one of %s)" % (key, ", ".join(NETS)))
        out.append((key, int(batch) if batch else NETS[key][3]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", default=DEFAULT_NETS, help="key[:batch],... (%s)" % ", ".join(NETS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, help="passes timed per run (default: by net)")
    ap.add_argument("--caffe", help="BVLC Caffe's caffe binary (benchmarks/build_caffe.sh)")
    ap.add_argument("--torch", action="store_true", help="time PyTorch too (torch must import)")
    ap.add_argument("--baseline", help="another caffempi checkout to time as 'baseline'")
    ap.add_argument("--layers", action="store_true", help="print the per-layer tables of the last round")
    ap.add_argument("--memory", default="reuse", help="caffempi's activation memory: none, reuse or recompute")
    ap.add_argument("--zoo", default=str(ZOO))
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = json.loads(args.child)
        if kind == "baseline":
            sys.path.insert(0, rest.pop(0))        # its caffempi, not this checkout's
        print(json.dumps(child_torch(*rest) if kind == "torch" else child_ours(*rest)))
        return 0
    nets = parse_nets(args.nets)
    thread_counts = [int(t) for t in args.threads.split(",")]
    if args.caffe and not os.access(args.caffe, os.X_OK):
        sys.exit("no Caffe binary at %s (benchmarks/build_caffe.sh builds one)" % args.caffe)
    if any(k not in ("lenet", "cifar") for k, _ in nets) and not Path(args.zoo).is_dir():
        sys.exit("the zoo (%s) is absent" % args.zoo)
    from caffempi.io import proto_io
    from caffempi.memory import hugepage_heap_env
    frameworks = (["caffempi"] + (["baseline"] if args.baseline else []) + (["caffe"] if args.caffe else [])
                  + (["torch"] if args.torch else []))
    coretype = openblas_coretype()
    tmp = Path(tempfile.mkdtemp(prefix="net_speed-"))
    prototxts = {}
    for key, batch in nets:
        param, _ = net_param(key, zoo=args.zoo, batch=batch)
        prototxts[key, batch] = str(tmp / ("%s_%d.prototxt" % (key, batch)))
        proto_io.write_text_proto_atomic(prototxts[key, batch], with_dummy_data(param))
    print("caffempi against %s; %d round(s), medians; ms per forward+backward%s"
          % (", ".join(frameworks[1:]) or "nothing", args.rounds,
             "; Caffe's OpenBLAS with OPENBLAS_CORETYPE=%s" % coretype if args.caffe and coretype else ""))
    runs = {}
    for rnd in range(args.rounds):
        for threads in thread_counts:
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                       PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "benchmarks"),
                                                   os.environ.get("PYTHONPATH", "")]))
            ours_env = hugepage_heap_env(env) or env      # the children run as the CLI does
            caffe_env = dict(env, OPENBLAS_CORETYPE=coretype) if coretype else env
            for key, batch in nets:
                iterations = args.iterations or DEFAULT_ITERATIONS[key]
                order = frameworks if rnd % 2 == 0 else frameworks[::-1]
                for fw in order:
                    try:
                        if fw == "caffempi":
                            r = run_child(["ours", prototxts[key, batch], iterations, args.memory], ours_env)
                        elif fw == "baseline":
                            r = run_child(["baseline", str(Path(args.baseline).resolve()), prototxts[key, batch],
                                           iterations, args.memory], ours_env)
                        elif fw == "caffe":
                            r = run_caffe(args.caffe, prototxts[key, batch], iterations, caffe_env)
                        else:
                            r = run_child(["torch", key, batch, iterations, threads], env)
                    except RuntimeError as e:
                        print("  %s %s:%d at %d thread(s) failed: %s" % (fw, key, batch, threads, e))
                        continue
                    runs.setdefault((key, batch, threads, fw), []).append(r)
                    print("  round %d: %-9s %-9s batch %3d, %d thread(s): %9.2f ms"
                          % (rnd + 1, fw, NETS[key][0], batch, threads, r["ms"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(map(str, k)): v for k, v in runs.items()}, indent=1))
    if args.layers:
        for (key, batch, threads, fw), rs in sorted(runs.items()):
            if fw == "torch" or not rs[-1].get("layers"):
                continue
            print("\n%s %s, batch %d, %d thread(s), last round: %.2f ms" % (fw, NETS[key][0], batch, threads,
                                                                            rs[-1]["ms"]))
            for layer, f, b in rs[-1]["layers"]:
                print("  %-24s %10.3f %10.3f" % (layer, f, b))
    median = {k: statistics.median(r["ms"] for r in rs) for k, rs in runs.items()}
    head = "  %-14s %5s %7s %10s" % ("net", "batch", "threads", "caffempi")
    for fw in frameworks[1:]:
        head += " %10s %8s" % ({"baseline": "baseline", "caffe": "Caffe", "torch": "PyTorch"}[fw], "ours/it")
    print("\nMedian ms per forward+backward (ours/it below 1: caffempi faster); GEMM bound at our child's sgemm rate")
    print(head + " %10s %10s" % ("bound ms", "sgemm GF/s"))
    for key, batch in nets:
        for threads in thread_counts:
            ours = median.get((key, batch, threads, "caffempi"))
            line = "  %-14s %5d %7d %10s" % (NETS[key][0], batch, threads, "%.2f" % ours if ours else "-")
            for fw in frameworks[1:]:
                ref = median.get((key, batch, threads, fw))
                line += " %10s %8s" % ("%.2f" % ref if ref else "-",
                                       "%.3f" % (ours / ref) if ours and ref else "-")
            last = runs.get((key, batch, threads, "caffempi"), [{}])[-1]
            line += " %10s %10s" % ("%.1f" % last["gemm_bound_ms"] if last else "-",
                                    "%.1f" % last["sgemm_gflops"] if last else "-")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
