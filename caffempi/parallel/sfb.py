"""Sufficient-factor broadcast (Poseidon's SFB; ``--sfb=auto|on|off``).

A fully connected layer's weight gradient over a batch is a sum of outer
products, dW = dy^T x (dy: M x N, the top's diff; x: M x K, the bottom's
data).  Summed over P ranks it is the same product over the P*M rows of
every rank's factors.  So instead of summing the N x K gradient over the
ranks, each rank all-gathers the factors (P*M*(N+K) numbers) and forms the
whole gradient with one GEMM: for CaffeNet's fc6 at 8 images a rank, 0.4 MB
a rank instead of 151 MB.  The bias and every other layer stay on the
bucketed allreduce.

Which layers use it is decided once, at start-up, by the reducer's plan
(:mod:`~caffempi.parallel.costs`): the time to sum the gradient (ring
allreduce: 2(P-1)/P of its bytes over the link) against the time to gather
the factors ((P-1)/P of P*M*(N+K)*4 bytes, two messages) plus the extra
GEMM (the (P-1)*M rows of the other ranks), :func:`factor_seconds`.
A layer falls back to the allreduce, with its reason in the log, when its
weight is shared with another layer (its gradient has several parts),
under ``iter_size`` > 1 (the factors of each sub-batch would have to be
kept), and on GPU nets.

:class:`SufficientFactors` is a plug-in of the reducer
(:class:`~caffempi.parallel.sync.ReducerPlugin`): it offers the eligible
weights, takes those the plan gives it, reads each layer's factors in the backward hook (the layer says
what they are through ``Layer.weight_factors``), gathers them while
backward goes on, and forms the mean gradients in ``finish``.  Under uneven
batch shares (``net.batch_shares``) the ranks' row counts differ with their
shares, and the gathers are ``MPI_Iallgatherv``.
"""
import time

import numpy as np

from ..backend import kernels
from ..common import CaffeError, log
from .sync import ReducerPlugin
from .transports.base import yield_core

SFB_MODES = ("auto", "on", "off")
_ITEM = 4          # float32 bytes


def factor_seconds(costs, m, n, k, itemsize=_ITEM):
    """The estimated seconds of a layer's factors, M rows of N + K numbers a
    rank (``costs``: :class:`~caffempi.parallel.costs.Costs`): their two
    all-gathers plus the GEMM over the other ranks' (P-1)*M rows."""
    return (costs.gather_seconds(m * (n + k) * itemsize, messages=2)
            + costs.gemm_seconds(2.0 * (costs.ranks - 1) * m * n * k))


def factor_shape(layer):
    """(M, N, K) of a layer whose weight gradient is a sum of M outer
    products of N- and K-vectors (``Layer.weight_factors``), else None."""
    factors = layer.weight_factors()
    if factors is None:
        return None
    rows, transposed = factors
    n, k = layer.blobs[0].shape[::-1] if transposed else layer.blobs[0].shape
    return rows, n, k


def measure_weight_grad_seconds(rows, num_output, num_input, accumulate=False, repeats=3):
    """Seconds of a fully connected layer's weight gradient from ``rows``
    factor rows, as this process forms it (kernels.matmul_into: written into
    the gradient, or added to it as the layer's backward does), the fastest
    of ``repeats``: for a batch of a few rows it is bound by writing the
    num_output x num_input result, not by its FLOPs."""
    dy = np.ones((rows, num_output), np.float32)
    x = np.ones((rows, num_input), np.float32)
    grad = np.zeros((num_output, num_input), np.float32)
    best = float("inf")
    for _ in range(repeats + 1):                       # the first warms up
        t = time.perf_counter()
        kernels.matmul_into(np, dy.T, x, grad, accumulate)
        best = min(best, time.perf_counter() - t)
    return best


class SufficientFactors(ReducerPlugin):
    """The weights of the chosen fully connected layers formed from every
    rank's sufficient factors.  ``mode``: auto (the reducer's plan chooses
    by :func:`factor_seconds`), on (every eligible layer), off (none)."""
    name = "sufficient factors"

    def __init__(self, mode="auto"):
        if mode not in SFB_MODES:
            raise CaffeError("unknown --sfb '%s' (auto, on or off)" % mode)
        self.mode = mode
        self.world = None
        self._eligible = []            # (layer index, layer, param index, (M, N, K)) from offer
        self.net = None
        self.compressor = None
        self.factor_layers = []        # (layer index, layer, param index of its weight)
        self._factor_at = {}           # layer index -> layer, of factor_layers
        self._comm = None
        self._gathers = {}             # layer index -> (requests, [(shape, recv)] of dy and x)

    # --------------------------------------------------------------- set-up
    def offer(self, world, net, iter_size, costs, compressor):
        self._eligible = [] if self.mode == "off" else self.eligible(world, net, max(1, int(iter_size)))
        itemsize = _ITEM if compressor is None else compressor.wire_dtype.itemsize
        return {p: float("-inf") if self.mode == "on" else factor_seconds(costs, *shape, itemsize=itemsize)
                for _, _, p, shape in self._eligible}

    def attach(self, world, net, iter_size, compressor, params):
        self.world, self.net, self.compressor = world, net, compressor
        self.factor_layers = [(i, layer, p) for i, layer, p, _ in self._eligible if p in params]
        for _, layer, _ in self.factor_layers:
            layer.set_param_propagate_down(0, False)
        net.set_diffs_written(p for _, _, p in self.factor_layers)
        self._factor_at = {i: layer for i, layer, _ in self.factor_layers}
        if self.factor_layers and self._comm is None:
            with world.watch("the factor communicator's set-up"):
                self._comm = world.comm.Dup()

    def detach(self):
        for _, layer, _ in self.factor_layers:
            layer.set_param_propagate_down(0, True)
        if self.factor_layers:
            self.net.set_diffs_written(())
        self.factor_layers = []
        self._factor_at = {}
        self._gathers = {}
        self.net = None

    def close(self):
        self.detach()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def eligible(self, world, net, iter_size):
        """[(layer index, layer, weight's param index, (M, N, K))] of the
        layers that could use factors, logging why the others cannot."""
        self.world = world
        owners = {}
        for layer in net.layers:
            for blob in layer.blobs:
                owners[id(blob)] = owners.get(id(blob), 0) + 1
        param_of = {id(b): p for p, b in enumerate(net.learnable_params)}
        out = []
        for i, layer in enumerate(net.layers):
            shape = factor_shape(layer)
            weight = param_of.get(id(layer.blobs[0])) if shape is not None else None
            if weight is None or not net.layer_need_backward[i]:
                continue
            why = None
            if net.xp is not np:
                why = "GPU nets sum every gradient with the allreduce"
            elif iter_size > 1:
                why = "iter_size %d: the factors of each sub-batch would have to be kept" % iter_size
            elif owners[id(layer.blobs[0])] > 1:
                why = "its weight is shared with another layer"
            if why:
                self._info("Sufficient factors: layer '%s' keeps the allreduce (%s)", net.layer_names[i], why)
                continue
            out.append((i, layer, weight, shape))
        return out

    def _info(self, msg, *args):
        if self.world.rank == 0:
            log.info(msg, *args)

    # ------------------------------------------------------------ iteration
    def start_iteration(self):
        self._gathers = {}

    def on_layer_backward(self, layer_index):
        layer = self._factor_at.get(layer_index)
        if layer is not None:
            self._gather(layer_index, layer)

    def _factors(self, i, layer):
        """(dy, x) of layer i as backward left them (Layer.weight_factors)."""
        rows, _ = layer.weight_factors()
        top, bottom = self.net.top_vecs[i][0], self.net.bottom_vecs[i][0]
        return top.diff.reshape(rows, -1), bottom.data.reshape(rows, -1)

    def _rank_rows(self, rows):
        """Each rank's factor rows, from this rank's ``rows`` and the net's
        batch shares (rows per sample are the same on every rank)."""
        shares = self.net.batch_shares
        if shares is None:
            return [rows] * self.world.size
        per_sample = rows // shares[self.world.rank]
        return [n * per_sample for n in shares]

    def _gather(self, i, layer):
        """Start the all-gathers of a layer's factors (its backward just ran),
        through the compressor where there is one (each factor with its own
        scale inside the message: top diffs have gradients' magnitudes,
        float16 subnormals that would keep few bits)."""
        requests, buffers = [], []
        with self.world.watch("the sufficient factors of layer '%s'" % self.net.layer_names[i]):
            for f in self._factors(i, layer):
                if self.compressor is not None:
                    send = self.compressor.encode(f)
                    as_sent = send.view(self.compressor.wire_view)
                else:
                    send = as_sent = np.ascontiguousarray(f)
                cols, extra = f.shape[1], send.size - f.size      # extra: an encoded message's scale
                counts = [rows * cols + extra for rows in self._rank_rows(f.shape[0])]
                recv = np.empty(sum(counts), send.dtype)
                if len(set(counts)) == 1:
                    requests.append(self._comm.Iallgather(as_sent, recv.view(as_sent.dtype)))
                else:
                    requests.append(self._comm.Iallgatherv(as_sent, [recv.view(as_sent.dtype), counts]))
                buffers.append((cols, extra, counts, recv))
        self._gathers[i] = (requests, buffers)

    def _all_rows(self, cols, extra, counts, recv, dtype, scale):
        """Every rank's rows of one gathered factor of ``cols`` columns (the
        ranks' messages of ``counts`` numbers each, ``extra`` of them not
        values, in rank order), as (all rows) x cols in ``dtype``, times
        ``scale``."""
        if self.compressor is None:
            rows = np.asarray(recv, dtype)
            if scale != 1.0:
                rows = rows * dtype.type(scale)
            return rows.reshape(-1, cols)
        rows = np.empty(sum(counts) - extra * len(counts), dtype)
        start = out = 0
        for n in counts:
            self.compressor.decode(recv[start:start + n], rows[out:out + n - extra], scale)
            start, out = start + n, out + n - extra
        return rows.reshape(-1, cols)

    def progress(self):
        """Test the pending gathers; True when none is pending."""
        pending = [r for requests, _ in self._gathers.values() for r in requests]
        return not pending or self.world.MPI.Request.Testall(pending)

    def finish(self, net, scale, progress):
        """Each layer's mean gradient: one GEMM over every rank's rows, the
        scale folded into dy's rows (a few rows, not the N x K product),
        written over the gradient, which the net does not clear
        (``Net.set_diffs_written``)."""
        for i, layer, p in self.factor_layers:
            if i not in self._gathers:       # a backward the hook did not see
                self._gather(i, layer)
            requests, buffers = self._gathers.pop(i)
            for r in requests:
                with self.world.watch("the sufficient factors of layer '%s'" % net.layer_names[i]):
                    while not r.Test():
                        progress()
                        yield_core()
            (dy_buffers, x_buffers) = buffers
            dy = self._all_rows(*dy_buffers, net.dtype, scale)
            x = self._all_rows(*x_buffers, net.dtype, 1.0)
            grad = layer.blobs[0].diff
            if layer.weight_factors()[1]:
                kernels.matmul_into(net.xp, x.T, dy, grad)
            else:
                kernels.matmul_into(net.xp, dy.T, x, grad)
            progress()
