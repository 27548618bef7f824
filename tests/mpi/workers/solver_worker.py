"""Train a small HDF5Data net with the real solver, as `caffempi train`
does under mpiexec: setup_parallel, the solver with its gradient sync, solve.

usage: solver_worker.py DIR GLOBAL_BATCH MAX_ITER [key=value ...]
keys: comm, snapshot (interval), resume (solverstate), weights (caffemodel to
      finetune from), other_cwd (ranks but 0 work in this directory, as on a
      host that does not share rank 0's files), fail_rank, fail_iter,
      fail_kind (raise|nan|kill|snapshot|hang: stops taking part, as a rank
      behind a dead link), comm_timeout, sfb (off|on|auto), comm_dtype, sync, tau, test_interval, after_train
      snapshot_format (hdf5), compress, compress_start_iter, link_gbps (the plan's link; gemm_gflops 50 with it),
      clip (the solver's clip_gradients), lowrank_use (auto|all: every weight on low rank, whatever the plan),
      balance (off|auto|B0:B1..., default auto as train's), iter_size, slow_rank (the balancer's clock: a record
      takes 1 ms, 3 ms on this rank; decisions every balance_interval seconds of that clock, default 0.1)
      (0: no snapshot_after_train),
      out (npz written by rank 0), each (npz path with %d: every rank writes its
      iteration, weights and EASGD centre when it stops, also on an error)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nets import MLP  # noqa: E402

import caffempi.layer_types  # noqa: E402,F401
try:
    import caffempi.layer_types.data  # noqa: E402,F401  (registers HDF5Data until layers/__init__ does)
except ImportError:
    pass
from caffempi.parallel.config import ParallelConfig  # noqa: E402
from caffempi.parallel.rank import exit_code, run_guarded, setup_parallel  # noqa: E402

SOLVER = """
net_param { %(net)s }
base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "step" gamma: 0.5 stepsize: 4
max_iter: %(max_iter)d display: 1 average_loss: 1
test_iter: 4 test_interval: %(test_interval)d test_initialization: true
snapshot: %(snapshot)d snapshot_prefix: "%(prefix)s" random_seed: 3
"""


def make_data(d, n_train=96, n_test=32):
    import h5py
    r = np.random.RandomState(0)
    for name, n in (("train", n_train), ("test", n_test)):
        x = r.randn(n, 3, 6, 6).astype(np.float32)
        y = (np.abs(x[:, 0, 0, 0] * 3).astype(int) % 5).astype(np.float32)
        path = os.path.join(d, name + ".h5")
        if not os.path.exists(path):
            with h5py.File(path + ".tmp", "w") as f:
                f["data"] = x
                f["label"] = y
            os.replace(path + ".tmp", path)
        with open(os.path.join(d, name + ".txt"), "w") as f:
            f.write(path + "\n")


def net_text(d, batch, test_batch=8):
    layers = MLP[MLP.index('layer { name: "ip1"'):]   # drop the name and the Input layer
    head = """name: "mlp"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "%s/train.txt" batch_size: %d } }
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "%s/test.txt" batch_size: %d } }
""" % (d, batch, d, test_batch)
    return head + layers


def simulate_speeds(balancer, rank, slow_rank, interval):
    """The balancer's clock: each reading is one more share's work at 1 ms
    a record (3 ms on ``slow_rank``), and no waiting on that clock, so its
    decisions are the same every run."""
    per_record = 0.003 if rank == slow_rank else 0.001
    now = [0.0]

    def clock():
        shares = balancer.net.batch_shares
        now[0] += per_record * (shares[rank] if shares else balancer.batch)
        return now[0]
    balancer.clock, balancer.waited, balancer.interval = clock, lambda: 0.0, interval


def main():
    d, global_b, max_iter = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kw = dict(a.split("=", 1) for a in sys.argv[4:])
    world, sync = setup_parallel(ParallelConfig(comm=kw.get("comm", "overlap"), sync=kw.get("sync", "sgd"),
                                                tau=int(kw.get("tau", 10)), alpha=float(kw.get("alpha", 0.2)),
                                                bucket_mb=float(kw.get("bucket_mb", 0.001)),
                                                comm_timeout=float(kw.get("comm_timeout", 600)),
                                                sfb=kw.get("sfb", "off"), comm_dtype=kw.get("comm_dtype", "fp32"),
                                                compress=kw.get("compress", "none"),
                                                compress_start_iter=int(kw.get("compress_start_iter", 0)),
                                                link_gbps=float(kw.get("link_gbps", 0)),
                                                gemm_gflops=50.0 if kw.get("link_gbps") else 0.0,
                                                balance=kw.get("balance", "auto")))
    if kw.get("slow_rank"):
        simulate_speeds(sync.balancer, world.rank, int(kw["slow_rank"]), float(kw.get("balance_interval", 0.1)))

    for plugin in getattr(sync, "plugins", ()):
        if kw.get("lowrank_use") and hasattr(plugin, "use"):
            plugin.use = kw["lowrank_use"]

    def run():
        from google.protobuf import text_format
        from caffempi.proto import caffe_pb2
        from caffempi.solvers import get_solver, SolverAction
        if world.rank == 0:
            make_data(d)
        world.barrier()
        p = caffe_pb2.SolverParameter()
        text_format.Merge(SOLVER % {
            "net": net_text(d, global_b // world.size), "max_iter": max_iter,
            "test_interval": int(kw.get("test_interval", 3)),
            "snapshot": int(kw.get("snapshot", 0)),
            "prefix": os.path.join(d, kw.get("prefix", "snap"))}, p)
        p.snapshot_after_train = kw.get("after_train", "1") != "0"
        if kw.get("clip"):
            p.clip_gradients = float(kw["clip"])
        if kw.get("iter_size"):
            p.iter_size = int(kw["iter_size"])
        if kw.get("snapshot_format") == "hdf5":
            p.snapshot_format = caffe_pb2.SolverParameter.HDF5
        if kw.get("other_cwd") and world.rank:
            os.chdir(kw["other_cwd"])
        solver = get_solver(p, sync=sync, weights=kw.get("weights"))
        fail_rank = int(kw.get("fail_rank", -1))
        fail_iter = int(kw.get("fail_iter", -1))
        kind = kw.get("fail_kind", "raise")
        if world.rank == fail_rank:
            net = solver.net
            orig = net.forward_backward

            def bad(**kwargs):
                if solver.iter == fail_iter:
                    if kind == "raise":
                        raise RuntimeError("injected failure at iteration %d" % solver.iter)
                    if kind == "kill":
                        os.kill(os.getpid(), 9)
                    if kind == "hang":
                        import time
                        time.sleep(3600)
                    if kind == "nan":      # poisons ip3's output, hence the loss
                        net.param_data[-1] = np.nan
                return orig(**kwargs)
            net.forward_backward = bad
            if kind == "snapshot":
                solver.param.snapshot_prefix = "/nonexistent/dir/snap"
        if kw.get("sigint_at"):
            stop_at = int(kw["sigint_at"])
            solver.set_action_function(
                lambda: SolverAction.STOP if (world.rank == 1 and solver.iter >= stop_at) else SolverAction.NONE)
        if kw.get("resume"):
            solver.restore(kw["resume"])
        try:
            solver.solve()
        finally:
            if kw.get("each"):
                averager = getattr(sync, "averager", None)
                np.savez(kw["each"] % world.rank, w=solver.net.param_data, iter=solver.iter,
                         center=averager.center if averager else np.zeros(0))
        if world.rank == 0 and kw.get("out"):
            np.savez(kw["out"], w=solver.net.param_data, iter=solver.iter,
                     test=np.asarray(solver.test_scores[0]), shares=np.asarray(solver.net.batch_shares or ()))
        if kw.get("sync", "sgd") == "sgd":
            assert sync.collectives.check_in_sync(solver.net), "weights differ between ranks"
        return 0
    rc = run_guarded(run, world=world)
    return exit_code(rc, world)


if __name__ == "__main__":
    sys.exit(main())
