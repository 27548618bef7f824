"""Sufficient-factor broadcast (Poseidon's SFB; ``--sfb=auto|on|off``).

A fully connected layer's weight gradient over a batch is a sum of outer
products, dW = dy^T x (dy: M x N, the top's diff; x: M x K, the bottom's
data).  Summed over P ranks it is the same product over the P*M rows of
every rank's factors.  So instead of summing the N x K gradient over the
ranks, each rank all-gathers the factors (P*M*(N+K) numbers) and forms the
whole gradient with one GEMM: for CaffeNet's fc6 at 8 images a rank, 0.4 MB
a rank instead of 151 MB.  The bias and every other layer stay on the
bucketed allreduce.

Which layers use it is decided once, at start-up, by a cost model: the time
to sum the gradient (ring allreduce: 2(P-1)/P of its bytes over the link)
against the time to gather the factors ((P-1)/P of P*M*(N+K)*4 bytes, two
messages) plus the extra GEMM (the (P-1)*M rows of the other ranks).  The
link's bandwidth and latency and the GEMM rate are measured then (or given:
``link_gbps``, ``gemm_gflops``), on rank 0, whose choice every rank takes.
A layer falls back to the allreduce, with its reason in the log, when its
weight is shared with another layer (its gradient has several parts),
under ``iter_size`` > 1 (the factors of each sub-batch would have to be
kept), and on GPU nets.
"""
import math
import time

import numpy as np

from ..backend import half, kernels, threads
from ..common import CaffeError, log
from .sync import BucketedAllreduce
from .transports.base import yield_core
from .transports.compressed import bucket_scale

SFB_MODES = ("auto", "on", "off")
_ITEM = 4          # float32 bytes


def factor_plan(layers, ranks, bandwidth, latency, gemm_rate):
    """For each (M, N, K) in ``layers``: (use factors?, allreduce seconds,
    factor seconds) by the cost model above; bandwidth in bytes/s, latency
    in seconds a message, gemm_rate in FLOP/s."""
    out = []
    for m, n, k in layers:
        full = 2.0 * (ranks - 1) / ranks * n * k * _ITEM / bandwidth
        gather = 2 * latency + (ranks - 1) * m * (n + k) * _ITEM / bandwidth
        extra_gemm = 2.0 * (ranks - 1) * m * n * k / gemm_rate
        out.append((gather + extra_gemm < full, full, gather + extra_gemm))
    return out


def measure_gemm_rate(repeats=1):
    """FLOP/s of this process's float32 GEMM (kernels.matmul, on the
    process's kernel threads) on a product of fc-layer proportions."""
    a = np.ones((256, 2048), np.float32)
    b = np.ones((2048, 1024), np.float32)
    kernels.matmul(np, a, b)
    t = time.perf_counter()
    for _ in range(repeats):
        kernels.matmul(np, a, b)
    return repeats * 2.0 * 256 * 2048 * 1024 / max(time.perf_counter() - t, 1e-9)


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


class SufficientFactorBroadcast(BucketedAllreduce):
    """Gradient averaging with the weights of the chosen fully connected
    layers formed from every rank's sufficient factors (the rest as
    :class:`BucketedAllreduce`).  ``mode``: auto (the cost model chooses),
    on (every eligible layer), off (none)."""

    def __init__(self, world, comm="overlap", bucket_mb=None, first_bucket_mb=None, mode="auto",
                 link_gbps=0.0, gemm_gflops=0.0, transport=None, comm_dtype="fp32"):
        if mode not in SFB_MODES:
            raise CaffeError("unknown --sfb '%s' (auto, on or off)" % mode)
        kwargs = {k: v for k, v in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb))
                  if v is not None}
        super().__init__(world, comm, transport=transport, comm_dtype=comm_dtype, **kwargs)
        self.mode = mode
        self.link_gbps = float(link_gbps)
        self.gemm_gflops = float(gemm_gflops)
        self.factor_layers = []        # (layer index, layer, param index of its weight)
        self._factor_at = {}           # layer index -> layer, of factor_layers
        self._comm = None
        self._gathers = {}             # layer index -> (requests, [(send, recv)] of dy and x)

    # --------------------------------------------------------------- set-up
    def attach(self, net, iter_size=1):
        if self.net is net:
            return super().attach(net, iter_size)
        if self.net is not None:
            self.detach()
        self.factor_layers = []
        if self.active and self.mode != "off":
            self.factor_layers = self._choose(net, max(1, int(iter_size)))
        for _, layer, _ in self.factor_layers:
            layer.weight_grad_from_factors = True
        self.exclude = tuple(p for _, _, p in self.factor_layers)
        self._factor_at = {i: layer for i, layer, _ in self.factor_layers}
        if self.factor_layers and self._comm is None:
            with self.world.watch("the factor communicator's set-up"):
                self._comm = self.world.comm.Dup()
        super().attach(net, iter_size)

    def detach(self):
        for _, layer, _ in self.factor_layers:
            layer.weight_grad_from_factors = False
            layer.factors = None
        self.factor_layers = []
        self._factor_at = {}
        self.exclude = ()
        super().detach()

    def close(self):
        super().close()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def _eligible(self, net, iter_size):
        """[(layer index, layer, weight's param index, (M, N, K))] of the
        layers that could use factors, logging why the others cannot."""
        owners = {}
        for layer in net.layers:
            for blob in layer.blobs:
                owners[id(blob)] = owners.get(id(blob), 0) + 1
        param_of = {id(b): p for p, b in enumerate(net.learnable_params)}
        out = []
        for i, layer in enumerate(net.layers):
            shape = layer.factor_shape()
            if shape is None or not net.layer_need_backward[i] or id(layer.blobs[0]) not in param_of:
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
            out.append((i, layer, param_of[id(layer.blobs[0])], shape))
        return out

    def _choose(self, net, iter_size):
        candidates = self._eligible(net, iter_size)
        if not candidates:
            return []
        if self.mode == "on":
            use = [True] * len(candidates)
            plan = None
        else:
            bandwidth, latency, rate = self._calibrate()
            plan = factor_plan([c[3] for c in candidates], self.world.size, bandwidth, latency, rate)
            # every rank takes rank 0's choice (its measurements decide)
            plan = self.world.bcast(plan, 0, "rank 0's choice of sufficient-factor layers")
            use = [p[0] for p in plan]
        for k, (i, _, _, (m, n, k_)) in enumerate(candidates):
            est = "" if plan is None else ", est. %.3g ms against %.3g ms" % (1e3 * plan[k][2], 1e3 * plan[k][1])
            self._info("Sufficient factors: layer '%s' (%dx%d, %d rows a rank): factors %.3g MB a rank "
                       "against a %.3g MB gradient%s: %s", net.layer_names[i], n, k_, m,
                       m * (n + k_) * _ITEM / 2 ** 20, n * k_ * _ITEM / 2 ** 20, est,
                       "sufficient factors" if use[k] else "allreduce")
        return [(i, layer, p) for (i, layer, p, _), u in zip(candidates, use) if u]

    def _calibrate(self):
        """(bytes/s, seconds a message, FLOP/s): the given link_gbps and
        gemm_gflops, else measured here (allreduces of 8 B and 4 MB, a GEMM)."""
        w = self.world
        latency = bandwidth = None
        if self.link_gbps > 0:
            bandwidth, latency = self.link_gbps * 1e9 / 8, 0.0
        else:
            times = {}
            for nbytes in (8, 4 << 20):
                buf = np.zeros(nbytes // 4, np.float32)
                w.allreduce_sum(buf, "the link's calibration")
                samples = []
                for _ in range(3):
                    w.barrier("the link's calibration")
                    t = time.perf_counter()
                    w.allreduce_sum(buf, "the link's calibration")
                    samples.append(time.perf_counter() - t)
                times[nbytes] = float(np.median(samples))
            latency = times[8]
            span = max(times[4 << 20] - latency, 1e-9)
            bandwidth = 2.0 * (w.size - 1) / w.size * (4 << 20) / span
        if self.gemm_gflops > 0:
            rate = self.gemm_gflops * 1e9
        else:
            rate = measure_gemm_rate()
        self._info("Sufficient factors: link %.3g Gbit/s, %.3g us a message, GEMM %.3g GFLOP/s%s",
                   bandwidth * 8 / 1e9, latency * 1e6, rate / 1e9,
                   "" if self.link_gbps > 0 and self.gemm_gflops > 0 else " (measured)")
        return bandwidth, latency, rate

    def _info(self, msg, *args):
        if self.collectives.is_root:
            log.info(msg, *args)

    # ------------------------------------------------------------ iteration
    def start_iteration(self, net, iter_size=None):
        super().start_iteration(net, iter_size)
        self._gathers = {}

    def on_layer_backward(self, layer_index):
        super().on_layer_backward(layer_index)
        if self._armed:
            layer = self._factor_at.get(layer_index)
            if layer is not None:
                self._gather(layer_index, layer)
            if not self._progress():
                # the gathers progress between the chunks of the next layers'
                # kernels too (MPI moves them only when called): between
                # layers alone, LeNet's 0.3 MB at 1 Gbit/s crossed after
                # backward.  This takes the place of what a polled transport
                # installs there, its poll, which _progress_all calls.
                threads.set_progress(self._progress_all)

    def _progress_all(self):
        self.transport.poll()
        self._progress()

    def _gather(self, i, layer):
        """Start the all-gathers of a layer's factors (its backward just ran).
        With --comm_dtype=fp16 a factor crosses as float16 (as uint16: MPI
        has no float16 type), scaled by this rank's power of two, whose
        exponent rides as one more float16 value: top diffs have gradients'
        magnitudes, float16 subnormals that would keep few bits."""
        requests, buffers = [], []
        with self.world.watch("the sufficient factors of layer '%s'" % self.net.layer_names[i]):
            for f in layer.factors:
                if self.comm_dtype == "fp16":
                    f = np.asarray(f)
                    scale = bucket_scale(float(np.abs(f).max()) if f.size else 0.0, 1)
                    send = np.empty(f.size + 1, np.float16)
                    half.to_half(f, scale, send[:-1])
                    send[-1] = math.log2(scale)
                    as_sent = send.view(np.uint16)
                else:
                    send = as_sent = np.ascontiguousarray(f)
                recv = np.empty((self.world.size,) + send.shape, send.dtype)
                requests.append(self._comm.Iallgather(as_sent, recv.view(as_sent.dtype)))
                buffers.append((np.shape(f), recv))
        layer.factors = None
        self._gathers[i] = (requests, buffers)

    def _all_rows(self, shape, recv, dtype):
        """Every rank's rows of one gathered factor of ``shape`` (M x ...), as
        (ranks * M) x rest in ``dtype``, unscaled where it came as float16."""
        if self.comm_dtype == "fp16":
            rows = np.empty((len(recv), recv.shape[1] - 1), dtype)
            for row, sent in zip(rows, recv):
                half.from_half(sent[:-1], 2.0 ** -float(sent[-1]), row)
            recv = rows
        return np.asarray(recv, dtype).reshape(self.world.size * shape[0], -1)

    def _progress(self):
        """Test the pending gathers; True when none is pending."""
        pending = [r for requests, _ in self._gathers.values() for r in requests]
        return not pending or self.world.MPI.Request.Testall(pending)

    def finish(self, net):
        t0 = time.perf_counter()
        if self.active:
            for i, layer, p in self.factor_layers:
                if i not in self._gathers:       # backward was not hooked (blocking)
                    self._gather(i, layer)
            for i, layer, p in self.factor_layers:
                requests, buffers = self._gathers.pop(i)
                for r in requests:
                    with self.world.watch("the sufficient factors of layer '%s'" % net.layer_names[i]):
                        while not r.Test():
                            self.transport.poll()
                            yield_core()
                dy, x = (self._all_rows(shape, recv, net.dtype) for shape, recv in buffers)
                grad = layer.blobs[0].diff
                if layer.factor_transposed:
                    kernels.matmul_into(net.xp, x.T, dy, grad)
                else:
                    kernels.matmul_into(net.xp, dy.T, x, grad)
                self.transport.poll()
        waited = (time.perf_counter() - t0) + super().finish(net)
        threads.set_progress(None)      # _progress_all, where no transport's backward_end took it out
        return waited
