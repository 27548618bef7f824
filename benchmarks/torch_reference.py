"""The same training step in PyTorch (CPU), to compare net_speed.py with on
this machine, at the same moment: the host's speed drifts by +-20% between
runs, so a figure measured some other day is a poor yardstick.

    python benchmarks/torch_reference.py [--iterations 60] [--threads 1,2]

Needs torch (not a dependency of caffempi: install a CPU wheel into any
environment, e.g. `pip install torch --index-url .../whl/cpu`).  The nets are
LeNet (batch 64) and CIFAR10-quick (batch 100) as in models/: Caffe's ceil-mode
pooling, no data gradient for the input.  A step is forward, loss, and
backward into zeroed parameter gradients, as net_speed.py times ours; each
thread count runs in its own process.  Prints mean and median ms per step.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def lenet(nn):
    return nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2, ceil_mode=True),
        nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2, ceil_mode=True),
        nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10))


def cifar10_quick(nn):
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(),
        nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10))


NETS = [("LeNet", lenet, (1, 28, 28), 64), ("CIFAR10-quick", cifar10_quick, (3, 32, 32), 100)]


def measure(iterations):
    """In the child: time every net's step; returns [(name, mean, median)]."""
    import numpy as np
    import torch
    from torch import nn
    torch.manual_seed(0)
    out = []
    for name, make, shape, batch in NETS:
        model = make(nn)
        x = torch.randn((batch,) + shape)
        labels = torch.randint(0, 10, (batch,))
        loss_fn = nn.CrossEntropyLoss()

        def step():
            model.zero_grad(set_to_none=False)
            loss_fn(model(x), labels).backward()
        for _ in range(5):
            step()
        steps = []
        for _ in range(iterations):
            t = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t)
        out.append((name, 1e3 * float(np.mean(steps)), 1e3 * float(np.median(steps))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        import torch
        torch.set_num_threads(a.child)
        print(json.dumps(measure(a.iterations)))
        return 0
    try:
        import torch
    except ImportError:
        sys.exit("torch is not installed in this environment (%s)" % sys.executable)
    print("PyTorch %s, training step (forward+backward) per iteration" % torch.__version__)
    print("  %-14s %6s %8s %10s %10s" % ("net", "batch", "threads", "ms", "median ms"))
    for threads in [int(t) for t in a.threads.split(",")]:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        res = subprocess.run([sys.executable, __file__, "--child", str(threads), "--iterations",
                              str(a.iterations)], env=env, check=True, capture_output=True, text=True)
        batches = {name: batch for name, _, _, batch in NETS}
        for name, mean, median in json.loads(res.stdout.strip().splitlines()[-1]):
            print("  %-14s %6d %8d %10.2f %10.2f" % (name, batches[name], threads, mean, median))
    return 0


if __name__ == "__main__":
    sys.exit(main())
