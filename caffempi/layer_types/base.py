"""Layer base class and the registry of layer types (Caffe's layer factory)."""
import numpy as np

from ..backend import to_numpy
from ..blob import Blob
from ..common import CaffeError, TRAIN

LAYER_REGISTRY = {}


def register(*type_names):
    """Class decorator: register a layer class under its Caffe type name(s)."""
    def deco(cls):
        for name in type_names:
            if name in LAYER_REGISTRY:
                raise RuntimeError("layer type %s registered twice" % name)
            LAYER_REGISTRY[name] = cls
        cls.type = type_names[0]
        return cls
    return deco


def create_layer(layer_param, phase=TRAIN, xp=np, dtype=np.float32):
    cls = LAYER_REGISTRY.get(layer_param.type)
    if cls is None:
        raise CaffeError("layer '%s': unknown layer type '%s' (known types: %s)" % (
            layer_param.name, layer_param.type, ", ".join(sorted(LAYER_REGISTRY))))
    return cls(layer_param, phase, xp, dtype)


class Layer:
    """One Caffe layer.  Subclasses implement ``setup``, ``reshape``,
    ``forward`` and ``backward`` over lists of :class:`Blob`.

    Conventions (as in Caffe): ``backward`` overwrites the diffs of the bottoms
    in ``propagate_down`` and *adds* to the diffs of its parameter blobs
    (``self.blobs``), so gradients accumulate over iter_size and shared params.
    Array code uses ``self.xp`` (NumPy or CuPy) and ``self.dtype``.
    """

    type = None
    # bottom/top count checks (Caffe's ExactNumBottomBlobs etc.); None = any
    exact_num_bottom = None
    min_bottom = None
    max_bottom = None
    exact_num_top = None
    min_top = None
    max_top = None
    # Loss layers weight their first top by 1 unless loss_weight says otherwise.
    is_loss = False
    # How many leading parameter blobs hold statistics, not weights
    # (BatchNorm): the net gives them lr_mult 0 when the prototxt has no param
    # spec, as Caffe does, and refuses a non-zero one.
    statistics_params = 0
    # (rank, size) of this process's share of the data; data layers read
    # records i with i % size == rank.  Set by the net before setup.
    data_shard = (0, 1)
    # Uneven batch shares (--balance): True where each sample's outputs
    # depend on that sample's inputs (and the params) alone, so a rank may
    # run any part of the global batch (see share_scale).
    samplewise = False
    # The count of the global batch each rank reads (Net.set_batch_shares),
    # or None: equal shares, Caffe's rule.
    batch_shares = None
    # What backward reads, for the memory planner (caffempi.memory).  Each is
    # a bool or a method returning one (``lambda self: ...``); the defaults
    # are conservative, so a layer that says nothing keeps its blobs alive.
    backward_reads_bottom_data = True   # bottoms' data (as they are after forward)
    backward_reads_top_data = True      # tops' data (as they are after forward)
    # In place (top is bottom) the layer keeps its own reference/copy of the
    # input, so backward does not read the shared blob as a bottom.
    in_place_keeps_input = False
    # Attributes holding arrays kept from forward for backward only; the
    # planner drops them after backward (set to None; forward sets them anew).
    backward_state = ()
    # Forward is cheap and deterministic (no random numbers; statistics
    # updates are undone by the planner): --memory=recompute may drop its
    # outputs and state after forward and run it again in backward.
    recompute_cheap = False
    # Indices of the param blobs whose diffs backward leaves alone
    # (set_param_propagate_down); an instance gets its own set.
    _frozen_param_diffs = frozenset()

    def __init__(self, layer_param, phase=TRAIN, xp=np, dtype=np.float32):
        self.param = layer_param
        self.name = layer_param.name
        self.phase = phase
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.blobs = []
        self.deferred_checks = None     # a list where checks wait for the net's read (check_values)

    # -------------------------------------------------------------- interface
    def setup(self, bottom, top):
        """One-time set-up: read parameters, create ``self.blobs``."""

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def backward(self, top, propagate_down, bottom):
        """Default for layers without a gradient (data, accuracy, ...)."""
        if any(propagate_down):
            raise CaffeError("layer '%s' (%s) cannot backpropagate to its bottoms" % (self.name, self.type))

    def absorb(self, followers):
        """How many of ``followers`` (the layers right after this one, each
        with this layer's top as its one bottom and its one top: in place on
        it) :meth:`forward_chain` and :meth:`backward_chain` compute together
        with this layer, with fewer passes over memory; 0 (the default):
        none.  The net asks once, after set-up, and then runs the chain fused
        wherever a pass covers it whole."""
        return 0

    def forward_chain(self, bottom, top):
        """Forward of this layer and of the followers it absorbed, leaving
        each follower what its own backward reads (so that a pass that
        starts inside the chain can run its layers one by one)."""
        raise NotImplementedError

    def backward_chain(self, top, propagate_down, bottom):
        """Backward of the absorbed followers, the last first, and then of
        this layer; ``top[0].diff`` is the last follower's top diff."""
        raise NotImplementedError

    def weight_factors(self):
        """How ``blobs[0]``'s gradient is made, where it is a sum of outer
        products over the rows of a batch: ``(rows, transposed)``, the
        gradient adding dy^T x (x^T dy when ``transposed``) for dy the first
        top's diff as a (rows, N) matrix and x the first bottom's data as
        (rows, K); else None.  Who forms that gradient another way (from
        every rank's factors: Poseidon's sufficient factors) turns
        :meth:`param_propagate_down` of blob 0 off."""
        return None

    def share_scale(self, share, batch):
        """Whether the ranks may split the global batch unevenly through
        this layer: for a rank that runs ``share`` of its nominal ``batch``
        samples, the factor on the gradient of this layer's loss tops that
        makes the ranks' mean gradient the global batch's (1.0 for a
        samplewise layer, whose loss is a sum over samples); None where the
        layer mixes samples or cannot tell.  Loss layers that normalise by
        the batch say share / batch."""
        return 1.0 if self.samplewise else None

    def share_batch(self):
        """The nominal per-rank batch of a data layer that reads uneven
        shares (:meth:`set_batch_shares`), else None."""
        return None

    def set_batch_shares(self, shares):
        """Read this rank's count of the global batch from ``shares`` (a
        count a rank, or None for equal shares) from the next forward."""
        self.batch_shares = shares

    def share_lookahead(self):
        """How many batches past the next one a data layer may have read
        already (its prefetch): shares announced that far ahead
        (:meth:`schedule_batch_shares`) cost it nothing."""
        return 0

    def schedule_batch_shares(self, shares, ahead):
        """``shares`` will be set (:meth:`set_batch_shares`) before the
        forward that reads the ``ahead``-th batch after the next one."""

    def rank_batch(self, batch_size):
        """This rank's batch of a nominal per-rank ``batch_size`` under the
        batch shares."""
        return batch_size if self.batch_shares is None else self.batch_shares[self.data_shard[0]]

    def param_propagate_down(self, index):
        """Whether backward adds to ``blobs[index].diff`` (Caffe's
        Layer::param_propagate_down); layers that can skip a param's
        gradient ask it."""
        return index not in self._frozen_param_diffs

    def set_param_propagate_down(self, index, value):
        frozen = set(self._frozen_param_diffs)
        (frozen.discard if value else frozen.add)(index)
        self._frozen_param_diffs = frozenset(frozen)

    def allow_force_backward(self, bottom_index):
        """False for bottoms that take no gradient (e.g. a loss's labels)."""
        return True

    # ----------------------------------------------------------------- helpers
    def new_blob(self, shape):
        return Blob(shape, self.xp, self.dtype)

    def check_values(self, values, check):
        """``check(host copy of values)``, which raises this layer's error
        for bad values: at once, or, where ``deferred_checks`` is a list (a
        net on the GPU), when the net reads the pass's loss, before any
        update (Net.forward_backward): a host read inside forward would
        stall the device's queue (backend/reads.py)."""
        if self.deferred_checks is None:
            check(to_numpy(values))
        else:
            self.deferred_checks.append((values, check))

    def error(self, msg, *args):
        return CaffeError(("layer '%s' (%s): " % (self.name, self.type)) + (msg % args if args else msg))

    def check_blob_counts(self, bottom, top):
        def check(kind, n, exact, lo, hi):
            if exact is not None and n != exact:
                raise self.error("takes %d %s blob(s), got %d", exact, kind, n)
            if lo is not None and n < lo:
                raise self.error("takes at least %d %s blob(s), got %d", lo, kind, n)
            if hi is not None and n > hi:
                raise self.error("takes at most %d %s blob(s), got %d", hi, kind, n)
        check("bottom", len(bottom), self.exact_num_bottom, self.min_bottom, self.max_bottom)
        check("top", len(top), self.exact_num_top, self.min_top, self.max_top)

    def fill(self, filler_param, shape):
        """A new parameter blob of ``shape`` filled by ``filler_param``."""
        from ..filler import fill
        blob = self.new_blob(shape)
        blob.data = self.xp.asarray(fill(filler_param, shape, self.dtype))
        return blob
