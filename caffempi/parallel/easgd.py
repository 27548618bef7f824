"""Elastic averaging SGD over allreduce (``--sync=easgd --tau=10 --alpha=0.2``).

Each rank steps on its own gradients (no gradient averaging); every ``tau``
steps the ranks are pulled toward a centre variable that every rank keeps a
copy of, kept identical by one allreduce.  This is Torch DistLearn's
AllReduceEA (twitter/torch-distlearn, lua/AllReduceEA.lua,
``averageParameters``), itself the synchronous form of Zhang, Choromanska and
LeCun, "Deep learning with Elastic Averaging SGD" (arXiv:1412.6651):

    step = step + 1
    if step % tau == 0:
        delta  = alpha * (param - center)     -- delta:add(param, -1, center):mul(alpha)
        param  = param - delta                -- param:add(-1, delta)
        delta  = allreduce_sum(delta)         -- tree.allReduce(delta, add)
        center = center + delta               -- center:add(delta)

All ranks start with equal params and the centre equal to them: ``start``
clones the centre from the broadcast initial weights, before the first local
step (AllReduceEA clones it lazily at its first call, after a step, which its
AllReduceEA.md says is meant to be "the same params and the same center").

``synchronize`` is the counterpart of AllReduceEA's ``synchronizeCenter``
(DistLearn's examples call it at the end of each epoch): every rank gets rank
0's centre and the step counter restarts.  synchronizeCenter's extra
allreduce of zero deltas is for ranks that took a different number of steps
(its test draws them at random); ours run in lockstep, so it is left out.
Unlike synchronizeCenter, every rank also takes the centre as its parameters:
the solver calls it (through ``ElasticAveraging.synchronize_model``) before each
test pass and snapshot, so the test scores and the .caffemodel are the
centre's, and a resume from that snapshot (whose weights become every rank's
params and centre) continues exactly as the uninterrupted run.
"""
import numpy as np

from ..common import CaffeError, log
from .sync import GradientSync


class ElasticAverager:
    def __init__(self, world, tau=10, alpha=0.2):
        if tau < 1:
            raise CaffeError("--tau must be >= 1, got %d" % tau)
        self.world = world
        self.tau = int(tau)
        self.alpha = float(alpha)
        self.step = 0
        self.center = None
        self.delta = None

    def _init(self, params):
        if self.center is None:
            self.center = params.copy()
            self.delta = np.empty_like(params)

    def start(self, params):
        """Centre := the (identical) initial parameters of every rank."""
        self.center = params.copy()
        self.delta = np.empty_like(params)
        self.step = 0

    def after_update(self, params):
        """Call after each local solver step with the flat parameter buffer
        (``net.param_data``, updated in place).  Returns True when this step
        was an averaging step."""
        self._init(params)
        self.step += 1
        if self.step % self.tau:
            return False
        d = self.delta
        np.subtract(params, self.center, out=d)
        d *= params.dtype.type(self.alpha)
        params -= d
        self.world.allreduce_sum(d, "the elastic averaging step")
        self.center += d
        return True

    def synchronize(self, params):
        """Every rank takes the centre as its parameters (all equal after)."""
        self._init(params)
        if self.world.size > 1:
            # centres are identical on all ranks (same sums, same order);
            # take rank 0's to be exact to the bit
            self.world.bcast_array(self.center, 0, "rank 0's centre")
        params[...] = self.center
        self.step = 0


class ElasticAveraging(GradientSync):
    """``--sync=easgd``: gradients stay local (each rank steps on its own
    batch), and :meth:`after_update` runs the elastic averaging every
    ``tau`` steps.  Tests and snapshots see the centre
    (:meth:`synchronize_model`)."""

    def __init__(self, world, tau=10, alpha=0.2):
        super().__init__(world)
        self.averager = ElasticAverager(world, tau, alpha)
        # True while every rank holds the same weights and history (after the
        # broadcast or a synchronisation, until the next local step): a test
        # right after a snapshot then costs no collective and changes nothing.
        self._in_sync = False

    def attach(self, net, iter_size=1):
        self.net = net
        self.iter_size = iter_size
        if self.collectives.is_root and self.active:
            log.info("Elastic averaging over %d ranks: tau = %d, alpha = %g", self.world.size,
                     self.averager.tau, self.averager.alpha)

    def on_start(self, net):
        super().on_start(net)
        self.averager.start(net.param_data)
        self._in_sync = True

    def finish(self, net):
        self._in_sync = False
        return 0.0

    def after_update(self, net):
        """After each local update: every ``tau`` of them, the elastic step
        (AllReduceEA's averageParameters)."""
        if self.active:
            self.averager.after_update(net.param_data)

    def synchronize_model(self, net, history):
        """Every rank takes the centre as its weights and the mean of the
        ranks' solver histories (the ranks' momenta are their own between
        synchronisations; the snapshot holds one history, and every rank
        resumes with it), identical to the bit on all ranks."""
        if not self.active or self._in_sync:
            return
        self.averager.synchronize(net.param_data)
        for h in history:
            self.world.allreduce_sum(h, "the solver history's mean")
            h *= h.dtype.type(1.0 / self.world.size)
            # a sum of more than two ranks may differ in the last bit between ranks
            self.world.bcast_array(h, 0, "rank 0's solver history")
        self._in_sync = True
