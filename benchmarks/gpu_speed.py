"""Training images/s on one GPU: caffempi (CuPy) against PyTorch (cuDNN)
running the same nets, plus caffempi's per-layer forward/backward ms.

    python benchmarks/gpu_speed.py [--nets lenet,cifar,alexnet,resnet50,resnet50:64]
        [--iterations 20] [--zoo ../shared/caffe-zoo] [--tf32 0,1]

A training step is forward, loss, backward and an SGD-with-momentum update
(ours: Solver.step; PyTorch: the net from benchmarks/torch_net.py, built
from the same caffempi Net, with torch.optim.SGD), on random input held on
the device, timed between device synchronizations after 3 warm-up steps.
Nets and batches as the GPU issue says: LeNet 64, CIFAR10-quick 100, AlexNet
256 at 227x227 (its train_val, data layers replaced), ResNet-50 32 (deploy
net plus a SoftmaxWithLoss).  PyTorch runs channels-first float32 with
cudnn.benchmark on.  ``--tf32 0`` is strict float32 in both (PyTorch's
allow_tf32 flags off; ours without TF32); ``1`` lets both use TF32 tensor
cores (PyTorch's default for convolutions; ours CUPY_TF32=1 and, where
cuDNN is used, its default math).  Each (framework, tf32) runs in its own
process.  Needs a GPU, CuPy, and torch for the comparison.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_nets import NETS, net_param, random_inputs, split_key  # noqa: E402


def sync_ours():
    import cupy
    cupy.cuda.Device().synchronize()


def run_ours(key, zoo, iterations):
    import cupy
    from caffempi.proto import caffe_pb2
    from caffempi.solvers import get_solver
    from caffempi.timing import time_net
    param, batch = net_param(key, zoo)
    sp = caffe_pb2.SolverParameter(net_param=param, base_lr=1e-4, momentum=0.9, lr_policy="fixed",
                                   max_iter=10 ** 6, display=0, snapshot_prefix="/tmp/gpu_speed")
    solver = get_solver(sp, xp=cupy)
    net = solver.net
    for name, a in random_inputs(net).items():
        net.blobs[name].data = cupy.asarray(a)
    solver.step(3)
    sync_ours()
    t = time.perf_counter()
    solver.step(iterations)
    sync_ours()
    step_ms = (time.perf_counter() - t) / iterations * 1e3
    layers = time_net(net, max(5, iterations // 2), report=lambda *a: None, measure_memory=False)
    captured = solver.captured
    graphs = None if captured is None else (
        "off: %s" % captured.reason if captured.reason else "%d iterations replayed" % captured.replays)
    return {"step_ms": step_ms, "images_s": batch * 1e3 / step_ms, "layers": layers["layers"],
            "fwd_ms": layers["forward_ms"], "bwd_ms": layers["backward_ms"],
            "gpu_pool_peak_mb": layers.get("gpu_pool_peak_bytes", 0) / 2 ** 20, "graphs": graphs}


def run_torch(key, zoo, iterations, tf32):
    import numpy as np
    import torch
    import torch_net
    from caffempi import Net, TRAIN
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    param, batch = net_param(key, zoo)
    net = Net(param, phase=TRAIN, xp=np)
    model = torch_net.build(net, torch).cuda().train()
    inputs = {k: torch.from_numpy(v).cuda() for k, v in random_inputs(net).items()}
    del net
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=False)
        model(inputs).backward()
        opt.step()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / iterations * 1e3
    return {"step_ms": step_ms, "images_s": batch * 1e3 / step_ms,
            "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nets", default="lenet,cifar,alexnet,resnet50")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--zoo", default=str(REPO.parent / "shared" / "caffe-zoo"))
    ap.add_argument("--tf32", default="0,1")
    ap.add_argument("--frameworks", default="caffempi,torch")
    ap.add_argument("--layers", action="store_true", help="print caffempi's per-layer table")
    ap.add_argument("--graph", action="store_true",
                    help="caffempi replays its iterations as CUDA graphs (CAFFEMPI_CUDA_GRAPH=1)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        framework, key, tf32 = json.loads(args.child)
        r = (run_ours(key, args.zoo, args.iterations) if framework == "caffempi"
             else run_torch(key, args.zoo, args.iterations, tf32))
        print(json.dumps(r))
        return
    rows = []
    for tf32 in [int(v) for v in args.tf32.split(",")]:
        env = dict(os.environ, CUPY_TF32=str(tf32), CAFFEMPI_TF32=str(tf32),
                   CAFFEMPI_CUDA_GRAPH="1" if args.graph else os.environ.get("CAFFEMPI_CUDA_GRAPH", "0"))
        for key in args.nets.split(","):
            base, keyed = split_key(key)
            name, _, _, batch = NETS[base]
            batch = keyed or batch
            got = {}
            for framework in args.frameworks.split(","):
                proc = subprocess.run([sys.executable, __file__, "--iterations", str(args.iterations),
                                       "--zoo", args.zoo, "--child", json.dumps([framework, key, tf32])],
                                      env=env, capture_output=True, text=True)
                if proc.returncode:
                    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    print("%s %s tf32=%d failed: %s" % (framework, name, tf32, tail))
                    continue
                got[framework] = json.loads(proc.stdout.strip().splitlines()[-1])
            ours = got.get("caffempi")
            if ours and args.layers:
                print("\n%s, batch %d, tf32=%d: caffempi forward %.2f ms, backward %.2f ms (per-layer, synced)"
                      % (name, batch, tf32, ours["fwd_ms"], ours["bwd_ms"]))
                for layer, f, b in ours["layers"]:
                    print("  %-28s %9.3f %9.3f" % (layer, f, b))
            rows.append((name, batch, tf32, ours, got.get("torch")))
    print("\nTraining images/s (forward, backward, SGD update), one GPU")
    print("  %-14s %6s %5s %12s %12s %8s %12s %12s" % ("net", "batch", "tf32", "caffempi", "PyTorch",
                                                    "ratio", "ours MB", "torch MB"))
    for name, batch, tf32, ours, ref in rows:
        a = ours["images_s"] if ours else float("nan")
        b = ref["images_s"] if ref else float("nan")
        print("  %-14s %6d %5d %12.1f %12.1f %8.2f %12.0f %12.0f"
              % (name, batch, tf32, a, b, a / b, ours["gpu_pool_peak_mb"] if ours else float("nan"),
                 ref["peak_mb"] if ref else float("nan")))
    for name, batch, tf32, ours, ref in rows:
        if ours and ours.get("graphs"):
            print("  %s tf32=%d, caffempi's CUDA graphs: %s" % (name, tf32, ours["graphs"]))


if __name__ == "__main__":
    main()
