"""The real solver under mpiexec: equivalence to one process (weights and
distributed test scores), resume on 2 ranks, no hangs on failures, an agreed
stop on a non-finite loss, and EASGD's centre in tests, snapshots and resume."""
import sys
import time

import numpy as np
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi, single

W = WORKERS / "solver_worker.py"
pytest.importorskip("h5py")


def caffemodel_weights(path):
    """A .caffemodel's learnable blobs, flat in layer order (net.param_data's layout)."""
    from caffempi.proto import caffe_pb2
    p = caffe_pb2.NetParameter()
    p.ParseFromString(path.read_bytes())
    return np.concatenate([np.asarray(b.data, np.float32) for layer in p.layer for b in layer.blobs])


def scores_of(d, weights, test_iter=4):
    """The solver's test outputs (test_iter batches of the test net) for the
    flat weights, computed by one process with a fresh test net."""
    from google.protobuf import text_format
    sys.path.insert(0, str(WORKERS))
    from solver_worker import net_text
    import caffempi.layer_types.data  # noqa: F401  (HDF5Data)
    from caffempi import TEST, Net
    from caffempi.proto import caffe_pb2
    net = Net(text_format.Merge(net_text(str(d), 12), caffe_pb2.NetParameter()), TEST)
    net.param_data[...] = weights
    sums = 0.0
    for _ in range(test_iter):
        net.forward()
        sums = sums + np.array([float(v) for _, vals, _ in net.output_values() for v in np.ravel(vals)])
    return sums / test_iter


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mpidata")


@pytest.fixture(scope="module")
def reference(data_dir):
    out = data_dir / "one.npz"
    single([W, data_dir, 12, 6, "out=%s" % out, "prefix=one"])
    return np.load(out)


@needs_mpi
@pytest.mark.parametrize("n,comm", [(2, "overlap"), (2, "blocking"), (3, "thread"), (3, "auto"),
                                    (3, "hierarchical")])
def test_solver_ranks_match_single_process(data_dir, reference, n, comm):
    out = data_dir / ("n%d_%s.npz" % (n, comm))
    mpirun(n, [W, data_dir, 12, 6, "out=%s" % out, "comm=%s" % comm, "prefix=n%d%s" % (n, comm)])
    got = np.load(out)
    assert int(got["iter"]) == 6
    np.testing.assert_allclose(got["w"], reference["w"], rtol=0, atol=1e-6)
    if 4 % n == 0:   # test_iter 4 split evenly: the same test records as one process
        np.testing.assert_allclose(got["test"], reference["test"], rtol=0, atol=1e-6)


@needs_mpi
def test_resume_on_two_ranks(data_dir):
    # equal shares: under --balance=auto the shares after the snapshot follow
    # each run's measured speeds (resuming with uneven shares: test_balance)
    full = data_dir / "full.npz"
    mpirun(2, [W, data_dir, 12, 6, "snapshot=3", "prefix=rs", "out=%s" % full, "balance=off"])
    state = data_dir / "rs_iter_3.solverstate"
    assert state.exists()
    resumed = data_dir / "resumed.npz"
    mpirun(2, [W, data_dir, 12, 6, "prefix=rs2", "resume=%s" % state, "out=%s" % resumed, "balance=off"])
    a, b = np.load(full), np.load(resumed)
    assert int(b["iter"]) == 6
    np.testing.assert_allclose(b["w"], a["w"], rtol=0, atol=1e-6)
    # Rank 1 works in a directory without the snapshot (a host that does not
    # share rank 0's file system): rank 0 reads it and sends rank 1 its part.
    elsewhere = data_dir / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    apart = data_dir / "apart.npz"
    mpirun(2, [W, data_dir, 12, 6, "prefix=rs3", "resume=%s" % state.name, "out=%s" % apart,
               "other_cwd=%s" % elsewhere, "balance=off"], cwd=data_dir)
    np.testing.assert_array_equal(np.load(apart)["w"], b["w"])
    # finetuning likewise reads the weights on rank 0 alone
    outs = []
    for k, extra in enumerate(([], ["other_cwd=%s" % elsewhere])):
        outs.append(data_dir / ("ft%d.npz" % k))
        mpirun(2, [W, data_dir, 12, 2, "prefix=ft%d" % k, "weights=rs_iter_3.caffemodel",
                   "out=%s" % outs[-1], "balance=off"] + extra, cwd=data_dir)
    np.testing.assert_array_equal(np.load(outs[0])["w"], np.load(outs[1])["w"])


@needs_mpi
def test_missing_snapshot_on_rank0_stops_every_rank_with_one_error(data_dir):
    p = mpirun(2, [W, data_dir, 12, 6, "prefix=ms", "resume=no_such.solverstate"], cwd=data_dir,
               check=False)
    assert p.returncode == 1
    assert p.stderr.count("solver state file no_such.solverstate does not exist") == 1, p.stderr
    assert "[rank" not in p.stderr and "Abort" not in p.stderr, p.stderr


@needs_mpi
@pytest.mark.parametrize("kind,comm", [("raise", "overlap"), ("kill", "overlap"), ("snapshot", "overlap"),
                                       ("raise", "shm"), ("kill", "shm")])
def test_failure_on_one_rank_ends_the_job(data_dir, kind, comm):
    """The others may be waiting inside MPI (overlap) or spinning on shared
    memory flags (shm): the job ends either way."""
    args = [W, data_dir, 12, 50, "prefix=f%s%s" % (kind, comm), "fail_rank=%d" % (0 if kind == "snapshot" else 1),
            "fail_iter=2", "fail_kind=%s" % kind, "comm=%s" % comm]
    if kind == "snapshot":
        args.append("snapshot=2")
    t = time.time()
    p = mpirun(2, args, timeout=60, check=False)
    assert p.returncode != 0, p.stderr
    assert time.time() - t < 60
    if kind == "raise":
        assert "[rank 1]" in p.stderr and "injected failure" in p.stderr


@needs_mpi
def test_nan_loss_on_one_rank_stops_every_rank_at_that_iteration(data_dir):
    each = data_dir / "fnan.rank%d.npz"
    # rank 1's loss turns NaN at iteration 2 (a NaN weight poisons ip3); snapshot every iteration
    p = mpirun(2, [W, data_dir, 12, 50, "prefix=fnan", "snapshot=1", "fail_rank=1", "fail_iter=2",
                   "fail_kind=nan", "each=%s" % each], timeout=60, check=False)
    assert p.returncode != 0, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    # one line, from rank 0, naming the iteration, the diverged rank and its layer; no MPI_Abort
    assert len(errors) == 1, p.stderr
    assert errors[0].startswith("caffempi: error: Iteration 2: training diverged on rank 1 "), p.stderr
    # ip3 is the first non-finite output (its data is freed by then, under
    # the default --memory=reuse: the forward runs again to find it)
    assert "(rank 1: loss = nan, first non-finite output in layer 'ip3')" in errors[0], errors[0]
    assert "Abort" not in p.stderr + p.stdout
    ranks = [np.load(str(each) % r) for r in range(2)]
    assert [int(r["iter"]) for r in ranks] == [2, 2]
    # neither rank updated its weights at iteration 2, and no later snapshot exists
    before = caffemodel_weights(data_dir / "fnan_iter_2.caffemodel")
    np.testing.assert_array_equal(ranks[0]["w"], before)
    np.testing.assert_array_equal(ranks[1]["w"][:-1], before[:-1])
    assert np.isnan(ranks[1]["w"][-1])
    assert not list(data_dir.glob("fnan_iter_3*"))


@needs_mpi
def test_stop_request_on_one_rank_stops_all_at_same_iteration(data_dir):
    out = data_dir / "stop.npz"
    # rank 1 alone asks to stop (as a SIGINT reaching it first would) in the
    # iteration from 2 to 3: polled before its sums, acted on after its update
    mpirun(2, [W, data_dir, 12, 50, "prefix=stop", "sigint_at=2", "out=%s" % out])
    assert int(np.load(out)["iter"]) == 3
    assert (data_dir / "stop_iter_3.caffemodel").exists()


@needs_mpi
@pytest.mark.parametrize("by", ["snapshot", "test"])
def test_easgd_snapshot_and_test_see_the_centre(data_dir, by):
    # 5 iterations, tau 2: the last local step leaves every rank off the centre;
    # then only the final snapshot, or only the final test pass, runs
    out, each = data_dir / ("ea%s.npz" % by), data_dir / ("ea%s.rank%%d.npz" % by)
    args = [W, data_dir, 12, 5, "prefix=ea" + by, "sync=easgd", "tau=2", "out=%s" % out, "each=%s" % each]
    args += ["test_interval=100"] if by == "snapshot" else ["test_interval=5", "after_train=0"]
    mpirun(2, args)
    ranks = [np.load(str(each) % r) for r in range(2)]
    for got in ranks:      # every rank took the centre
        np.testing.assert_array_equal(got["w"], got["center"])
        np.testing.assert_array_equal(got["w"], ranks[0]["w"])
    if by == "snapshot":
        np.testing.assert_array_equal(caffemodel_weights(data_dir / "easnapshot_iter_5.caffemodel"),
                                      ranks[0]["center"])
    else:                  # the scores are the centre's: one process testing it agrees
        assert not list(data_dir.glob("eatest_iter_*"))
        np.testing.assert_allclose(np.load(out)["test"], scores_of(data_dir, ranks[0]["center"]),
                                   rtol=1e-5, atol=1e-6)


@needs_mpi
def test_easgd_resume_continues_exactly(data_dir):
    full, resumed = data_dir / "eaf.rank%d.npz", data_dir / "ear.rank%d.npz"
    # snapshot at 3 (not a multiple of tau); the weights at 6 are the centre,
    # which depends on both ranks' local steps and momenta after the resume
    mpirun(2, [W, data_dir, 12, 6, "prefix=eaf", "sync=easgd", "tau=2", "snapshot=3", "each=%s" % full])
    mpirun(2, [W, data_dir, 12, 6, "prefix=ear", "sync=easgd", "tau=2",
               "resume=%s" % (data_dir / "eaf_iter_3.solverstate"), "each=%s" % resumed])
    for r in range(2):
        a, b = np.load(str(full) % r), np.load(str(resumed) % r)
        assert int(b["iter"]) == 6
        np.testing.assert_array_equal(b["w"], a["w"])
        np.testing.assert_array_equal(b["center"], a["center"])


@needs_mpi
@pytest.mark.parametrize("comm", ["auto", "blocking"])
def test_a_rank_that_stops_taking_part_ends_the_job_after_comm_timeout(data_dir, comm):
    """Rank 1 stops taking part at iteration 2 (as a rank behind a dead link
    would): rank 0, waiting for the gradient sum, names what it waited for
    once --comm_timeout has passed and ends the job, non-zero, no hang."""
    t = time.time()
    p = mpirun(2, [W, data_dir, 12, 6, "prefix=hang" + comm, "fail_rank=1", "fail_iter=2",
                   "fail_kind=hang", "comm_timeout=2", "comm=" + comm], check=False, timeout=60)
    assert p.returncode != 0
    assert time.time() - t < 30
    lines = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, p.stderr
    assert "rank 0 waited 2 s for gradient bucket 1 of" in lines[0] or \
        "rank 0 waited 3 s for gradient bucket 1 of" in lines[0], lines[0]
    assert "ending the job (--comm_timeout=2)" in lines[0]
    if comm == "auto":              # shm: the flags say who is missing
        assert "(ranks not joined: 1;" in lines[0], lines[0]


@needs_mpi
def test_a_rank_missing_from_the_low_rank_sums_ends_the_job(data_dir):
    """With --compress the wait after backward is first for the low-rank
    sums: rank 0 names them when rank 1 stops taking part."""
    p = mpirun(2, [W, data_dir, 12, 6, "prefix=hangpsgd", "fail_rank=1", "fail_iter=3", "fail_kind=hang",
                   "comm_timeout=2", "compress=powersgd:2", "link_gbps=0.001"], check=False, timeout=60)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, p.stderr
    assert "for the low-rank sums" in lines[0] and "ending the job (--comm_timeout=2)" in lines[0], lines[0]


def test_watchdog_exits_by_itself_when_the_abort_cannot_reach_the_others():
    import subprocess
    code = ("import time; from caffempi.parallel import watchdog; watchdog.ABORT_GRACE = 1; "
            "w = watchdog.Watchdog(3, 0.5, abort=lambda code: time.sleep(60)); "
            "ctx = w.watch('the test broadcast')\n"
            "with ctx: time.sleep(60)")
    t = time.time()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert time.time() - t < 10
    assert "rank 3 waited 1 s for the test broadcast (ranks not joined: not known;" in p.stderr, p.stderr


@needs_mpi
@pytest.mark.parametrize("n,comm", [(2, "overlap"), (3, "auto"), (2, "blocking")])
def test_sufficient_factors_equal_the_allreduce(data_dir, reference, n, comm):
    """--sfb=on forms every InnerProduct weight gradient from the ranks'
    gathered factors (one GEMM over all ranks' rows): the same training as
    the allreduce and as one process, to float32 rounding."""
    outs = {}
    for sfb in ("off", "on"):
        outs[sfb] = data_dir / ("sfb_%s_%d_%s.npz" % (sfb, n, comm))
        p = mpirun(n, [W, data_dir, 12, 6, "out=%s" % outs[sfb], "comm=%s" % comm, "sfb=%s" % sfb,
                       "prefix=sfb%s%d%s" % (sfb, n, comm)])
        if sfb == "on":
            assert p.stderr.count(": sufficient factors") == 3, p.stderr     # ip1, ip2, ip3
    on, off = np.load(outs["on"]), np.load(outs["off"])
    assert int(on["iter"]) == 6
    np.testing.assert_allclose(on["w"], off["w"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(on["w"], reference["w"], rtol=0, atol=1e-6)


@needs_mpi
@pytest.mark.parametrize("n,sfb", [(2, "off"), (3, "on")])
def test_float16_communication_trains_as_float32_to_its_rounding(data_dir, reference, n, sfb):
    """--comm_dtype=fp16: buckets (and factors) cross as float16, summed in
    float32; every rank keeps the same weights (the worker checks), within
    float16 rounding of the float32 training after 6 steps, and not equal
    to it (the rounding is there)."""
    out = data_dir / ("fp16_%d_%s.npz" % (n, sfb))
    mpirun(n, [W, data_dir, 12, 6, "out=%s" % out, "comm_dtype=fp16", "sfb=%s" % sfb,
               "prefix=fp16%d%s" % (n, sfb)])
    got = np.load(out)
    assert int(got["iter"]) == 6
    np.testing.assert_allclose(got["w"], reference["w"], rtol=0, atol=2e-4)      # seen: 2.8e-5, 3.6e-5
    assert not np.array_equal(got["w"], reference["w"])


@needs_mpi
@pytest.mark.parametrize("n,sfb,comm", [(2, "off", "overlap"), (3, "on", "overlap"), (3, "off", "hierarchical"),
                                        (2, "off", "shm")])
def test_powersgd_trains_with_its_plan_and_composes_with_factors(data_dir, reference, n, sfb, comm):
    """--compress=powersgd:2 on a 1 Mbit/s link (--link_gbps): the plan
    puts ip1 (20x108), ip2 (16x20) and ip3 (5x16) on low rank, unless the
    factors were told to take them (--sfb=on); the run trains as the exact
    one to within what low rank delays (the first two steps exact), every
    rank keeping the same weights (the worker checks), whichever transport
    sums the biases."""
    out = data_dir / ("psgd_%d_%s_%s.npz" % (n, sfb, comm))
    p = mpirun(n, [W, data_dir, 12, 6, "out=%s" % out, "compress=powersgd:2", "compress_start_iter=2",
                   "sfb=%s" % sfb, "prefix=psgd%d%s%s" % (n, sfb, comm), "link_gbps=0.001", "comm=" + comm])
    low = [line for line in p.stderr.splitlines() if "Low rank: " in line and " at rank 2" in line]
    assert len(low) == (0 if sfb == "on" else 3), p.stderr
    assert p.stderr.count(": low rank\n") == len(low), p.stderr            # the plan's lines
    got = np.load(out)
    assert int(got["iter"]) == 6
    np.testing.assert_allclose(got["w"], reference["w"], rtol=0, atol=0.05)
    if sfb == "off":
        assert not np.allclose(got["w"], reference["w"], rtol=0, atol=1e-5)     # it is lossy
    else:
        np.testing.assert_allclose(got["w"], reference["w"], rtol=0, atol=1e-6)   # nothing went low rank


@needs_mpi
def test_powersgd_at_full_rank_is_clipped_and_decayed_as_the_exact_sum(data_dir):
    """Clipping (clip_gradients) and weight decay act on the decompressed
    mean, as on the exact one: at full rank (rank 20 >= every weight's
    smaller side) low rank trains as the exact sum does, with clipping that
    binds (the unclipped run ends elsewhere)."""
    outs = {}
    for name, args in (("exact", ["clip=0.05"]),
                       ("full", ["clip=0.05", "compress=powersgd:20", "lowrank_use=all"]), ("unclipped", [])):
        outs[name] = data_dir / ("psclip_%s.npz" % name)
        p = mpirun(2, [W, data_dir, 12, 6, "out=%s" % outs[name], "prefix=psclip" + name, "link_gbps=0.001",
                       "comm=overlap"] + args)
        if name == "full":
            assert p.stderr.count(": low rank\n") == 3, p.stderr
    exact, full, unclipped = (np.load(outs[k])["w"] for k in ("exact", "full", "unclipped"))
    np.testing.assert_allclose(full, exact, rtol=0, atol=2e-6)
    assert not np.allclose(unclipped, exact, rtol=0, atol=1e-3)


@needs_mpi
@pytest.mark.parametrize("fmt", ["binary", "hdf5"])
def test_powersgd_resume_continues_bitwise(data_dir, fmt):
    """A snapshot carries each rank's Q, error and step count (the first
    two steps exact): resumed at 3, the run reaches the uninterrupted one's
    weights bit for bit, in both snapshot formats."""
    args = ["compress=powersgd:2", "compress_start_iter=2", "link_gbps=0.001", "comm=overlap", "balance=off"]
    if fmt == "hdf5":
        args.append("snapshot_format=hdf5")
    ext = ".solverstate.h5" if fmt == "hdf5" else ".solverstate"
    full, resumed = data_dir / ("psf_%s.npz" % fmt), data_dir / ("psr_%s.npz" % fmt)
    mpirun(2, [W, data_dir, 12, 6, "prefix=psf" + fmt, "snapshot=3", "out=%s" % full] + args)
    mpirun(2, [W, data_dir, 12, 6, "prefix=psr" + fmt, "resume=%s" % (data_dir / ("psf%s_iter_3%s" % (fmt, ext))),
               "out=%s" % resumed] + args)
    a, b = np.load(full), np.load(resumed)
    assert int(b["iter"]) == 6
    np.testing.assert_array_equal(b["w"], a["w"])

