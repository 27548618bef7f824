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
(:class:`~caffempi.parallel.sync.ReducerPlugin`): it claims the parameters
where r(O + K) is at most half of O*K (and no earlier plug-in took them),
starts a parameter's P sum as soon as the backward of the layer that owns
it has run, and the Q sum as soon as P's is in (both non-blocking, on
communicators of their own, in the same order on every rank), between
layers and kernel chunks (``progress``), and forms the gradients in
``finish``.  CPU nets; shared weights are summed at their owner's
backward as the buckets are.
"""
import numpy as np

from ..backend import kernels
from ..common import CaffeError, log
from .sync import ReducerPlugin
from .transports.base import scale_in_place, yield_core

COMPRESS_MODES = ("none", "powersgd")
DEFAULT_RANK = 4
#: low rank is used where it sends at most this share of the gradient's numbers
MAX_SHARE = 0.5


def parse_compress(value):
    """(mode, rank) of a --compress value: none, powersgd or powersgd:RANK."""
    mode, _, rank = str(value).partition(":")
    if mode not in COMPRESS_MODES or (rank and (mode == "none" or not rank.isdigit() or int(rank) < 1)):
        raise CaffeError("unknown --compress '%s' (none, powersgd or powersgd:RANK with RANK >= 1)" % value)
    return mode, int(rank) if rank else DEFAULT_RANK


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

    def __init__(self, param, blob, rank, rng):
        self.param, self.blob = param, blob
        self.rows = blob.shape[0]
        self.cols = blob.count // self.rows
        self.q = rng.standard_normal((self.cols, rank)).astype(blob.diff.dtype)
        self.error = np.zeros((self.rows, self.cols), blob.diff.dtype)
        self.p = None
        self.stage = None           # "exact", "p" or "q" while its sums are in flight
        self.request = None

    @property
    def gradient(self):
        return self.blob.diff.reshape(self.rows, self.cols)


class LowRank(ReducerPlugin):
    """PowerSGD on the weights where rank ``rank`` sends at most
    ``max_share`` of the gradient's numbers; exact sums for the first
    ``start_iter`` steps; Q's first draw from ``seed`` (the same on every
    rank)."""

    def __init__(self, rank=DEFAULT_RANK, start_iter=0, seed=0, max_share=MAX_SHARE):
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.seed = int(seed)
        self.max_share = float(max_share)
        self.world = None
        self.matrices = []
        self._ready = {}             # layer index -> its matrices
        self._comms = None           # (P's communicator, Q's)
        self._pending = []           # matrices with sums in flight, in start order
        self.steps = 0               # steps combined so far

    # --------------------------------------------------------------- set-up
    def attach(self, world, net, iter_size, compressor, taken=()):
        self.world = world
        self.matrices, self._ready = [], {}
        if world.size == 1:
            return []
        if net.xp is not np:
            self._info("Low rank: GPU nets sum every gradient with the allreduce")
            return []
        rng = np.random.RandomState(self.seed)
        for p, blob in enumerate(net.learnable_params):
            if p in taken or len(blob.shape) < 2:
                continue
            rows = blob.shape[0]
            cols = blob.count // rows
            rank = min(self.rank, rows, cols)
            share = rank * (rows + cols) / float(rows * cols)
            name = net.param_owner_names[p]
            if share > self.max_share:
                self._info("Low rank: %s (%dx%d) keeps the allreduce (rank %d would send %.0f%% of it)",
                           name, rows, cols, rank, 100 * share)
                continue
            m = _Matrix(p, blob, rank, rng)
            self.matrices.append(m)
            self._ready.setdefault(net.param_layer_index[p], []).append(m)
            self._info("Low rank: %s (%dx%d) at rank %d: %d numbers a step instead of %d (%.1f%%)",
                       name, rows, cols, rank, rank * (rows + cols), rows * cols, 100 * share)
        if self.matrices and self._comms is None:
            with world.watch("the low-rank communicators' set-up"):
                self._comms = (world.comm.Dup(), world.comm.Dup())
        return [m.param for m in self.matrices]

    def detach(self):
        self._pending = []

    def close(self):
        if self._comms is not None:
            for comm in self._comms:
                comm.Free()
            self._comms = None

    def _info(self, msg, *args):
        if self.world.rank == 0:
            log.info(msg, *args)

    # ------------------------------------------------------------ iteration
    def start_iteration(self):
        self._pending = []

    def on_layer_backward(self, layer_index):
        for m in self._ready.get(layer_index, ()):
            self._start(m)

    def _start(self, m):
        MPI = self.world.MPI
        if self.steps < self.start_iter:
            m.stage = "exact"
            buf = m.gradient
        else:
            m.error += m.gradient                       # M' = M + E, kept in the error's buffer
            m.p = kernels.matmul(np, m.error, m.q)
            m.stage = "p"
            buf = m.p
        m.request = self._comms[0].Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        self._pending.append(m)

    def progress(self):
        """Test the sums in flight; a P that is in starts its Q, in start
        order (a Q is issued only after every earlier matrix's)."""
        MPI = self.world.MPI
        in_order = True
        done = True
        for m in self._pending:
            if m.stage == "p" and in_order and m.request.Test():
                orthonormalise(m.p)
                m.q = kernels.matmul(np, m.error.T, m.p)
                m.request = self._comms[1].Iallreduce(MPI.IN_PLACE, m.q, op=MPI.SUM)
                m.stage = "q"
            in_order = in_order and m.stage != "p"
            done = done and m.request.Test()
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
            m.stage = m.request = None
        self._pending = []
        self.steps += 1
