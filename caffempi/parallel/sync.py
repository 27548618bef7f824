"""Gradient synchronisation strategies: the solver's seam to data parallelism.

The solver drives one :class:`GradientSync` (as Caffe's Solver drives its
``Solver::Callback``, and DDP a comm hook); the net exposes its flat
gradient buffer and a backward hook; the strategy combines the ranks'
gradients (or weights) through a transport, and the non-gradient
collectives through :class:`~caffempi.parallel.collectives.Collectives`.
Per iteration the solver calls::

    start_iteration(net, iter_size)
    before_pass(net, i, last)      # per forward/backward pass
        with threads.progress(sync.progress):   # called between kernel chunks
            net forward, backward -> on_layer_backward(layer)   # after each layer's backward
    finish(net)                    # the gradients are combined
    ...clip, normalize, regularize, update...
    after_update(net)

``on_start(net)`` once before the first iteration, ``synchronize_model``
before every test pass and snapshot.  The strategy owns progress: its one
:meth:`GradientSync.progress` drives its transport and plug-ins, and
nothing it uses installs anything process-wide.
"""
import time
from abc import ABC, abstractmethod

import numpy as np

from ..backend import threads
from ..common import CaffeError, log
from .buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, bucket_segments, make_buckets
from .collectives import Collectives
from .costs import measure_costs
from .transports import make_compressor, make_transport


class GradientSync(ABC):
    """How the ranks' training steps are combined.  Every rank makes the
    same calls in the same order, so each may be collective.

    A new strategy implements :meth:`attach` and :meth:`finish` and
    overrides whichever of the other hooks it needs (their defaults do
    nothing but keep the weights equal at start).  ``collectives`` is the
    :class:`Collectives` the solver uses for everything that is not
    gradients."""

    def __init__(self, world):
        self.world = world
        self.collectives = Collectives(world)
        self.net = None
        self.iter_size = 1

    @property
    def active(self):
        return self.world.size > 1

    @abstractmethod
    def attach(self, net, iter_size=1):
        """Meet the net whose gradients are combined (once per net; again
        with another net moves the strategy there)."""

    def detach(self):
        """Undo :meth:`attach`."""
        self.net = None

    def on_start(self, net):
        """Once, before the first iteration of the first ``step``, after the
        weights were loaded: every rank takes rank 0's weights."""
        self.collectives.broadcast_arrays([net.param_data])

    def start_iteration(self, net, iter_size=None):
        """Once per iteration, after the diffs were zeroed, before the first
        of the ``iter_size`` forward/backward passes."""
        if iter_size is not None:
            self.iter_size = max(1, int(iter_size))
        if self.net is not net:
            self.attach(net, self.iter_size)

    def before_pass(self, net, index, last):
        """Before forward/backward pass ``index``; ``last`` is True for the
        iteration's final pass."""

    def on_layer_backward(self, layer_index):
        """The net's backward hook: layer ``layer_index``'s backward has run."""

    def progress(self):
        """Let pending communication progress; True when none is pending.
        The solver calls it between the chunks of backward's kernels
        (``threads.progress``), as MPI moves a message only when called."""
        return True

    @abstractmethod
    def finish(self, net):
        """After the last pass: returns once ``net.param_diff`` holds what
        the update should apply (the mean over ranks of the summed, not yet
        iter_size-normalised gradients, for gradient averaging).  Returns the
        seconds it waited."""

    def after_update(self, net):
        """After each weight update (Solver.step calls it)."""

    def synchronize_model(self, net, history):
        """Before every test pass and snapshot: make every rank's weights and
        solver history (a list of flat buffers) the one model the job tests
        and saves."""

    def state(self):
        """This rank's state that a resumed run needs to go on with the same
        bits (picklable, arrays as NumPy), or None; snapshots save it."""
        return None

    def load_state(self, state):
        """Take a :meth:`state` this rank saved (after :meth:`attach`)."""

    def close(self):
        """Release transports and hooks (collective)."""
        self.detach()


class ReducerPlugin(ABC):
    """A way to combine some learnable params other than the buckets' sum
    (sufficient factors, low rank).

    The reducer calls, on every rank in the same order: :meth:`offer` (what
    the plug-in could combine, at what cost), then :meth:`attach` with the
    params its plan gave the plug-in (the buckets leave them out),
    :meth:`start_iteration`, :meth:`on_layer_backward` after each layer's
    backward of the pass that combines, :meth:`progress` between layers and
    kernel chunks, :meth:`finish` after backward, and :meth:`detach` /
    :meth:`close`."""

    #: the plan's name for this way, in its start-up lines
    name = "plug-in"
    #: True where what it applies is not the exact mean: the plan gives it a
    #: param only where it beats every exact way by more than LOSSY_MARGIN
    lossy = False
    #: True: the plan says where it would win (one line naming ``flag``)
    #: and gives it nothing
    advise_only = False
    flag = None

    @abstractmethod
    def offer(self, world, net, iter_size, costs, compressor):
        """{learnable param index: estimated seconds a step to combine it
        this way} (``costs``: :class:`~caffempi.parallel.costs.Costs`;
        ``compressor``: --comm_dtype's, or None), -inf where the plug-in
        was told to take every param it can; logs (rank 0) why it cannot
        take the others."""

    @abstractmethod
    def attach(self, world, net, iter_size, compressor, params):
        """Meet the net and combine ``params`` (the plan's share of this
        plug-in, maybe none; collective)."""

    def start_iteration(self):
        """Before the iteration's passes."""

    def on_layer_backward(self, layer_index):
        """Layer ``layer_index``'s backward has run (in the combining pass)."""

    def progress(self):
        """Let pending work progress; True when none is pending."""
        return True

    @abstractmethod
    def finish(self, net, scale, progress):
        """After backward: the claimed params' diffs := ``scale`` times their
        sum over the ranks.  ``progress`` is the reducer's, to call while
        waiting (the buckets progress meanwhile)."""

    def detach(self):
        """Undo :meth:`attach` (the net's layers as they were)."""

    def state(self):
        """This rank's state for a snapshot (GradientSync.state), or None."""
        return None

    def load_state(self, state):
        """Take a :meth:`state` this rank saved."""

    def close(self):
        """Release what :meth:`attach` took (collective)."""


class BucketedAllreduce(GradientSync):
    """Gradient averaging: the gradients of whole layers, in buckets
    (:mod:`caffempi.parallel.buckets`), summed over the ranks through a
    transport as backward finishes each bucket (wait-free backprop), or in
    one sum after backward where the transport cannot overlap; the params
    that a plug-in claims are combined by the plug-in instead.

    The sums are means: each is started with the scale 1/N, which the
    transport folds into a copy it makes anyway or applies once after the
    sum (as Caffe's NCCL scales after the sum), so backward computes each
    rank's own gradient, as one process would.

    The plan: at attach, each param goes the way the cost model
    (:mod:`~caffempi.parallel.costs`, rates measured then or given as
    ``link_gbps``, ``gemm_gflops``) finds cheapest, the buckets unless a
    plug-in's offer beats them (a lossy plug-in's by more than
    LOSSY_MARGIN, as what it saves must pay for what it changes); rank 0's
    plan, one line a param with a choice, is every rank's.

    ``balancer``, a :class:`~caffempi.parallel.balance.ShareBalancer` or
    None, splits each iteration's global batch over the ranks by their
    measured speed; the sums need nothing else (each rank's gradient comes
    weighted by its share), but the factors' gathers read the shares."""

    #: the share of the best exact way's time a lossy way must save
    LOSSY_MARGIN = 0.1

    def __init__(self, world, comm="overlap", bucket_mb=DEFAULT_BUCKET_MB,
                 first_bucket_mb=DEFAULT_FIRST_BUCKET_MB, transport=None, comm_dtype="fp32", plugins=(),
                 link_gbps=0.0, gemm_gflops=0.0, balancer=None):
        super().__init__(world)
        self.balancer = balancer
        self.link_gbps, self.gemm_gflops = float(link_gbps), float(gemm_gflops)
        self.comm = comm
        self.compressor = make_compressor(comm_dtype)
        self.comm_dtype = comm_dtype
        self.bucket_mb = bucket_mb
        self.first_bucket_mb = first_bucket_mb
        self.transport = transport       # made in attach(), for the net's buffers
        self.plugins = list(plugins)
        self.buckets = []
        self._claimed = ()               # learnable params the plug-ins combine
        self._segments = []              # per bucket, the ranges summed
        self._ready = {}                 # bucket index by the layer that completes it
        self._hooked = False
        self._handles = []
        self._pass = 0
        self._armed = False
        self._explicit = False

    @property
    def scale(self):
        """What the sums are multiplied by: 1/N, for the mean."""
        return 1.0 / self.world.size

    def attach(self, net, iter_size=1):
        """Bucket the net's gradients and hook its backward."""
        if self.net is net:
            self.iter_size = iter_size
            return
        if self.net is not None:
            self.detach()
        self.net = net
        self.iter_size = max(1, int(iter_size))
        self._top_layer = len(net.layers) - 1
        if not self.active:
            return
        if self.balancer is not None:
            self.balancer.attach(self.world, net)
        shares = self._plan(net)
        for plugin, params in zip(self.plugins, shares):
            plugin.attach(self.world, net, self.iter_size, self.compressor, params)
        self._claimed = tuple(sorted(p for params in shares for p in params))
        if self.transport is None:
            with self.world.watch("the gradient transport's set-up"):
                self.transport = make_transport(self.world, self.comm, net.xp, net.param_diff.nbytes,
                                                self.comm_dtype)
        if not isinstance(net.param_diff, np.ndarray) and not self.transport.device_buffers:
            raise CaffeError("the %s transport needs host (NumPy) gradient buffers" % self.transport.name)
        if self.transport.overlaps_backward:
            self.buckets = make_buckets(net, self.bucket_mb, self.first_bucket_mb, self._claimed)
            self._ready = {b[0]: k for k, b in enumerate(self.buckets)}
        else:       # one bucket, started by finish
            self.buckets = [(0, 0, net.param_diff.size, sorted(set(net.param_layer_index)))]
        if self.transport.overlaps_backward or self.plugins:     # plug-ins read what backward left
            net.add_backward_hook(self.on_layer_backward)
            self._hooked = True
        self._segments = [bucket_segments(net, b, self._claimed) for b in self.buckets]
        mb = [sum(e - s for s, e in segs) * net.param_diff.itemsize / 2 ** 20 for segs in self._segments]
        self._names = ["gradient bucket %d of %d (%.2f MB, %s)" % (k + 1, len(mb), m, self.transport.name)
                       for k, m in enumerate(mb)]
        desc = ("%d bucket(s) of %s MB" % (len(mb), ", ".join("%.2f" % m for m in mb))
                if self.transport.overlaps_backward else "one blocking allreduce of %.2f MB" % mb[0])
        if self.collectives.is_root:
            log.info("Data parallel over %d ranks (%s): %s", self.world.size, self.transport.name, desc)

    def _plan(self, net):
        """Each plug-in's params (a list a plug-in), by the cost model;
        logs the choices on rank 0 (collective)."""
        if not self.plugins:
            return []
        costs = measure_costs(self.world, self.link_gbps, self.gemm_gflops)
        offers = [plugin.offer(self.world, net, self.iter_size, costs, self.compressor) for plugin in self.plugins]
        wire = 4 if self.compressor is None else self.compressor.wire_dtype.itemsize
        shares = [[] for _ in self.plugins]
        lines, advice = [], {}        # advice: plug-in index -> [(param name, seconds saved)]
        for p, blob in enumerate(net.learnable_params):
            ways = [(k, offer[p]) for k, offer in enumerate(offers) if p in offer]
            if not ways:
                continue
            exact = best = costs.allreduce_seconds(blob.count * wire)
            chosen = None
            for k, seconds in ways:
                plugin = self.plugins[k]
                wins = seconds < (best * (1 - self.LOSSY_MARGIN) if plugin.lossy else best)
                if wins and plugin.advise_only:
                    advice.setdefault(k, []).append((net.param_owner_names[p], best - seconds))
                elif wins:
                    best, chosen = seconds, k
            if chosen is not None:
                shares[chosen].append(p)
            lines.append("Plan: %s (%s): allreduce %s, %s: %s" % (
                net.param_owner_names[p], "x".join(map(str, blob.shape)), _ms(exact),
                ", ".join("%s %s" % (self.plugins[k].name, _ms(s)) for k, s in ways),
                "allreduce" if chosen is None else self.plugins[chosen].name))
        shares = self.world.bcast(shares, 0, "rank 0's plan of the gradients")
        if self.collectives.is_root:
            for line in lines:
                log.info(line)
            for k, saved in advice.items():
                log.info("Plan: %s would save an estimated %s a step on %s; %s asks for it%s",
                         self.plugins[k].name, _ms(sum(s for _, s in saved)), ", ".join(n for n, _ in saved),
                         self.plugins[k].flag, " (lossy)" if self.plugins[k].lossy else "")
        return shares

    def detach(self):
        if self.net is not None and self._hooked:
            self.net.remove_backward_hook(self.on_layer_backward)
        for plugin in self.plugins:
            plugin.detach()
        if self.balancer is not None:
            self.balancer.detach()
        self._hooked = False
        self.net = None
        self.buckets = []
        self._claimed = ()
        self._ready = {}

    def _stateful(self):
        """(name, part) of the parts with a state: the plug-ins, the balancer."""
        parts = [(plugin.name, plugin) for plugin in self.plugins]
        return parts + ([("batch shares", self.balancer)] if self.balancer is not None else [])

    def state(self):
        """The plug-ins' and the balancer's states by name, or None when
        none has any."""
        states = {name: part.state() for name, part in self._stateful()}
        states = {name: st for name, st in states.items() if st is not None}
        return states or None

    def load_state(self, state):
        for name, part in self._stateful():
            if name in state:
                part.load_state(state[name])

    def close(self):
        self.detach()
        for plugin in self.plugins:
            plugin.close()
        if self.transport is not None:
            self.transport.close()

    def start_iteration(self, net, iter_size=None):
        super().start_iteration(net, iter_size)
        self._pass = 0
        self._explicit = False
        self._armed = self.iter_size == 1
        self._handles = []
        for plugin in self.plugins:
            plugin.start_iteration()
        if self.balancer is not None:
            self.balancer.before_iteration(self.iter_size)

    def before_pass(self, net, index, last):
        """Only the iteration's last backward starts the sums."""
        self._explicit = True
        self._armed = bool(last)

    def on_layer_backward(self, layer_index):
        if layer_index == self._top_layer and not self._explicit:
            self._pass += 1                      # first hook of a backward pass
            self._armed = self._pass >= self.iter_size
        if not self._armed:
            return
        for plugin in self.plugins:
            plugin.on_layer_backward(layer_index)
        k = self._ready.get(layer_index)
        if k is None:
            self.progress()
            return
        self._start(k)

    def progress(self):
        """The transport's poll, then each plug-in's; True when nothing is
        pending."""
        if not self.active:
            return True
        done = self.transport.poll()
        for plugin in self.plugins:
            done = plugin.progress() and done
        return done

    def _start(self, k):
        with self.world.watch(self._names[k]):
            self._handles.append([self.transport.allreduce_start(self.net.param_diff[s:e], self.scale)
                                  for s, e in self._segments[k]])

    def finish(self, net):
        """Wait for the sums (means); returns the exposed seconds."""
        if self.balancer is not None:
            self.balancer.after_backward()
        t0 = time.perf_counter()
        if self.active:
            # the plug-ins' work (the factor GEMMs) runs while the buckets
            # progress between its kernel chunks
            with threads.progress(self.progress):
                for plugin in self.plugins:
                    plugin.finish(net, self.scale, self.progress)
            self.transport.backward_end()
            # buckets backward did not start (a transport that does not
            # overlap, fewer passes than iter_size said, an unhooked
            # backward): started now, in bucket order
            for k in range(len(self._handles), len(self.buckets)):
                self._start(k)
            for k, handles in enumerate(self._handles):
                for h in handles:
                    with self.world.watch(self._names[k], lambda h=h: self.transport.missing_ranks(h)):
                        self.transport.wait(h)
        self._handles = []
        self._armed = False
        return time.perf_counter() - t0

    def after_update(self, net):
        if self.balancer is not None:
            self.balancer.after_update()


def _ms(seconds):
    """An estimate in the plan's lines: milliseconds, or 'forced' (-inf)."""
    return "forced" if seconds == float("-inf") else "%.3g ms" % (1e3 * seconds)
