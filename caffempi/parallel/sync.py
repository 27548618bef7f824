"""Gradient synchronisation strategies: the solver's seam to data parallelism.

The solver drives one :class:`GradientSync` (as Caffe's Solver drives its
``Solver::Callback``, and DDP a comm hook); the net exposes its flat
gradient buffer and a backward hook; the strategy combines the ranks'
gradients (or weights) through a transport, and the non-gradient
collectives through :class:`~caffempi.parallel.collectives.Collectives`.
Per iteration the solver calls::

    start_iteration(net, iter_size)
    before_pass(net, i, last)      # per forward/backward pass
        net backward -> on_layer_backward(layer)   # after each layer's backward
    finish(net)                    # the gradients are combined
    ...clip, normalize, regularize, update...
    after_update(net)

``on_start(net)`` once before the first iteration, ``synchronize_model``
before every test pass and snapshot.
"""
import time
from abc import ABC, abstractmethod

import numpy as np

from ..common import CaffeError, log
from .buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, bucket_segments, make_buckets
from .collectives import Collectives
from .transports import make_transport


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

    def close(self):
        """Release transports and hooks (collective)."""
        self.detach()


class BucketedAllreduce(GradientSync):
    """Gradient averaging: the gradients of whole layers, in buckets
    (:mod:`caffempi.parallel.buckets`), summed over the ranks through a
    transport as backward finishes each bucket (wait-free backprop), or in
    one sum after backward where the transport cannot overlap.

    The sums are already means: ``attach`` sets the net's
    ``gradient_scale`` to 1/N, so backward produces each rank's gradient
    divided by N and no pass over the buffer follows the wait."""

    def __init__(self, world, comm="overlap", bucket_mb=DEFAULT_BUCKET_MB,
                 first_bucket_mb=DEFAULT_FIRST_BUCKET_MB, transport=None, comm_dtype="fp32"):
        super().__init__(world)
        self.comm = comm
        self.comm_dtype = comm_dtype
        self.bucket_mb = bucket_mb
        self.first_bucket_mb = first_bucket_mb
        self.transport = transport       # made in attach(), for the net's buffers
        self.buckets = []
        self.exclude = ()                # learnable params summed by other means (a subclass's)
        self._segments = []              # per bucket, the ranges summed
        self._ready = {}                 # bucket index by the layer that completes it
        self._hooked = False
        self._handles = []
        self._pass = 0
        self._armed = False
        self._explicit = False

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
        net.gradient_scale = 1.0 / self.world.size
        if self.transport is None:
            with self.world.watch("the gradient transport's set-up"):
                self.transport = make_transport(self.world, self.comm, net.xp, net.param_diff.nbytes,
                                                self.comm_dtype)
        if not isinstance(net.param_diff, np.ndarray) and not self.transport.device_buffers:
            raise CaffeError("the %s transport needs host (NumPy) gradient buffers" % self.transport.name)
        if self.transport.overlaps_backward:
            self.buckets = make_buckets(net, self.bucket_mb, self.first_bucket_mb, self.exclude)
            self._ready = {b[0]: k for k, b in enumerate(self.buckets)}
            net.add_backward_hook(self.on_layer_backward)
            self._hooked = True
        else:       # one bucket, started by finish
            self.buckets = [(0, 0, net.param_diff.size, sorted(set(net.param_layer_index)))]
        self._segments = [bucket_segments(net, b, self.exclude) for b in self.buckets]
        mb = [sum(e - s for s, e in segs) * net.param_diff.itemsize / 2 ** 20 for segs in self._segments]
        self._names = ["gradient bucket %d of %d (%.2f MB, %s)" % (k + 1, len(mb), m, self.transport.name)
                       for k, m in enumerate(mb)]
        desc = ("%d bucket(s) of %s MB" % (len(mb), ", ".join("%.2f" % m for m in mb))
                if self.transport.overlaps_backward else "one blocking allreduce of %.2f MB" % mb[0])
        if self.collectives.is_root:
            log.info("Data parallel over %d ranks (%s): %s", self.world.size, self.transport.name, desc)

    def detach(self):
        if self.net is not None:
            self.net.gradient_scale = 1.0
            if self._hooked:
                self.net.remove_backward_hook(self.on_layer_backward)
        self._hooked = False
        self.net = None
        self.buckets = []
        self._ready = {}

    def close(self):
        self.detach()
        if self.transport is not None:
            self.transport.close()

    def start_iteration(self, net, iter_size=None):
        super().start_iteration(net, iter_size)
        self._pass = 0
        self._explicit = False
        self._armed = self.iter_size == 1
        self._handles = []

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
        k = self._ready.get(layer_index)
        if k is None:
            self.transport.poll()
            return
        self._start(k)

    def _start(self, k):
        with self.world.watch(self._names[k]):
            self._handles.append([self.transport.allreduce_start(self.net.param_diff[s:e])
                                  for s, e in self._segments[k]])

    def finish(self, net):
        """Wait for the sums (means: backward ran with the net's
        gradient_scale at 1/N); returns the exposed seconds."""
        t0 = time.perf_counter()
        if self.active:
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

