"""Collectives that are not gradients: what the solver agrees on with the
other ranks besides the gradient sums (displayed losses, test scores,
signal actions, divergence, test splitting, rank 0's files and weights).

``Collectives(world)`` works over any :class:`~caffempi.parallel.comm.World`;
over a ``SingleWorld`` it is the single-process version (every call returns
its input).  Every rank calls each method at the same point of its loop, so
each one may be a collective.
"""
import numpy as np

from ..backend import to_numpy
from ..common import AgreedError, SolverAction, log


class Collectives:
    def __init__(self, world):
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.is_root = world.rank == 0
        self._warned_test = set()
        self._asked = np.zeros(len(self.ACTION_ORDER))      # this rank's signal requests, by kind
        self._agreed = np.zeros(len(self.ACTION_ORDER))     # their agreed counts (combine_action)

    @property
    def active(self):
        return self.size > 1

    # ---------------------------------------------------------------- scalars
    def mean_scalars(self, values):
        """Element-wise mean over ranks of a list of floats (the loss of the
        global batch on display lines)."""
        values = [float(v) for v in values]
        if not self.active or not values:
            return values
        return [float(v) / self.size for v in self.world.allreduce_scalars(values, what="the displayed outputs' mean")]

    def sum_scalars(self, values):
        """Element-wise sum over ranks (test scores, losses, batch counts)."""
        values = [float(v) for v in values]
        if not self.active or not values:
            return values
        return [float(v) for v in self.world.allreduce_scalars(values, what="the test scores' sum")]

    def diverged_ranks(self, info, flagged):
        """[(rank, info)] of the ranks whose ``info`` is not None (their loss
        is not finite; info is a picklable description), the same list on
        every rank, so that all stop at the same iteration; ``flagged``:
        whether some rank has one, as agreed (:meth:`start_agreement`).
        The descriptions are gathered only then."""
        if not flagged:
            return []
        everyone = self.world.allgather(info, "the diverged ranks' descriptions")
        return [(r, i) for r, i in enumerate(everyone) if i is not None]

    #: signal actions in the order they win when ranks ask for several at once
    ACTION_ORDER = (SolverAction.SNAPSHOT_AND_STOP, SolverAction.STOP, SolverAction.SNAPSHOT)

    def combine_action(self, action):
        """The signal action every rank takes: the first of
        SNAPSHOT_AND_STOP, STOP and SNAPSHOT that some rank has asked for
        more times than the ranks have agreed on it, else NONE.  Each rank
        counts what it was asked (``action``, once a poll) and the ranks
        agree on each count's maximum: a signal sent to every rank reaches
        them at different iterations, and the ranks it reaches late must
        not act on it a second time."""
        if not self.active:
            return action
        self._count(action)
        return self._agree(self.world.allreduce_scalars(self._asked, "max", "the agreement on signal actions"))

    def start_agreement(self, diverged, action):
        """Start a training iteration's agreement, before its gradient sums:
        whether some rank's loss is not finite (``diverged``, this rank's)
        and the signal action every rank takes (``action``, this rank's
        poll, as :meth:`combine_action`), in one all-reduce (max) that is
        not waited for here.  Returns a function that waits for it and
        returns (some rank diverged, the action): called after the sums it
        costs no wait, as the sums have brought the ranks together, where
        a blocking agreement after them and another after the update made
        each rank wait for the slower twice more a step."""
        if not self.active:
            return lambda: (bool(diverged), action)
        self._count(action)
        pending = self.world.start_allreduce_scalars([1.0 if diverged else 0.0] + list(self._asked), "max",
                                                     "the agreement on divergence and signal actions")

        def result():
            values = pending.result()
            return bool(values[0]), self._agree(values[1:])
        return result

    def _count(self, action):
        if action in self.ACTION_ORDER:
            self._asked[self.ACTION_ORDER.index(action)] += 1

    def _agree(self, counts):
        """The action of the agreed counts (their maxima over the ranks)."""
        new = counts > self._agreed
        self._agreed = np.maximum(self._agreed, counts)
        return next((a for a, fresh in zip(self.ACTION_ORDER, new) if fresh), SolverAction.NONE)

    # ---------------------------------------------------------------- testing
    def split_test_iters(self, test_iter):
        """Test iterations this rank runs: ceil(test_iter / N) on every rank.
        With the data sharding (record i to rank i mod N) and N dividing
        test_iter, the ranks together test exactly the records one process
        would.  Otherwise every rank still runs the same count (the solver
        polls signal actions collectively per test batch, so unequal counts
        would mismatch collectives): N*ceil(test_iter/N) batches are tested,
        and rank 0 warns once."""
        n = -(-int(test_iter) // self.size)
        if self.active and int(test_iter) % self.size and self.is_root \
                and test_iter not in self._warned_test:
            self._warned_test.add(test_iter)
            log.warning("test_iter %d is not a multiple of the %d ranks: testing %d batches "
                        "(%d per rank)", test_iter, self.size, n * self.size, n)
        return n

    # ---------------------------------------------------------- objects, arrays
    def gather_object(self, obj):
        """The ranks' picklable objects in rank order on rank 0 (None on the
        others): every rank's data position and random state go into a
        snapshot, so that a resume on as many ranks is exact."""
        return self.world.gather(obj, what="every rank's state for the snapshot") if self.active else [obj]

    def scatter_object(self, objs):
        """Rank r's item of rank 0's list ``objs`` (one per rank), on rank r:
        each rank's part of a snapshot (its low-rank error) goes to it alone."""
        return self.world.scatter(objs, what="every rank's state from the snapshot") if self.active else objs[0]

    def broadcast_object(self, obj):
        """Rank 0's picklable ``obj`` on every rank."""
        return self.world.bcast(obj, 0, "rank 0's result (files only rank 0 reads)") if self.active else obj

    def broadcast_arrays(self, arrays):
        """Make every rank's arrays (weights, solver history) rank 0's, in
        place.  The one weight broadcast: initial weights, finetuning and
        resuming all go through it, so only rank 0 reads weight files."""
        if self.active:
            for a in arrays:
                self.world.bcast_array(a, 0, "rank 0's weights")

    def check_same_net(self, net, what="net"):
        """Stop every rank now, with one line naming the first layer that
        differs, unless every rank built the same layers and parameter
        shapes as rank 0 (a stale prototxt on one host would otherwise
        surface as a mismatched collective, or silently wrong sums), as
        DDP verifies its model across ranks at construction."""
        if not self.active:
            return
        mine = [(name, layer.type, tuple(tuple(b.shape) for b in layer.blobs))
                for name, layer in zip(net.layer_names, net.layers)]
        everyone = self.world.allgather(mine, "the check that every rank built the same net")
        ref = everyone[0]
        for rank, layers in enumerate(everyone[1:], 1):
            if layers == ref:
                continue
            i = next((k for k, (a, b) in enumerate(zip(ref, layers)) if a != b), min(len(ref), len(layers)))
            raise AgreedError("rank %d built a different %s than rank 0 (a different prototxt?): %s"
                              % (rank, what, _first_difference(ref, layers, i, rank)))

    def check_in_sync(self, net):
        """True when every rank holds the same weights (a debugging aid and
        the tests' check)."""
        if not self.active:
            return True
        w = to_numpy(net.param_data).astype(np.float64)
        h = float(np.sum(w * (1 + np.arange(w.size) % 7)))
        lo = self.world.allreduce_scalars([h], "min", "the weights' checksum")[0]
        hi = self.world.allreduce_scalars([h], "max", "the weights' checksum")[0]
        return lo == hi


def _describe(layer):
    name, type_, shapes = layer
    return "'%s' (%s%s)" % (name, type_, "".join(", param " + "x".join(map(str, s)) for s in shapes))


def _first_difference(ref, other, i, rank):
    if i >= len(other):
        return "layer %d, %s, is missing on rank %d (%d layers against %d)" % (
            i, _describe(ref[i]), rank, len(other), len(ref))
    if i >= len(ref):
        return "rank %d has an extra layer %d, %s (%d layers against %d)" % (
            rank, i, _describe(other[i]), len(other), len(ref))
    return "layer %d is %s on rank 0 and %s on rank %d" % (i, _describe(ref[i]), _describe(other[i]), rank)
