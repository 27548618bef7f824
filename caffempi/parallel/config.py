"""The data-parallel settings of a run: one frozen :class:`ParallelConfig`
that defines the command-line flags (``--ranks``, ``--comm``, ``--sfb``
...), validates them once when made, and builds the gradient strategy
they describe.  The CLI makes it from its flags; a pycaffe script's solver
under mpiexec takes the defaults (``ParallelConfig()``)."""
from dataclasses import dataclass, fields
from typing import ClassVar

from ..common import CaffeError
from .balance import ShareBalancer, parse_balance
from .buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
from .easgd import ElasticAveraging
from .launch import check_ranks
from .powersgd import LowRank, parse_compress
from .sfb import SFB_MODES, SufficientFactors
from .sync import BucketedAllreduce
from .transports import check_comm_dtype, check_comm_mode
from .watchdog import DEFAULT_TIMEOUT

SYNC_MODES = ("sgd", "easgd")


@dataclass(frozen=True)
class ParallelConfig:
    """The data-parallel flags, with train's defaults; invalid values raise
    a CaffeError naming the flag when the config is made."""
    ranks: int = 0
    comm: str = "auto"
    bucket_mb: float = DEFAULT_BUCKET_MB
    sync: str = "sgd"
    tau: int = 10
    alpha: float = 0.2
    sfb: str = "auto"
    link_gbps: float = 0.0
    gemm_gflops: float = 0.0
    comm_dtype: str = "fp32"
    comm_timeout: float = DEFAULT_TIMEOUT
    compress: str = "none"
    compress_start_iter: int = 0
    balance: str = "auto"

    HELP: ClassVar[dict] = {
        "ranks": "Optional; for 'train' without a launcher: run on this many ranks of this host, under the "
                 "mpiexec beside this Python (else the one on PATH), with the same flags; 0: one rank per --gpu "
                 "id (one without --gpu). Under mpiexec: must be the job's size.",
        "comm": "Optional; gradient averaging: auto (CPU nets: shm when every rank is on one host, hierarchical "
                "when the ranks span hosts and some host has several, else thread; GPU nets: nccl when NCCL can "
                "join the ranks, else overlap), shm (ranks of one host sum in shared memory, whichever waits "
                "doing the sums), hierarchical (sum on each host, then across hosts by one rank a host, then "
                "share), overlap (MPI Iallreduce per bucket during backward, polled between layers), thread "
                "(a communication thread), async (MPICH progress thread), nopoll, blocking (one allreduce "
                "after backward), or nccl (GPU: NCCL per bucket on a side stream).",
        "bucket_mb": "Optional; allreduce bucket size in MB (whole layers, reverse layer order; the first bucket "
                     "is at most 1 MB).",
        "sync": "Optional; sgd (average gradients every iteration) or easgd (elastic averaging every --tau "
                "steps).",
        "tau": "Optional; EASGD communication period in iterations.",
        "alpha": "Optional; EASGD moving rate.",
        "sfb": "Optional; sufficient-factor broadcast for InnerProduct weights (Poseidon): auto (a cost model "
               "chooses per layer at start-up), on (every eligible layer) or off.",
        "link_gbps": "Optional; the link bandwidth the gradient plan (--sfb, --compress) assumes, in Gbit/s "
                     "(0: measured at start-up).",
        "gemm_gflops": "Optional; the GEMM rate the gradient plan (--sfb, --compress) assumes, in GFLOP/s (0: "
                       "measured at start-up).",
        "comm_dtype": "Optional; fp16 sends gradient buckets and sufficient factors as float16, summed in "
                      "float32 (half the bytes; CPU nets; any --comm but nccl), or fp32.",
        "comm_timeout": "Optional; seconds a rank may wait in one collective (gradient bucket, agreement, "
                        "broadcast) before it names what it waited for and ends the job; 0: wait forever.",
        "compress": "Optional; none (exact sums, Caffe's trajectory; the log says where low rank would pay) "
                    "or powersgd[:RANK] (PowerSGD: weight gradients sent at rank RANK, default 4, with error "
                    "feedback, where the cost model finds it over 10% faster than the exact ways; CPU nets; "
                    "lossy).",
        "compress_start_iter": "Optional; with --compress: the first iterations summed exactly.",
        "balance": "Optional; each rank's share of the global batch: auto (by the ranks' measured speed, "
                   "smoothed over the last iterations, or every SECONDS of steps with auto:SECONDS, for nets "
                   "whose layers treat samples apart; the same records and gradient as equal shares), off "
                   "(equal shares, Caffe's rule) or fixed per-rank counts B0:B1:... (summing to ranks x batch).",
    }

    def __post_init__(self):
        check_ranks(self.ranks)
        check_comm_mode(self.comm)
        check_comm_dtype(self.comm_dtype)
        if self.sync not in SYNC_MODES:
            raise CaffeError("unknown --sync '%s' (sgd or easgd)" % self.sync)
        if self.sfb not in SFB_MODES:
            raise CaffeError("unknown --sfb '%s' (auto, on or off)" % self.sfb)
        if self.tau < 1:
            raise CaffeError("--tau must be >= 1, got %d" % self.tau)
        if parse_compress(self.compress)[0] != "none" and self.sync == "easgd":
            raise CaffeError("--compress=%s cannot go with --sync=easgd, which sends no gradients" % self.compress)
        if parse_balance(self.balance)[0] == "fixed" and self.sync == "easgd":
            raise CaffeError("--balance=%s cannot go with --sync=easgd, whose ranks train apart" % self.balance)
        if self.compress_start_iter < 0:
            raise CaffeError("--compress_start_iter must be >= 0, got %d" % self.compress_start_iter)

    @classmethod
    def define_flags(cls, define):
        """Define the flags through a flag set's ``define(name, default, help)``."""
        for f in fields(cls):
            define(f.name, f.default, cls.HELP[f.name])

    @classmethod
    def from_flags(cls, flags):
        """The config of parsed flags (an object with an attribute a flag)."""
        return cls(**{f.name: getattr(flags, f.name) for f in fields(cls)})

    def make_sync(self, world):
        """The strategy for ``--sync`` (sgd: :class:`BucketedAllreduce` over
        ``--comm``, with the sufficient-factor plug-in unless ``--sfb=off``
        and the low-rank one with ``--compress=powersgd``;
        easgd: :class:`ElasticAveraging`, which sends no gradients and keeps
        equal shares); with the batch shares of ``--balance``."""
        if self.sync == "easgd":
            return ElasticAveraging(world, self.tau, self.alpha)
        balancer = None if self.balance == "off" else ShareBalancer(self.balance)
        return BucketedAllreduce(world, self.comm, self.bucket_mb, min(self.bucket_mb, DEFAULT_FIRST_BUCKET_MB),
                                 comm_dtype=self.comm_dtype, plugins=self.make_plugins(), link_gbps=self.link_gbps,
                                 gemm_gflops=self.gemm_gflops, balancer=balancer)

    def make_plugins(self):
        """The reducer's plug-ins: sufficient factors unless ``--sfb=off``,
        then low rank (last: lossy, it must beat the exact ways; without
        ``--compress`` it only advises)."""
        plugins = [] if self.sfb == "off" else [SufficientFactors(self.sfb)]
        mode, rank = parse_compress(self.compress)
        plugins.append(LowRank(rank, self.compress_start_iter, use="auto" if mode == "powersgd" else "advise"))
        return plugins
