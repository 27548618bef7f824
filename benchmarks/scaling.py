#!/usr/bin/env python
"""2-rank data-parallel scaling on this machine: LeNet and CIFAR10-quick.

For each net, at the same per-rank batch and 1 BLAS thread per process:

  independent   two single-process trainers started at the same time
  mpi/<comm>    `mpiexec -n 2`, one model, gradients averaged (--comm)
  mpi/barrier   `mpiexec -n 2`, the ranks wait for each other after backward
                as a synchronous job must, but exchange nothing: the
                efficiency of free communication, the most that synchronous
                data parallelism can reach on this machine at this moment

Prints aggregate images/s (each process's timed images over the time they
took, summed over processes), efficiency (the 2-rank job's aggregate over
the independent pair's; the independent row also says what efficiency the
pair would have if both went at its slower process's pace, the ceiling for
any synchronous job on cores that run at unequal speeds), and per iteration
in ms: step (mean, and median),
compute (forward+backward+update), allreduce (a blocking allreduce of the
whole gradient, measured alone after the run), exposed (time spent in the
gradient sync's wait after backward), split into skew (waiting for the other rank
to finish its backward, from the ranks' common monotonic clock) and comm
(what is left: communication not hidden behind the slowest rank's backward).
--json writes everything (tools/scaling_model.py reads it), each timed step's
compute seconds and records included (benchmarks/share_replay.py replays them).

--balance off,auto runs each --comm mode with each batch-share setting
(caffempi train's --balance; a row 'mpi/shm/auto'), and then feeds the nets
from DummyData layers (constant values, filled once; the Input layers of
the other runs cannot take uneven shares), the independent pair included.
Images/s counts the images each process actually ran.

--throttle F (root) holds one process of each kind, the pair's second and
the job's rank 1, to F of a core (a cgroup CPU quota, one cgroup each): a
slow host, against the sum of the two processes' own rates.

    .venv/bin/python benchmarks/scaling.py                  # both nets, shm+overlap+blocking+barrier
    .venv/bin/python benchmarks/scaling.py --repeat 4       # and each mode's median over 4 rounds
    .venv/bin/python benchmarks/scaling.py --nets lenet --comm overlap,thread,async,nopoll,blocking
    .venv/bin/python benchmarks/scaling.py --interleave --iters 200   # each mode's cost over barrier
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from caffempi.parallel.sync import GradientSync  # noqa: E402

NETS = {      # name: (prototxt, image shape if the prototxt lacks it, batch a rank if not the prototxt's)
    "lenet": ("models/mnist/lenet_train_test.prototxt", (1, 28, 28), None),
    "cifar10_quick": ("models/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32), None),
    # 61M parameters, 96% of them in fc6-fc8 (../shared beside the checkout)
    "caffenet": ("../shared/caffe-zoo/bvlc/models/bvlc_reference_caffenet/train_val.prototxt", None, 8),
    "alexnet": ("../shared/caffe-zoo/bvlc/models/bvlc_alexnet/train_val.prototxt", None, 8),
    # 138M parameters, 89% of them in fc6-fc8
    "vgg16": ("benchmarks/nets/vgg16.prototxt", None, None),
    # 25.6M parameters in 53 convolutions and fc1000: ../shared's ResNet-50 deploy net made trainable
    # (an Input layer of 8 images and labels, BatchNorm on batch statistics, SoftmaxWithLoss)
    "resnet50": ("benchmarks/nets/resnet50.prototxt", None, None),
}

def load_net_param(name):
    from caffempi.io import proto_io
    from caffempi.timing import substitute_data_layers
    path, shape, batch = NETS[name]
    p = proto_io.read_net_param(str(REPO / path))
    return substitute_data_layers(p, shape, only_unreadable=False, warn=False, batch_size=batch)


def dummy_data(net_param):
    """``net_param`` with each Input layer a DummyData layer of the same
    tops and shapes, constant values (data 0.1, labels 0: any classifier's
    valid class) filled once: data layers that can take batch shares."""
    from caffempi.proto import caffe_pb2
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net_param)
    for lp in out.layer:
        if lp.type != "Input":
            continue
        lp.type = "DummyData"
        dp = lp.dummy_data_param
        for k, shape in enumerate(lp.input_param.shape):
            dp.shape.add().CopyFrom(shape)
            dp.data_filler.add(type="constant", value=0.1 if k == 0 else 0.0)
        lp.ClearField("input_param")
    return out


# ------------------------------------------------------------------ worker
class Lockstep(GradientSync):
    """--comm barrier in place of gradient averaging: keeps the ranks in
    step as averaging does (every rank waits for the slowest after
    backward) with nothing to send, so what it loses against the
    independent pair is the machine's (jitter, unequal cores, the ranks
    contending for memory in the same layers), not communication."""
    buckets = []

    def attach(self, net, iter_size=1):
        self.net = net

    def finish(self, net):
        self.world.barrier()
        return 0.0


def _start(args, comm):
    """This rank's world (MPI initialised for ``comm``), as train starts it."""
    from caffempi.parallel.comm import get_world
    from caffempi.memory import tune_allocator
    from caffempi.parallel.rank import init_rank_logging, install_abort_handlers

    tune_allocator()                  # as train does: freed memory stays in the heap
    world = get_world(comm)
    init_rank_logging(world)          # rank 0's INFO lines: buckets, sufficient-factor choices
    install_abort_handlers(world)
    return world


def _solver(args, sync):
    """The real SGD solver over the benchmark's net (plain SGD: lr 0.001,
    no momentum or decay; no display, tests or snapshots), driven one
    ``step(1)`` at a time, with ``sync`` (every rank takes rank 0's weights
    at the first step)."""
    from caffempi.proto import caffe_pb2
    from caffempi.solvers import SGDSolver
    p = caffe_pb2.SolverParameter()
    net_param = load_net_param(args.net)
    p.net_param.CopyFrom(dummy_data(net_param) if args.data == "dummy" else net_param)
    p.base_lr, p.lr_policy, p.max_iter = 0.001, "fixed", 1 << 30
    p.display = p.snapshot = 0
    p.snapshot_after_train = False
    p.solver_mode = caffe_pb2.SolverParameter.CPU
    return SGDSolver(p, sync=sync)


def _averager(world, comm, args):
    from caffempi.parallel.balance import ShareBalancer
    from caffempi.parallel.config import ParallelConfig
    from caffempi.parallel.sync import BucketedAllreduce
    if comm == "barrier":
        return Lockstep(world)
    plugins = ParallelConfig(sfb=args.sfb, compress=args.compress, comm_dtype=args.comm_dtype).make_plugins()
    return BucketedAllreduce(world, comm=comm, bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb,
                             comm_dtype=args.comm_dtype, plugins=plugins,
                             balancer=None if args.balance == "off" else ShareBalancer(args.balance))


class Throttle:
    """Cgroups that hold their processes to ``fraction`` of a core (the
    CPU controller's quota: cgroup v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us``), one per name; removed on exit (root).  The
    quota's period is 10 ms: a slow core, not a fast one that stalls for
    tens of milliseconds (the default 100 ms period stalls a rank for 40
    ms at 0.6, longer than a LeNet step).

    A worker joins by writing its pid into ``pidfile(name)`` and waiting
    until /proc/self/cgroup names the cgroup: this process moves it, since
    a worker on an emulated host (``ip netns exec``) has a /sys of its own,
    without the cgroup mounts."""
    V2, V1 = "/sys/fs/cgroup", "/sys/fs/cgroup/cpu"

    def __init__(self, fraction, names):
        import threading
        self.paths, self.pidfiles = {}, {}
        self._dir = tempfile.mkdtemp(prefix="caffempi-throttle-")
        v2 = os.path.exists(os.path.join(self.V2, "cgroup.controllers"))
        for name in names:
            base = "caffempi-throttle-%d-%s" % (os.getpid(), name)
            path = os.path.join(self.V2 if v2 else self.V1, base)
            os.makedirs(path, exist_ok=True)
            period = 10000
            if v2:
                _write(os.path.join(path, "cpu.max"), "%d %d" % (int(fraction * period), period))
            else:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(fraction * period)))
            self.paths[name] = path
            self.pidfiles[name] = os.path.join(self._dir, base + ".pid")
        self._stop = threading.Event()
        self._mover = threading.Thread(target=self._move, daemon=True)
        self._mover.start()

    def pidfile(self, name):
        return self.pidfiles[name]

    def _move(self):
        moved = set()
        while not self._stop.wait(0.02):
            for name, pidfile in self.pidfiles.items():
                try:
                    with open(pidfile) as f:
                        pids = [int(line) for line in f.read().split()]
                except (OSError, ValueError):
                    continue
                for pid in pids:
                    if (name, pid) not in moved:
                        try:
                            _write(os.path.join(self.paths[name], "cgroup.procs"), str(pid))
                        except OSError as e:
                            print("could not throttle pid %d: %s" % (pid, e), file=sys.stderr)
                        moved.add((name, pid))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._mover.join()
        for path in self.paths.values():
            try:
                os.rmdir(path)
            except OSError as e:
                print("could not remove %s: %s" % (path, e), file=sys.stderr)
        for pidfile in self.pidfiles.values():
            if os.path.exists(pidfile):
                os.unlink(pidfile)
        os.rmdir(self._dir)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def join_cgroup(spec, rank):
    """A worker's RANK:PIDFILE (--throttle): rank RANK asks the driver's
    :class:`Throttle` for its cgroup and waits until it is in it."""
    if not spec:
        return
    which, _, pidfile = spec.partition(":")
    if int(which) != rank:
        return
    with open(pidfile, "a") as f:
        f.write("%d\n" % os.getpid())
    name = os.path.basename(pidfile)[:-len(".pid")]
    deadline = time.time() + 30
    while time.time() < deadline:
        with open("/proc/self/cgroup") as f:
            if name in f.read():
                return
        time.sleep(0.02)
    raise SystemExit("pid %d was not moved into cgroup %s" % (os.getpid(), name))


def pin_to_cpu(spec, rank):
    """A worker's --cpus C0,C1,...: every thread of this process (and those
    it starts later) on CPU C[rank], as a rank alone on its own host."""
    if not spec:
        return
    cpus = [int(c) for c in spec.split(",")]
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpus[rank % len(cpus)]})


def _tx_bytes():
    """Bytes this host's eth0 has sent (an emulated host's only link), or None."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class StepClock:
    """When the parts of a solver step happen, from the solver's callbacks
    (start, gradients ready) and the net's hooks (backward's first layer,
    each layer's end), added after the strategy's hook so that backward's
    end includes the strategy's work there."""

    def __init__(self, solver):
        self.start = self.forward_end = self.ready = 0.0
        self.marks = []            # (layer, seconds) after each layer's backward
        net = solver.net
        top = len(net.layers) - 1
        solver.add_callback(self._on_start, self._on_ready)
        net.before_backward(lambda i: self._forward_end() if i == top else None)
        net.after_backward(lambda i: self.marks.append((i, time.perf_counter())))

    def _on_start(self):
        self.start = time.perf_counter()
        del self.marks[:]

    def _forward_end(self):
        self.forward_end = time.perf_counter()

    def _on_ready(self):
        self.ready = time.perf_counter()

    @property
    def backward_end(self):
        return self.marks[-1][1]


def worker(args):
    """One trainer process (under mpiexec or alone); writes JSON to args.out."""
    import numpy as np
    from caffempi.parallel.sfb import factor_shape

    world = _start(args, "blocking" if args.comm == "barrier" else args.comm)
    join_cgroup(args.cgroup, world.rank)
    pin_to_cpu(args.cpus, world.rank)
    red = _averager(world, args.comm, args)
    solver = _solver(args, red)
    net = solver.net
    batch = net.blobs["data"].shape[0]
    red.attach(net)
    clock = StepClock(solver)
    compute, exposed, layer_bw = [], [], np.zeros(len(net.layers))
    bw_end = []     # perf_counter at backward end (CLOCK_MONOTONIC: one clock per host)
    fwd_ms, bwd_ms = [], []
    images = []     # each timed step's batch on this rank (batch shares change it)

    def one(record):
        solver.step(1)
        done = time.perf_counter()
        if record:
            images.append(net.blobs["data"].shape[0])
            c = clock
            compute.append((c.backward_end - c.start) + (done - c.ready))
            bw_end.append(c.backward_end)
            exposed.append(c.ready - c.backward_end)
            fwd_ms.append(c.forward_end - c.start)
            bwd_ms.append(c.backward_end - c.forward_end)
            prev = c.forward_end
            for i, t in c.marks:
                layer_bw[i] += t - prev
                prev = t

    est = 0.0                 # seconds of the last step: a step starts only if it fits in the slot
    for _ in range(args.warmup):
        t = time.perf_counter()
        one(False)
        est = time.perf_counter() - t
    tx0 = _tx_bytes()
    iter_times = []
    if args.slot:
        # Paired alternation: this run and the other kind (independent pair
        # vs MPI pair) take turns in time slots of args.slot seconds, so both
        # see the same background load; only whole iterations inside this
        # run's own slots are timed.
        world.barrier()
        overran = 0.0         # seconds the timed iterations ran into the other kind's slots
        for j in range(args.slots):
            begin = args.t0 + (2 * j + args.parity) * args.slot
            end = begin + args.slot
            time.sleep(max(0.0, begin - time.time()))
            first = True
            while True:
                # a slot shorter than a step still gets one (its overrun is reported)
                go = time.time() + 1.3 * est < end or (first and 1.3 * est >= args.slot)
                first = False
                if world.size > 1:
                    go = world.bcast(go, 0)
                if not go:
                    break
                t = time.perf_counter()
                one(True)
                est = time.perf_counter() - t
                iter_times.append(est)
                overran += max(0.0, time.time() - end)
        elapsed = float(np.sum(iter_times))
        args.iters = len(iter_times)
    else:
        overran = 0.0
        world.barrier()
        t_start = time.perf_counter()
        for _ in range(args.iters):
            t = time.perf_counter()
            one(True)
            iter_times.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t_start
    tx1 = _tx_bytes()
    link_bytes = (tx1 - tx0) / args.iters if tx0 is not None and tx1 is not None else None
    # the allreduce alone: a blocking sum of the whole gradient, and per bucket
    ar = []
    if world.size > 1:
        buf = np.ones_like(net.param_diff)
        for k in range(args.iters if args.allreduce_reps is None else args.allreduce_reps):
            world.barrier()
            t = time.perf_counter()
            world.allreduce_sum(buf)
            ar.append(time.perf_counter() - t)
    factor_layers, low_rank = set(), {}         # layer index -> the rank of its low-rank weight
    for plugin in getattr(red, "plugins", []):
        factor_layers.update(i for i, _, _ in getattr(plugin, "factor_layers", ()))
        low_rank.update((net.param_layer_index[m.param], m.rank) for m in getattr(plugin, "matrices", ()))
    red.close()
    # exposed time = waiting for the slower rank to finish its backward
    # (skew) + communication left after the last rank's backward
    ends = np.array(world.allgather(bw_end)) if world.size > 1 else np.array([bw_end])
    skew = ends.max(0) - ends[world.rank]
    res = {"net": args.net, "rank": world.rank, "size": world.size, "comm": args.comm,
           "batch": batch, "iters": args.iters, "elapsed_s": elapsed,
           # aggregate throughput: every timed image over the time they took
           # (a median step would hide the slow steps that cost the
           # independent runs throughput and that the 2-rank job's max over
           # ranks has already absorbed)
           "images_per_s": sum(images) / elapsed,
           "shares": list(net.batch_shares or ()),
           "step_ms": 1e3 * elapsed / args.iters,
           "median_step_ms": 1e3 * float(np.median(iter_times)),
           "compute_ms": 1e3 * float(np.mean(compute)),
           "compute_series": [float(x) for x in compute], "images_series": list(images),
           "forward_ms": 1e3 * float(np.mean(fwd_ms)), "backward_ms": 1e3 * float(np.mean(bwd_ms)),
           "exposed_ms": 1e3 * float(np.mean(exposed)),
           "allreduce_ms": 1e3 * float(np.median(ar)) if ar else 0.0,
           "skew_ms": 1e3 * float(np.mean(skew)),
           "comm_exposed_ms": 1e3 * float(np.mean(np.maximum(np.array(exposed) - skew, 0.0))),
           "grad_mb": net.param_diff.nbytes / 2 ** 20,
           "link_bytes_per_step": link_bytes,
           "slot_overrun_s": overran,
           "buckets": [[b[0], int(b[2] - b[1])] for b in red.buckets],
           "layers": [{"name": n, "index": i, "backward_ms": 1e3 * layer_bw[i] / args.iters,
                       "params": int(sum(net.learnable_params[p].count for p, li in
                                         enumerate(net.param_layer_index) if li == i)),
                       # (M, N, K) of a layer with sufficient factors (the scaling model's SFB)
                       "factors": factor_shape(net.layers[i]),
                       "factors_used": i in factor_layers,
                       # the rank of its weight's low-rank sums (--compress), else None
                       "low_rank": low_rank.get(i)}
                      for i, n in enumerate(net.layer_names)]}
    res_all = world.allgather(res) if world.size > 1 else [res]
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump(res_all, f)


def interleaved_worker(args):
    """--interleave: one 2-rank job takes the comm modes in turn, a step
    each, every step starting at a barrier; writes per mode the steps' times
    (the slowest rank's) to args.out.  Step to step the load is the same for
    every mode, so the differences are what each mode's communication costs
    beyond free communication (barrier), to a tenth of a millisecond."""
    import numpy as np

    modes = args.comm.split(",")
    world = _start(args, "overlap")
    reducers = [_averager(world, m, args) for m in modes]
    solver = _solver(args, reducers[0])
    times = {m: [] for m in modes}
    for i in range((args.iters + args.warmup) * len(modes)):
        mode, red = modes[i % len(modes)], reducers[i % len(modes)]
        solver.sync = red              # the step attaches it to the net
        world.barrier()
        t = time.perf_counter()
        solver.step(1)
        if i >= args.warmup * len(modes):
            times[mode].append(time.perf_counter() - t)
        red.detach()
    for red in reducers:
        red.close()
    slowest = {m: np.max(world.allgather(times[m]), axis=0).tolist() for m in modes}
    if world.rank == 0:
        with open(args.out, "w") as f:
            json.dump([{"net": args.net, "steps_s": slowest}], f)


def run_interleaved(a, net, n):
    import numpy as np
    res = collect(*_start_mpi(a, net, a.comm, n, extra=["--interleave"]), a)[0]
    ms = {m: 1e3 * np.array(t) for m, t in res["steps_s"].items()}
    ref = ms.get("barrier")
    for m, t in ms.items():
        print("%-14s %-12s %8.2f %8.2f%s" % (
            net, "mpi/" + m, t.mean(), np.median(t),
            "" if ref is None or m == "barrier" else "  %+6.2f ms (%+.1f%%) over barrier" % (
                t.mean() - ref.mean(), 100 * (t.mean() - ref.mean()) / ref.mean())))
    return res


# ------------------------------------------------------------------ driver
def bench_env():
    e = dict(os.environ)
    e["OPENBLAS_NUM_THREADS"] = e["OMP_NUM_THREADS"] = e["MKL_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("CAFFEMPI_MPI", None)
    from caffempi.memory import hugepage_heap_env
    return hugepage_heap_env(e) or e       # as the CLI runs


def _mpiexec():
    from caffempi.parallel.launch import mpiexec_path
    return mpiexec_path() or "mpiexec"


def worker_args(a, net, kind, out, slot=None, throttle=None, cpus=None):
    """A worker's command line; ``kind`` is a --comm mode, maybe with
    '/balance'; ``throttle`` RANK:CGROUP puts that rank in a cgroup;
    ``cpus`` (a list) puts rank r on CPU cpus[r]."""
    comm, _, balance = kind.partition("/")
    args = [sys.executable, __file__, "--worker", "--net", net, "--comm", comm, "--iters", str(a.iters),
            "--balance", balance or "off", "--data", getattr(a, "data", None) or "input",
            "--warmup", str(a.warmup), "--bucket_mb", str(a.bucket_mb),
            "--first_bucket_mb", str(a.first_bucket_mb), "--sfb", getattr(a, "sfb", "off"),
            "--comm_dtype", getattr(a, "comm_dtype", "fp32"), "--compress", getattr(a, "compress", "none"),
            "--out", out]
    if getattr(a, "allreduce_reps", None) is not None:
        args += ["--allreduce_reps", str(a.allreduce_reps)]
    if slot:
        args += ["--slot", str(slot[0]), "--slots", str(slot[1]), "--t0", repr(slot[2]),
                 "--parity", str(slot[3])]
    if throttle:
        args += ["--cgroup", throttle]
    if cpus:
        args += ["--cpus", ",".join(map(str, cpus))]
    return args


def throttled(a, kind):
    """The --throttle worker argument of the pair ('pair': its second
    process, a rank 0 of its own) or the job ('job': rank 1), or None."""
    cgroups = getattr(a, "cgroups", None)
    if not cgroups:
        return None
    return "0:" + cgroups.pidfile("pair") if kind == "pair" else "1:" + cgroups.pidfile("job")


def start_independent(a, net, n, slot=None, cpus=None):
    """``n`` single processes; ``cpus``: process k on CPU cpus[k]."""
    outs = [tempfile.mktemp(suffix=".json") for _ in range(n)]
    env = bench_env()
    env["CAFFEMPI_MPI"] = "0"
    procs = [subprocess.Popen(worker_args(a, net, "blocking", o, slot, throttled(a, "pair") if k == 1 else None,
                                          cpus and [cpus[k]]), env=env) for k, o in enumerate(outs)]
    return procs, outs


def _start_mpi(a, net, comm, n, slot=None, extra=()):
    out = tempfile.mktemp(suffix=".json")
    p = subprocess.Popen([_mpiexec(), "-n", str(n)] + worker_args(a, net, comm, out, slot, throttled(a, "job"))
                         + list(extra), env=bench_env())
    return [p], [out]


def collect(procs, outs, a):
    for p in procs:
        if p.wait(timeout=a.timeout) != 0:
            raise SystemExit("a benchmark run failed")
    res = []
    for o in outs:
        with open(o) as f:
            res += json.load(f)
        os.unlink(o)
    return res


def run_independent(a, net, n):
    return collect(*start_independent(a, net, n), a)


def run_mpi(a, net, comm, n):
    return collect(*_start_mpi(a, net, comm, n), a)


def run_paired(a, net, comm, n):
    """The independent pair and the MPI job alive together, taking turns."""
    slot = a.slot if a.slot else {"lenet": 0.8}.get(net, 3.0)
    t0 = time.time() + a.startup
    pi, oi = start_independent(a, net, n, (slot, a.slots, t0, 1))
    pm, om = _start_mpi(a, net, comm, n, (slot, a.slots, t0, 0))
    return collect(pi, oi, a), collect(pm, om, a)


def summarize(res):
    import numpy as np
    rates = [r["images_per_s"] for r in res]
    return {"images_per_s": sum(rates),
            # what a synchronous job of these processes could reach: all go
            # at the slowest one's pace (for the independent pair, whose
            # processes sit on cores of unequal speed on a shared host)
            "sync_ceiling": len(rates) * min(rates) / sum(rates),
            "step_ms": float(np.mean([r["step_ms"] for r in res])),
            "median_step_ms": float(np.mean([r["median_step_ms"] for r in res])),
            "compute_ms": float(np.mean([r["compute_ms"] for r in res])),
            "exposed_ms": float(np.mean([r["exposed_ms"] for r in res])),
            "allreduce_ms": float(np.mean([r["allreduce_ms"] for r in res])),
            "skew_ms": float(np.mean([r.get("skew_ms", 0.0) for r in res])),
            "comm_exposed_ms": float(np.mean([r.get("comm_exposed_ms", 0.0) for r in res]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    ap.add_argument("--net", default="lenet")
    ap.add_argument("--nets", default="lenet,cifar10_quick")
    ap.add_argument("--comm", default="shm,overlap,blocking,barrier")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="alternate the runs this many times, keep the best "
                    "(and print each mode's median efficiency over the rounds)")
    ap.add_argument("--bucket_mb", type=float, default=None)
    ap.add_argument("--first_bucket_mb", type=float, default=None)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--unpaired", action="store_true",
                    help="run the independent pair and the MPI job one after the other instead of "
                         "alternating in time slots (paired runs resist background load)")
    ap.add_argument("--slot", type=float, default=None, help="paired: seconds per turn (default 0.8 "
                    "LeNet, 3 others)")
    ap.add_argument("--slots", type=int, default=12, help="paired: turns per kind")
    ap.add_argument("--startup", type=float, default=8.0, help="paired: seconds allowed for start-up")
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--parity", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--allreduce_reps", type=int, default=None,
                    help="times the whole gradient's allreduce is timed alone after the run (default --iters)")
    ap.add_argument("--sfb", default="off", help="sufficient factors for InnerProduct layers: off, on or auto")
    ap.add_argument("--comm_dtype", default="fp32", help="fp32, or fp16 (buckets and factors sent as float16)")
    ap.add_argument("--compress", default="none", help="none, or powersgd[:RANK] (low rank where the plan "
                    "finds it pays)")
    ap.add_argument("--balance", default="off", help="batch shares of the MPI job: off, auto, B0:B1:..., or a "
                    "comma list of them (each --comm mode runs with each; anything but off feeds the nets "
                    "from DummyData)")
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--throttle", default=None, help="(root) a fraction of a core, e.g. 0.6, for the pair's second "
                    "process and the job's rank 1 (a slow host); the efficiency is then against the sum of "
                    "the two processes' own rates")
    ap.add_argument("--interleave", action="store_true",
                    help="instead: one --ranks job per net that takes the --comm modes (of shm, overlap, "
                         "blocking, nopoll, barrier) in turn, a step each from a barrier; prints each "
                         "mode's step and its cost over barrier")
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)     # a worker's RANK:CGROUP
    ap.add_argument("--cpus", default=None, help=argparse.SUPPRESS)       # a worker's CPU by rank: C0,C1,...
    a = ap.parse_args()
    from caffempi.parallel.buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
    a.bucket_mb = DEFAULT_BUCKET_MB if a.bucket_mb is None else a.bucket_mb
    a.first_bucket_mb = DEFAULT_FIRST_BUCKET_MB if a.first_bucket_mb is None else a.first_bucket_mb
    if a.worker:
        return interleaved_worker(a) if a.interleave else worker(a)
    if a.throttle:
        with Throttle(float(a.throttle), ("pair", "job")) as a.cgroups:
            return drive(a)
    return drive(a)


def drive(a):
    """The benchmark's runs and table (the driver process)."""
    import numpy as np
    n = a.ranks
    balances = a.balance.split(",")
    if a.data is None:
        a.data = "input" if balances == ["off"] else "dummy"
    comms = [c if b == "off" or c == "barrier" else c + "/" + b
             for c in a.comm.split(",") for b in balances]
    comms = list(dict.fromkeys(comms))
    allres = {}
    if a.interleave:
        print("ranks=%d, 1 BLAS thread per process, %d steps per mode, interleaved, each from a barrier"
              % (n, a.iters))
        print("%-14s %-12s %8s %8s" % ("net", "run", "step", "(median)"))
        for net in a.nets.split(","):
            allres[net] = run_interleaved(a, net, n)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(allres, f, indent=1)
        return
    print("ranks=%d, 1 BLAS thread per process, %d timed iterations (+%d warm-up), bucket %.2g MB "
          "(first %.2g MB), data from %s layers" % (n, a.iters, a.warmup, a.bucket_mb, a.first_bucket_mb,
                                                     "DummyData" if a.data == "dummy" else "Input"))
    hdr = "%-14s %-12s %9s %6s %8s %8s %8s %9s %8s %8s %8s" % (
        "net", "run", "images/s", "eff", "step", "(median)", "compute", "allreduce", "exposed", "(skew", "comm)")
    print(hdr)
    print("-" * len(hdr))
    for net in a.nets.split(",") if not a.worker else []:
        best, rounds = {}, {}
        for _ in range(a.repeat):
            for kind in comms:
                if a.unpaired:
                    ind = run_independent(a, net, n)
                    mpi = run_mpi(a, net, kind, n)
                else:
                    ind, mpi = run_paired(a, net, kind, n)
                for key, res in (("independent", ind), (kind, mpi)):
                    sm = summarize(res)
                    sm["raw"] = res
                    if key == kind:
                        # efficiency against the independent pair of the same round
                        sm["efficiency"] = sm["images_per_s"] / summarize(ind)["images_per_s"]
                        rounds.setdefault(kind, []).append(
                            (sm["efficiency"], 100 * sm["exposed_ms"] / sm["step_ms"],
                             100 * sm["comm_exposed_ms"] / sm["step_ms"]))
                    if key not in best or sm["images_per_s"] > best[key]["images_per_s"]:
                        best[key] = sm
        for kind in ["independent"] + comms:
            s = best[kind]
            s.setdefault("efficiency", 1.0)
            label = kind if kind == "independent" else "mpi/" + kind
            print("%-14s %-12s %9.1f %6.3f %8.2f %8.2f %8.2f %9.2f %8.2f %8.2f %8.2f%s" % (
                net, label, s["images_per_s"], s["efficiency"], s["step_ms"], s["median_step_ms"], s["compute_ms"],
                s["allreduce_ms"], s["exposed_ms"], s["skew_ms"], s["comm_exposed_ms"],
                "  (slowest process at the pace of all: %.3f)" % s["sync_ceiling"] if kind == "independent"
                else "  (%.1f%% of step exposed)" % (100 * s["exposed_ms"] / s["step_ms"])))
        if a.repeat > 1:
            # one round's efficiency moves by several points on a shared
            # machine; the rounds' spread says how far to trust one
            for kind in comms:
                e, x, c = np.array(rounds[kind]).T
                print("%-14s %-12s %d rounds: efficiency median %.3f (%.3f-%.3f), exposed median %.1f%% "
                      "of step (comm part %.1f%%)" % (net, "mpi/" + kind, len(e), np.median(e), e.min(),
                                                      e.max(), np.median(x), np.median(c)))
                best[kind]["rounds"] = [list(r) for r in rounds[kind]]
        allres[net] = best
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(allres, f, indent=1)


if __name__ == "__main__":
    main()
