"""Low-rank gradient compression with error feedback
(``--compress=powersgd[:RANK]``; Vogels, Karimireddy and Jaggi, "PowerSGD",
NeurIPS 2019; PyTorch DDP's powerSGD_hook).

For a chosen parameter, its gradient as a matrix M (rows: the first axis,
O outputs of a convolution or N of a fully connected layer; columns: the
rest, C*kh*kw or K), with this rank's error from the last step E, r the
rank:

    M' = M + E
    P = M' Q                 summed over the ranks (O x r numbers)
    P = orthonormalise(P)
    Q = M'^T P               summed over the ranks (K x r), times 1/N: the mean
    gradient = P Q^T         E = M' - P Q^T   (kept for the next step)

r(O + K) numbers cross instead of O*K (CaffeNet's conv3 at rank 4: 10,752
against 884,736).  Q starts as the same random matrix on every rank and is
then warm-started from the last step's (every rank holds the same, the
summed one).  Error feedback makes what is applied over k steps the sum of
the true mean gradients less the ranks' mean last error, so nothing is
lost, only delayed.  The first ``start_iter`` steps sum the gradient
exactly (Vogels et al. start compressing after a warm-up).

:class:`LowRank` is a plug-in of the reducer
(:class:`~caffempi.parallel.sync.ReducerPlugin`).  It offers every weight of
two or more axes at :func:`lowrank_seconds` (the two sums' bytes and
latencies, the three products, the passes over M' and E); the reducer's
plan gives it those where that beats the exact ways by more than its
margin.  It starts a param's P sum as soon as the backward of the layer
that owns it has run and the Q sum as soon as P's is in, through
transports of its own (``make_chained_transport``: float32 Iallreduces, or
the compressor's exchange under ``--comm_dtype=fp16``; polled), in the
same order on every rank, and forms the
gradients in ``finish``.  Q, E and the step count are the plug-in's state
(:meth:`LowRank.state`), saved in snapshots so that a resumed run goes on
with the same bits.  CPU nets; shared weights are summed at their owner's
backward as the buckets are.
"""
import numpy as np

from ..backend import kernels
from ..common import CaffeError, log
from .sync import ReducerPlugin
from .transports import make_chained_transport
from .transports.base import scale_in_place, yield_core

COMPRESS_MODES = ("none", "powersgd")
DEFAULT_RANK = 4
#: how LowRank takes params: by the plan's costs, every one it can, or none
#: (the plan only says where it would win)
USES = ("auto", "all", "advise")


def parse_compress(value):
    """(mode, rank) of a --compress value: none, powersgd or powersgd:RANK."""
    mode, _, rank = str(value).partition(":")
    if mode not in COMPRESS_MODES or (rank and (mode == "none" or not rank.isdigit() or int(rank) < 1)):
        raise CaffeError("unknown --compress '%s' (none, powersgd or powersgd:RANK with RANK >= 1)" % value)
    return mode, int(rank) if rank else DEFAULT_RANK


def lowrank_seconds(costs, rows, cols, rank, itemsize=4):
    """The estimated seconds a step of a rows x cols gradient at ``rank``
    (``costs``: :class:`~caffempi.parallel.costs.Costs`): the P and Q sums
    (a latency each, r(rows + cols) numbers in all), the three products
    (2 rows cols r FLOPs each) and the orthonormalisation, and ten bytes
    touched a value of M (M' = M + E and E -= P Q^T, three each; the two
    reads of M' by the products; the write of P Q^T)."""
    rank = min(rank, rows, cols)
    return (2 * costs.latency + costs.allreduce_seconds(rank * (rows + cols) * itemsize)
            + costs.gemm_seconds(6.0 * rows * cols * rank + 4.0 * rows * rank * rank)
            + costs.pass_seconds(10.0 * rows * cols * 4))


def orthonormalise(p):
    """The columns of ``p`` (rows x r, r <= rows) replaced in place by an
    orthonormal basis of their span, in column order: Householder QR in
    float64 (Gram-Schmidt in float32 lost orthogonality on ill-conditioned
    sums, and the low-rank gradient with it); the same bits on every rank
    whose LAPACK is the same, as the factor GEMMs of --sfb assume."""
    q, _ = np.linalg.qr(p.astype(np.float64))
    p[...] = q
    return p


class _Matrix:
    """One compressed parameter's state."""

    def __init__(self, param, name, blob, rank, rng):
        self.param, self.name, self.blob = param, name, blob
        self.rows = blob.shape[0]
        self.cols = blob.count // self.rows
        self.rank = min(rank, self.rows, self.cols)
        self.q = rng.standard_normal((self.cols, self.rank)).astype(blob.diff.dtype)
        self.error = np.zeros((self.rows, self.cols), blob.diff.dtype)
        self.p = None
        self.stage = None           # "exact", "p" or "q" while its sums are in flight
        self.handle = None

    @property
    def gradient(self):
        return self.blob.diff.reshape(self.rows, self.cols)


class LowRank(ReducerPlugin):
    """PowerSGD at rank ``rank`` on the weights the plan gives it (``use``:
    auto, by the costs; all, every weight of two or more axes; advise, none,
    the plan saying where it would win); exact sums for the first
    ``start_iter`` steps; Q's first draw from ``seed`` (the same on every
    rank)."""
    name = "low rank"
    lossy = True
    flag = "--compress=powersgd"

    def __init__(self, rank=DEFAULT_RANK, start_iter=0, seed=0, use="auto"):
        if use not in USES:
            raise CaffeError("LowRank: use must be one of %s, got '%s'" % (", ".join(USES), use))
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.seed = int(seed)
        self.use = use
        self.advise_only = use == "advise"
        self.world = None
        self.matrices = []
        self._ready = {}             # layer index -> its matrices
        self._sums = None            # (P's transport, Q's)
        self._pending = []           # matrices with sums in flight, in start order
        self.steps = 0               # steps combined so far

    # --------------------------------------------------------------- set-up
    def offer(self, world, net, iter_size, costs, compressor):
        self.world = world
        if world.size == 1:
            return {}
        if net.xp is not np:
            if not self.advise_only:
                self._info("Low rank: GPU nets sum every gradient with the allreduce")
            return {}
        itemsize = 4 if compressor is None else compressor.wire_dtype.itemsize
        out = {}
        for p, blob in enumerate(net.learnable_params):
            if len(blob.shape) >= 2:
                rows = blob.shape[0]
                out[p] = (float("-inf") if self.use == "all"
                          else lowrank_seconds(costs, rows, blob.count // rows, self.rank, itemsize))
        return out

    def attach(self, world, net, iter_size, compressor, params):
        self.world = world
        self.matrices, self._ready = [], {}
        rng = np.random.RandomState(self.seed)
        for p in sorted(params):
            m = _Matrix(p, net.param_owner_names[p], net.learnable_params[p], self.rank, rng)
            self.matrices.append(m)
            self._ready.setdefault(net.param_layer_index[p], []).append(m)
            self._info("Low rank: %s (%dx%d) at rank %d: %d numbers a step instead of %d (%.1f%%)",
                       m.name, m.rows, m.cols, m.rank, m.rank * (m.rows + m.cols), m.rows * m.cols,
                       100.0 * m.rank * (m.rows + m.cols) / (m.rows * m.cols))
        if self.matrices and self._sums is None:
            with world.watch("the low-rank transports' set-up"):
                self._sums = (make_chained_transport(world, compressor), make_chained_transport(world, compressor))

    def detach(self):
        self._pending = []

    def close(self):
        if self._sums is not None:
            for transport in self._sums:
                transport.close()
            self._sums = None

    def _info(self, msg, *args):
        if self.world.rank == 0:
            log.info(msg, *args)

    # ---------------------------------------------------------------- state
    def state(self):
        """None with no matrix, else this rank's arrays and the step count:
        {"steps": n, "arrays": {"<param>/q": Q, "<param>/error": E}}."""
        if not self.matrices:
            return None
        arrays = {}
        for m in self.matrices:
            arrays[m.name + "/q"] = m.q
            arrays[m.name + "/error"] = m.error
        return {"steps": self.steps, "arrays": arrays}

    def load_state(self, state):
        """Take a :meth:`state` (this rank's, from a snapshot of as many
        ranks); a CaffeError names an array that does not fit."""
        arrays = state.get("arrays", {})
        for m in self.matrices:
            for key, mine in ((m.name + "/q", m.q), (m.name + "/error", m.error)):
                if key not in arrays:
                    raise CaffeError("the snapshot has no low-rank array '%s' (was it written with the same "
                                     "--compress and net?)" % key)
                saved = np.asarray(arrays[key])
                if saved.size != mine.size:
                    raise CaffeError("low-rank array '%s' has %d values in the snapshot, this run's has %d "
                                     "(another --compress rank?)" % (key, saved.size, mine.size))
                mine[...] = saved.reshape(mine.shape)
        self.steps = int(state.get("steps", 0))

    # ------------------------------------------------------------ iteration
    def start_iteration(self):
        self._pending = []

    def on_layer_backward(self, layer_index):
        for m in self._ready.get(layer_index, ()):
            self._start(m)

    def _start(self, m):
        if self.steps < self.start_iter:
            m.stage = "exact"
            buf = m.gradient
        else:
            m.error += m.gradient                       # M' = M + E, kept in the error's buffer
            m.p = kernels.matmul(np, m.error, m.q)
            m.stage = "p"
            buf = m.p
        m.handle = self._sums[0].allreduce_start(buf)
        self._pending.append(m)

    def progress(self):
        """Move the sums in flight; a P that is in starts its Q, in start
        order (a Q is started only after every earlier matrix's)."""
        for transport in self._sums or ():
            transport.poll()
        in_order = True
        done = True
        for m in self._pending:
            if m.stage == "p" and in_order and m.handle.done.is_set():
                orthonormalise(m.p)
                m.q = kernels.matmul(np, m.error.T, m.p)
                m.handle = self._sums[1].allreduce_start(m.q)
                m.stage = "q"
            in_order = in_order and m.stage != "p"
            done = done and m.handle.done.is_set()
        return done and in_order

    def finish(self, net, scale, progress):
        """The claimed gradients: P Q^T (Q's mean), or the exact mean in the
        first ``start_iter`` steps; the errors keep what was left out."""
        for m in self.matrices:
            if m.stage is None:              # a backward the hook did not see
                self._start(m)
        with self.world.watch("the low-rank sums"):
            while not self.progress():
                progress()
                yield_core()
        for m in self.matrices:
            if m.stage == "exact":
                scale_in_place(m.gradient, scale)
            else:
                scale_in_place(m.q, scale)
                kernels.matmul_into(np, m.p, m.q.T, m.gradient)
                m.error -= m.gradient
            m.stage = m.handle = None
        self._pending = []
        self.steps += 1
