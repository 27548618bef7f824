"""Single-process pieces: lazy MPI import, bucketing, the trivial world."""
import os
import subprocess
import sys

import numpy as np
import pytest

from caffempi.common import SolverAction
from caffempi.parallel.comm import SingleWorld, launched_by_mpi, mapped_files
from caffempi.parallel.buckets import make_buckets
from caffempi.parallel.sync import BucketedAllreduce

from .mpirun import REPO, WORKERS, env, mpirun, needs_mpi


def test_no_mpi_import_without_launcher():
    code = ("import sys; from caffempi.parallel import get_world; import caffempi.cli; "
            "w = get_world(); assert w.size == 1 and not w.is_mpi; "
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    e = env()
    for v in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        e.pop(v, None)
    subprocess.run([sys.executable, "-c", code], check=True, env=e, timeout=60)


def test_launcher_detection():
    assert launched_by_mpi({"PMI_SIZE": "2"})
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    assert not launched_by_mpi({})
    assert not launched_by_mpi({"PMI_SIZE": "2", "CAFFEMPI_MPI": "0"})
    assert launched_by_mpi({"CAFFEMPI_MPI": "1"})


@needs_mpi
def test_launcher_and_mpi_library_that_disagree_fail_in_one_line():
    # Open MPI's launcher variables with mpi4py on MPICH: each process would
    # init a world of 1 and train alone, so the CLI must refuse
    e = env()
    for v in ("PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS"):
        e.pop(v, None)
    e["OMPI_COMM_WORLD_SIZE"] = "2"
    p = subprocess.run([sys.executable, "-m", "caffempi", "train", "--solver=models/mnist/lenet_solver.prototxt"],
                       env=e, capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert p.returncode == 1
    assert "caffempi: error: the launcher started 2 ranks but MPI sees 1" in p.stderr
    assert "Traceback" not in p.stderr


def _net():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "workers"))
    from nets import net_param
    from caffempi.net import Net
    return Net(net_param(4))


def test_buckets_are_whole_layers_in_reverse_order():
    net = _net()
    per_layer = make_buckets(net, bucket_mb=1e-9, first_bucket_mb=1e-9)
    owners = sorted(set(net.param_layer_index), reverse=True)
    assert [b[0] for b in per_layer] == owners                 # one bucket per layer, top first
    ends = [b[2] for b in per_layer]
    assert ends[0] == net.param_diff.size
    for (_, s, e, _), (_, s2, e2, _) in zip(per_layer, per_layer[1:]):
        assert e2 == s                                       # contiguous, descending ranges
    # large caps: everything in one bucket but the lowest layer, whose sum
    # can start only when backward ends, so it goes alone
    two = make_buckets(net, bucket_mb=100, first_bucket_mb=100)
    assert [b[3] for b in two] == [owners[:-1], owners[-1:]]
    assert two[0][2] == net.param_diff.size and two[1][1] == 0 and two[0][1] == two[1][2]


def test_single_process_sync_is_identity():
    net = _net()
    red = BucketedAllreduce(SingleWorld())
    col = red.collectives
    red.attach(net)
    net.blobs["data"].data[...] = np.random.RandomState(0).randn(*net.blobs["data"].shape)
    net.blobs["label"].data[...] = [0, 1, 2, 3]
    red.start_iteration(net, 1)
    net.forward_backward()
    g = net.param_diff.copy()
    red.finish(net)
    np.testing.assert_array_equal(net.param_diff, g)
    assert col.mean_scalars([1.5, 2.0]) == [1.5, 2.0]
    assert col.split_test_iters(7) == 7
    assert col.combine_action(1) == 1
    assert col.gather_object({"a": 1}) == [{"a": 1}]
    assert col.diverged_ranks(None, False) == []
    assert col.diverged_ranks({"loss": "nan"}, True) == [(0, {"loss": "nan"})]
    assert col.start_agreement(True, SolverAction.STOP)() == (True, SolverAction.STOP)


@needs_mpi
def test_thread_level_follows_the_comm_mode():
    """MPI_THREAD_MULTIPLE (a lock in every MPICH call) only for the
    communication thread; the other modes call MPI from the main thread."""
    code = ("import sys; from caffempi.parallel.comm import get_world; w = get_world(sys.argv[1]); "
            "want = w.MPI.THREAD_MULTIPLE if sys.argv[1] == 'thread' else w.MPI.THREAD_FUNNELED; "
            "assert w.size == 2 and w.thread_level == want, (sys.argv[1], w.thread_level)")
    for comm in ("thread", "overlap", "blocking"):
        mpirun(2, ["-c", code, comm])


@needs_mpi
def test_ranks_on_a_host_share_its_cores():
    """Without OPENBLAS_NUM_THREADS/OMP_NUM_THREADS, each of the 2 ranks on
    this host runs cores/2 kernel threads (at least 1), not one per core; a
    count given in the environment is kept (needs 2 cores to tell apart)."""
    import os
    code = ("import sys, os; from caffempi.parallel.rank import setup_parallel; "
            "from caffempi.backend import threads; setup_parallel(); "
            "assert threads.thread_count() == int(sys.argv[1]), (threads.thread_count(), sys.argv[1])")
    cores = len(os.sched_getaffinity(0))
    e = env()
    del e["OPENBLAS_NUM_THREADS"], e["OMP_NUM_THREADS"]
    from .mpirun import mpiexec_path
    share = max(1, cores // 2)
    given = 2 if share == 1 else 1        # BLAS caps counts at the cores
    for want, extra in ((share, {}), (given, {"OMP_NUM_THREADS": str(given)})):
        subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-c", code, str(want)], check=True,
                       env=dict(e, **extra), cwd=REPO, timeout=60, capture_output=True)


@needs_mpi
def test_shm_sums_are_exact_in_any_arrival_order():
    mpirun(3, [WORKERS / "shm_worker.py"])


@needs_mpi
def test_shm_falls_back_to_mpi_when_dev_shm_has_no_room():
    p = mpirun(2, [WORKERS / "shm_room_worker.py"])
    assert "/dev/shm has 10.0 MB free and the sums need 61.2 MB" in p.stderr, p.stderr
    assert p.stderr.count("using --comm=overlap") == 1, p.stderr       # rank 0 only


def test_free_bytes_of_a_directory(tmp_path):
    from caffempi.parallel.transports.shm import free_bytes
    assert free_bytes(str(tmp_path)) > 0
    assert free_bytes(str(tmp_path / "absent")) is None


@needs_mpi
@pytest.mark.parametrize("sfb", [False, True])
def test_overlap_polls_between_kernel_chunks(sfb):
    """The transport's pending sums, and with --sfb the factor gathers, are
    tested between the chunks of a layer's kernels (progress_worker)."""
    p = mpirun(2, [WORKERS / "progress_worker.py"] + (["sfb"] if sfb else []))
    assert "polls inside conv backward" in p.stdout


@needs_mpi
def test_a_killed_job_leaves_no_shared_memory_file_behind():
    # MPICH removes its /dev/shm segment only in MPI_Finalize; the world
    # unlinks it once every rank has mapped it
    p = mpirun(2, [WORKERS / "killed_worker.py"], check=False, timeout=60)
    assert p.returncode != 0, p.stdout + p.stderr
    paths = [line.split(None, 1)[1] for line in p.stdout.splitlines() if line.startswith("SHM ")]
    if not paths:
        pytest.skip("this MPI keeps no /dev/shm/mpich_shm_* file")
    assert [q for q in paths if os.path.exists(q)] == []


def test_mapped_files_lists_named_files_with_the_prefix(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000200000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_ab12_0\n"
        "7f0000200000-7f0000300000 rw-s 00000000 00:1a 124 /dev/shm/mpich_shm_cd34_0 (deleted)\n"
        "7f0000300000-7f0000400000 rw-s 00000000 00:1a 125 /dev/shm/other_segment\n"
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0 \n"
        "7f0000500000-7f0000600000 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    assert mapped_files("/dev/shm/mpich_shm_", str(maps)) == ["/dev/shm/mpich_shm_ab12_0"]
    assert mapped_files("/dev/shm/mpich_shm_", str(tmp_path / "absent")) == []


class _TwoRankWorld(SingleWorld):
    """Rank 0 of two whose rank 1 reports ``other`` in every allgather."""
    size = 2

    def __init__(self, other):
        self.other = other

    def allgather(self, obj, what=None):
        return [obj, self.other]


def test_check_same_net_names_the_first_differing_layer():
    from caffempi.common import AgreedError
    from caffempi.parallel.collectives import Collectives
    net = _net()
    mine = [(n, lay.type, tuple(tuple(b.shape) for b in lay.blobs)) for n, lay in zip(net.layer_names, net.layers)]
    Collectives(_TwoRankWorld(mine)).check_same_net(net)          # the same net: nothing happens
    wider = [(n, t, ((8, 108), (8,)) if n == "ip2" else s) for n, t, s in mine]
    with pytest.raises(AgreedError, match=r"rank 1 built a different net than rank 0 .*layer 4 is 'ip2' "
                                          r"\(InnerProduct, param 16x20, param 16\) on rank 0 and 'ip2' "
                                          r"\(InnerProduct, param 8x108, param 8\) on rank 1"):
        Collectives(_TwoRankWorld(wider)).check_same_net(net)
    with pytest.raises(AgreedError, match=r"layer 9, 'acc' \(Accuracy\), is missing on rank 1 \(9 layers against 10\)"):
        Collectives(_TwoRankWorld(mine[:-1])).check_same_net(net)
    with pytest.raises(AgreedError, match=r"rank 1 has an extra layer 10, 'x' \(ReLU\)"):
        Collectives(_TwoRankWorld(mine + [("x", "ReLU", ())])).check_same_net(net)


def test_strategies_and_transports_declare_their_interface():
    from caffempi.parallel.sync import GradientSync
    from caffempi.parallel.transports import make_transport
    from caffempi.parallel.transports.base import LocalTransport, Transport
    with pytest.raises(TypeError):
        GradientSync(SingleWorld())               # attach and finish are abstract
    with pytest.raises(TypeError):
        Transport()
    t = make_transport(SingleWorld(), "overlap")
    assert isinstance(t, LocalTransport) and t.overlaps_backward
    from caffempi.common import CaffeError
    with pytest.raises(CaffeError, match="unknown --comm 'fast'"):
        make_transport(SingleWorld(), "fast")


def test_factor_cost_model_picks_factors_for_wide_layers_on_slow_links():
    from caffempi.parallel.costs import Costs
    from caffempi.parallel.sfb import factor_seconds
    gbit = 1e9 / 8
    # CaffeNet's fc6 (4096 x 9216) at 8 images a rank, 2 ranks, 1 Gbit/s: 151 MB
    # of gradient (1.2 s) against 0.4 MB of factors and a 0.6 GFLOP GEMM
    costs = Costs(2, gbit, 50e-6, 100e9, 10e9)
    full, sfb = costs.allreduce_seconds(4096 * 9216 * 4), factor_seconds(costs, 8, 4096, 9216)
    assert 1.1 < full < 1.3 and sfb < 0.02
    # LeNet's ip2 (10 x 500) at 64 images, in shared memory: the gather's two
    # messages cost more than the 20 KB gradient
    costs = Costs(2, 10e9, 20e-6, 100e9, 10e9)
    assert factor_seconds(costs, 64, 10, 500) > costs.allreduce_seconds(10 * 500 * 4)


PLAN_NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 11 dim: 11 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 96 kernel_size: 11 } }
layer { name: "fc" type: "InnerProduct" bottom: "conv1" top: "fc" inner_product_param { num_output: 500 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc" top: "fc2" inner_product_param { num_output: 800 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("link_gbps", [0.1, 100.0])
@pytest.mark.parametrize("compress", ["none", "powersgd"])
def test_the_plan_gives_each_weight_the_cheapest_way(link_gbps, compress):
    """Two ranks (as rank 0 sees them): at 100 Mbit/s conv1 (96 x 363) goes
    low rank with --compress, fc and fc2 keep their factors (4 rows a rank
    cost less than two rank-4 sums and the passes over their values);
    without --compress one line says what low rank would save; at
    100 Gbit/s low rank's products and passes cost more than it saves."""
    from caffempi.common import captured_log
    from caffempi.parallel.config import ParallelConfig
    from caffempi.proto import caffe_pb2
    from caffempi.net import Net
    from google.protobuf import text_format
    net = Net(text_format.Merge(PLAN_NET, caffe_pb2.NetParameter()))
    sync = ParallelConfig(compress=compress, link_gbps=link_gbps, gemm_gflops=50).make_sync(_TwoRankWorld(None))
    with captured_log() as msgs:
        shares = sync._plan(net)
    factors, low = ([net.param_owner_names[p] for p in share] for share in shares)
    lines = [m for m in msgs if m.startswith("Plan: ")]
    assert len([m for m in lines if "(96x3x11x11): allreduce" in m]) == 1, lines
    slow = link_gbps < 1
    assert factors == ["fc[0]", "fc2[0]"]
    assert low == (["conv1[0]"] if slow and compress == "powersgd" else [])
    advice = [m for m in lines if "would save an estimated" in m]
    assert len(advice) == (1 if slow and compress == "none" else 0), lines
    if advice:
        assert "low rank would save an estimated" in advice[0] and "on conv1[0];" in advice[0]
        assert "--compress=powersgd asks for it (lossy)" in advice[0]


def test_layers_that_cannot_use_factors_say_why():
    from caffempi.common import captured_log
    from caffempi.parallel.sfb import SufficientFactors
    from caffempi.proto import caffe_pb2
    from google.protobuf import text_format
    sys.path.insert(0, str(WORKERS))
    from nets import MLP
    shared = MLP % {"b": 4}
    shared = shared.replace('name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3"',
                            'name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3" param { name: "w3" }')
    shared = shared.replace('layer { name: "loss"', 'layer { name: "ip3b" type: "InnerProduct" bottom: "ip2" '
                            'top: "ip3b" param { name: "w3" } inner_product_param { num_output: 5 } }\n'
                            'layer { name: "loss"')
    from caffempi.net import Net
    net = Net(text_format.Merge(shared, caffe_pb2.NetParameter()))
    sfb = SufficientFactors(mode="on")
    with captured_log() as msgs:
        names = [net.layer_names[i] for i, _, _, _ in sfb.eligible(SingleWorld(), net, 1)]
    assert names == ["ip1", "ip2"]
    assert any("layer 'ip3' keeps the allreduce (its weight is shared with another layer)" in m for m in msgs)
    with captured_log() as msgs:
        assert sfb.eligible(SingleWorld(), net, 2) == []
    assert any("layer 'ip1' keeps the allreduce (iter_size 2: the factors" in m for m in msgs), msgs


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_float16_factors_keep_precision_at_gradient_magnitudes(n):
    p = mpirun(n, [WORKERS / "sfb_fp16_worker.py"])
    assert "SFB FP16 OK" in p.stdout


@needs_mpi
@pytest.mark.parametrize("mode", ["overlap", "thread"])
@pytest.mark.parametrize("n", [2, 3])
def test_float16_sums(n, mode):
    p = mpirun(n, [WORKERS / "fp16_worker.py", mode])
    assert "FP16 OK" in p.stdout


@needs_mpi
@pytest.mark.parametrize("worker,ok", [
    # fp16 over shm, overlap, blocking and thread: the same bits; hierarchical within rounding
    ("fp16_modes_worker.py", "FP16 MODES OK"),
    # powersgd: full rank is exact, error feedback delays nothing
    ("powersgd_worker.py", "POWERSGD OK")])
@pytest.mark.parametrize("n", [2, 3])
def test_compressed_sums(n, worker, ok):
    p = mpirun(n, [WORKERS / worker])
    assert ok in p.stdout


def test_compress_flags_are_checked_when_the_config_is_made():
    from caffempi.common import CaffeError
    from caffempi.parallel.config import ParallelConfig
    from caffempi.parallel.powersgd import LowRank
    plugins = ParallelConfig(compress="powersgd:2", compress_start_iter=5).make_sync(SingleWorld()).plugins
    assert isinstance(plugins[-1], LowRank) and (plugins[-1].rank, plugins[-1].start_iter) == (2, 5)
    default = ParallelConfig().make_sync(SingleWorld()).plugins      # advises, takes nothing
    assert [(type(p), p.advise_only) for p in default if isinstance(p, LowRank)] == [(LowRank, True)]
    for bad in ("powersgd:0", "powersgd:x", "none:2", "topk"):
        with pytest.raises(CaffeError, match="unknown --compress '%s'" % bad):
            ParallelConfig(compress=bad)
    with pytest.raises(CaffeError, match="--compress=powersgd cannot go with --sync=easgd"):
        ParallelConfig(compress="powersgd", sync="easgd")



class _ScriptedRankWorld(SingleWorld):
    """Rank 0 of two whose rank 1 reports the next of ``others`` (its
    counts) in each max allreduce."""
    size = 2

    def __init__(self, others):
        self.others = list(others)

    def allreduce_scalars(self, values, op="sum", what=None):
        assert op == "max"
        return np.maximum(np.asarray(values, np.float64), self.others.pop(0))


def test_a_signal_that_reaches_the_ranks_at_different_iterations_acts_once():
    from caffempi.common import SolverAction
    from caffempi.parallel.collectives import Collectives
    none, snap, stop = SolverAction.NONE, SolverAction.SNAPSHOT, SolverAction.SNAPSHOT_AND_STOP
    # rank 1's counts (SNAPSHOT_AND_STOP, STOP, SNAPSHOT) at each poll: its SIGHUP
    # comes a poll after rank 0's, its SIGTERM a poll before
    col = Collectives(_ScriptedRankWorld([[0, 0, 0], [0, 0, 1], [0, 0, 1], [1, 0, 1], [1, 0, 1], [1, 0, 2]]))
    assert [col.combine_action(a) for a in (snap, none, none, none, stop, snap)] == \
        [snap, none, none, stop, none, snap]
