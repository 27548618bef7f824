"""Net: a Caffe NetParameter turned into layers and blobs that run forward and
backward (Caffe's Net::Init, with pycaffe-like access)."""
from collections import OrderedDict
from itertools import zip_longest
import os

import numpy as np

from . import config
from . import layer_types  # noqa: F401  (registers every layer type)
from .backend import default_array_module, to_numpy
from .backend.reads import defers_reads, read_later
from .blob import Blob
from .common import CaffeError, TRAIN, TEST, get_rng_state, log, set_rng_state
from .io import proto_io
from .io.atomic import atomic_path
from .layer_types.base import create_layer
from .layer_types.recurrent import use_net_class
from .proto import caffe_pb2

# when a net calls the per-layer callbacks: around each layer's forward and backward
LAYER_HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward")


# ------------------------------------------------------------ state filtering
def state_meets_rule(state, rule):
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def filter_net(net_param):
    """Keep the layers whose include/exclude rules match the net's state."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net_param)
    del out.layer[:]
    for lp in net_param.layer:
        if lp.include and lp.exclude:
            raise CaffeError("layer '%s' specifies both include and exclude rules" % lp.name)
        included = not lp.include
        if any(state_meets_rule(net_param.state, r) for r in lp.exclude):
            included = False
        if any(state_meets_rule(net_param.state, r) for r in lp.include):
            included = True
        if included:
            out.layer.add().CopyFrom(lp)
    return out


def insert_splits(net_param):
    """Insert a Split layer wherever one top feeds several bottoms (Caffe's
    InsertSplits, same blob and layer names)."""
    producer = {}          # blob name -> (layer index, top index) of its last writer
    consumers = {}         # (layer index, top index) -> number of bottoms reading it
    for i, lp in enumerate(net_param.layer):
        for name in lp.bottom:
            if name not in producer:
                raise CaffeError("layer '%s': unknown bottom blob '%s' (no earlier layer produces it)"
                                 % (lp.name, name))
            key = producer[name]
            consumers[key] = consumers.get(key, 0) + 1
        for j, name in enumerate(lp.top):
            producer[name] = (i, j)

    out = caffe_pb2.NetParameter()
    out.CopyFrom(net_param)
    del out.layer[:]
    producer = {}
    next_split = {}        # (layer, top) -> next split output index to hand out
    for i, lp in enumerate(net_param.layer):
        new = out.layer.add()
        new.CopyFrom(lp)
        for b, name in enumerate(lp.bottom):
            key = producer[name]
            if consumers.get(key, 0) > 1:
                k = next_split[key]
                next_split[key] = k + 1
                src = net_param.layer[key[0]]
                new.bottom[b] = split_top_name(name, src.name, key[1], k)
        for j, name in enumerate(lp.top):
            producer[name] = (i, j)
            n = consumers.get((i, j), 0)
            if n > 1:
                split = out.layer.add()
                split.name = "%s_%s_%d_split" % (lp.name, name, j)
                split.type = "Split"
                split.bottom.append(name)
                for k in range(n):
                    split.top.append(split_top_name(name, lp.name, j, k))
                next_split[(i, j)] = 0
    return out


def split_top_name(blob, layer, top_index, k):
    return "%s_%s_%d_split_%d" % (blob, layer, top_index, k)


class LayerBlobNames(OrderedDict):
    """pycaffe's ``net.top_names`` / ``net.bottom_names``: layer name -> list of
    blob names, in layer order.  An int key is a layer index (the memory plan
    and the tools walk layers by index, and Caffe allows duplicate layer
    names, which the name keys would merge)."""

    def __init__(self, layer_names=(), names_per_layer=()):
        super().__init__(zip(layer_names, names_per_layer))
        self.per_layer = list(names_per_layer)

    def __getitem__(self, key):
        return super().__getitem__(key) if isinstance(key, str) else self.per_layer[key]


def reshape_layer(layer, bottoms, tops):
    """``layer.reshape``, a shape error reported naming the layer and its bottoms' shapes."""
    try:
        layer.reshape(bottoms, tops)
    except (ValueError, IndexError) as e:      # a CaffeError passes through as it is
        raise CaffeError("layer '%s' (%s): %s (bottom shapes %s)" % (
            layer.name, layer.type, e, [b.shape for b in bottoms]))


class PendingLoss:
    """A pass's loss and the layers' deferred checks (Layer.check_values),
    read from the device together (backend/reads.py); :meth:`result` runs
    the checks, which raise the layer's error for bad values, and returns
    the loss as a float."""

    def __init__(self, loss, checks, xp):
        self._checks = checks
        self._loss = loss if isinstance(loss, float) else None
        arrays = ([] if self._loss is not None else [loss]) + [values for values, _ in checks]
        self._read = read_later(xp, arrays) if arrays else None

    def result(self):
        hosts = self._read.result() if self._read is not None else []
        for (_, check), host in zip(self._checks, hosts[len(hosts) - len(self._checks):]):
            check(host)
        return self._loss if self._loss is not None else float(hosts[0])


class Net:
    """A network of layers built from a NetParameter for one phase and state.

    Access as in pycaffe (``Net(model, phase, weights=...)`` or
    ``Net(model, weights, phase)``): ``blobs``, ``params`` (layer name -> its
    parameter blobs), ``layers``, ``layer_dict``, ``layer_names`` (pycaffe's
    ``_layer_names``), ``inputs``, ``outputs``, ``top_names``/``bottom_names``,
    ``blob_loss_weights``, ``forward``/``backward``/``forward_all``/
    ``forward_backward_all``, ``reshape()``, ``set_input_arrays``,
    ``share_with``, ``copy_from``, ``save``, ``save_hdf5``/``load_hdf5``;
    per-layer callbacks ``before_forward(fn)``, ``after_forward``,
    ``before_backward``, ``after_backward`` (``fn(layer_index)``); and
    _caffe.cpp's ``_blob_names``, ``_blobs``, ``_blob_loss_weights``,
    ``_inputs``/``_outputs`` (blob indices), ``_top_ids(i)``/``_bottom_ids(i)``,
    ``_forward``/``_backward`` (layer indices), ``_set_input_arrays``.

    All learnable parameters live in two flat buffers (``param_data``,
    ``param_diff``) in layer order, so the gradients of consecutive layers are
    contiguous ranges for the allreduce.

    ``memory`` ("none" by default here, "reuse" or "recompute"; the solver
    and the CLI use "reuse"; see :mod:`caffempi.memory`) frees activation
    data and diffs as soon as a pass no longer needs them: after a pass,
    ``net.blobs[name].data`` keeps its values for outputs and inputs (and for
    blobs named in ``forward(blobs=[...])`` / ``net.memory.keep(...)``);
    other blobs may hold a read-only placeholder of zeros.
    """

    def __init__(self, net, phase=TRAIN, level=0, stages=(), weights=None,
                 xp=None, dtype=np.float32, source_name=None, data_shard=(0, 1), memory=None):
        if isinstance(phase, (str, os.PathLike)):      # pycaffe's Net(model, weights, phase)
            weights, phase, level = phase, level, 0
        if xp is None:
            xp = default_array_module()
        if isinstance(net, caffe_pb2.NetParameter):
            param = caffe_pb2.NetParameter()
            param.CopyFrom(net)
            proto_io.upgrade_net_param(param, source_name or "<NetParameter>")
        else:
            source_name = str(net)
            param = proto_io.read_net_param(net)
        self.source_name = source_name
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.phase = phase
        param.state.phase = phase
        param.state.level = level
        param.state.stage.extend(s for s in stages if s not in param.state.stage)
        self.name = param.name
        self.data_shard = tuple(data_shard)
        self.batch_shares = None        # set_batch_shares
        self._cleared = None            # [start, end) ranges clear_param_diffs zeroes; None: all
        self._loss_share_scales = {}    # layer index -> its loss gradient's factor under the shares
        self._share_fraction = 1.0
        self._passes = 0                # forward passes from the first layer (each reads a batch)
        self.next_batch_shares = []     # [(pass, shares)] announced, in order
        self.net_param = insert_splits(filter_net(param))
        # per-layer callbacks fn(layer_index), BVLC master's Net::Callback:
        # the user's (net.before_forward(fn) ...) and the gradient sync's
        self._hooks = {when: [] for when in LAYER_HOOKS}
        self._init_layers()
        self._init_params()
        self._init_backward()
        from .memory import MemoryManager
        self.memory = MemoryManager(self, memory)
        if self.memory.active:
            self.memory.free_all()
        self._init_chains()
        if defers_reads(self.xp):
            for layer in self.layers:       # their value checks wait for the loss's read
                layer.deferred_checks = []
        if weights:
            for w in str(weights).split(","):
                self.copy_from(w)

    # ------------------------------------------------------------------ build
    def _init_layers(self):
        self.layers = []
        self.layer_names = []
        self.blobs = OrderedDict()
        self.bottom_vecs, self.top_vecs = [], []
        bottom_names, top_names = [], []
        self.loss_weights = []          # per layer: list of (top index, weight)
        available = set()               # blobs produced and not yet consumed
        for lp in self.net_param.layer:
            layer = create_layer(lp, self.phase, self.xp, self.dtype)
            layer.data_shard = self.data_shard
            bottoms = []
            for name in lp.bottom:          # insert_splits checked that each exists
                bottoms.append(self.blobs[name])
                available.discard(name)
            tops = []
            for j, name in enumerate(lp.top):
                if name in self.blobs and not (j < len(lp.bottom) and lp.bottom[j] == name) \
                        and name not in lp.bottom:
                    raise CaffeError("layer '%s': top blob '%s' produced by multiple sources"
                                     % (lp.name, name))
                if name not in self.blobs:
                    self.blobs[name] = Blob((), self.xp, self.dtype)
                tops.append(self.blobs[name])
                available.add(name)
            layer.check_blob_counts(bottoms, tops)
            layer.setup(bottoms, tops)
            reshape_layer(layer, bottoms, tops)
            weights = []
            if len(lp.loss_weight) > len(tops):
                raise CaffeError("layer '%s': %d loss_weight values for %d tops"
                                 % (lp.name, len(lp.loss_weight), len(tops)))
            for j in range(len(tops)):
                if j < len(lp.loss_weight):
                    w = lp.loss_weight[j]
                else:
                    w = 1.0 if (layer.is_loss and j == 0) else 0.0
                if w:
                    weights.append((j, w))
            self.layers.append(layer)
            self.layer_names.append(lp.name)
            self.bottom_vecs.append(bottoms)
            self.top_vecs.append(tops)
            bottom_names.append(list(lp.bottom))
            top_names.append(list(lp.top))
            self.loss_weights.append(weights)
            log.debug("Setting up %s", lp.name)
            for name, blob in zip(lp.top, tops):
                log.debug("Top shape: %s %s (%d)", name, " ".join(map(str, blob.shape)), blob.count)
        self.bottom_names = LayerBlobNames(self.layer_names, bottom_names)
        self.top_names = LayerBlobNames(self.layer_names, top_names)
        self.outputs = [n for n in self.blobs if n in available]
        self.inputs = [name for layer, names in zip(self.layers, top_names) if layer.type == "Input"
                       for name in names]
        self.layer_dict = OrderedDict(zip(self.layer_names, self.layers))

    @property
    def _layer_names(self):
        """pycaffe's name for :attr:`layer_names`."""
        return self.layer_names

    # pycaffe's _caffe.cpp names, which BVLC's pycaffe.py and scripts use
    @property
    def _blob_names(self):
        """The blob names in blob order (the keys of :attr:`blobs`)."""
        return list(self.blobs)

    @property
    def _blobs(self):
        return list(self.blobs.values())

    @property
    def _blob_loss_weights(self):
        """The loss weights in blob order (the values of :attr:`blob_loss_weights`)."""
        return list(self.blob_loss_weights.values())

    @property
    def _inputs(self):
        """The blob indices of :attr:`inputs`."""
        return self._blob_ids(self.inputs)

    @property
    def _outputs(self):
        """The blob indices of :attr:`outputs`."""
        return self._blob_ids(self.outputs)

    def _top_ids(self, i):
        """The blob indices of layer i's tops."""
        return self._blob_ids(self.top_names[i])

    def _bottom_ids(self, i):
        """The blob indices of layer i's bottoms."""
        return self._blob_ids(self.bottom_names[i])

    def _blob_ids(self, names):
        index = {name: k for k, name in enumerate(self.blobs)}
        return [index[name] for name in names]

    @property
    def blob_loss_weights(self):
        """Blob name -> the loss weight of the layer that last writes it (0 for
        blobs that are no loss), as pycaffe's ``blob_loss_weights``."""
        weights = OrderedDict((name, 0.0) for name in self.blobs)
        for names, layer_weights in zip(self.top_names.per_layer, self.loss_weights):
            top_weights = dict(layer_weights)
            for j, name in enumerate(names):
                weights[name] = top_weights.get(j, 0.0)
        return weights

    def _init_params(self):
        """Resolve shared params, collect learnable ones and move them into the
        flat buffers; record lr_mult/decay_mult per learnable param."""
        self.params = OrderedDict()
        self.learnable_params = []       # owner blobs, in layer order
        self.param_lr_mults = []
        self.param_decay_mults = []
        self.param_layer_index = []      # layer index owning each learnable param
        self.param_owner_names = []      # "layer[i]" display names
        owners = {}                      # param name -> (blob, owner description)
        self.layer_param_need_backward = []
        for li, (layer, lp) in enumerate(zip(self.layers, self.net_param.layer)):
            if len(lp.param) > len(layer.blobs):
                raise CaffeError("layer '%s' declares %d param specs but has %d parameter blobs"
                                 % (lp.name, len(lp.param), len(layer.blobs)))
            need = []
            for pi, blob in enumerate(layer.blobs):
                if pi < len(lp.param):
                    spec = lp.param[pi]
                    if pi < layer.statistics_params and spec.lr_mult != 0:
                        raise CaffeError("layer '%s': cannot configure %s statistics as learnable parameters "
                                         "(param %d has lr_mult %g)" % (lp.name, lp.type, pi, spec.lr_mult))
                elif pi < layer.statistics_params:
                    spec = caffe_pb2.ParamSpec(lr_mult=0, decay_mult=0)
                else:
                    spec = caffe_pb2.ParamSpec()
                need.append(spec.lr_mult != 0)
                if spec.name and spec.name in owners:
                    owner, owner_desc, owner_mode = owners[spec.name]
                    if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE or owner_mode == caffe_pb2.ParamSpec.PERMISSIVE:
                        ok = owner.count == blob.count
                    else:
                        ok = owner.shape == blob.shape
                    if not ok:
                        raise CaffeError("cannot share param '%s': %s has shape %s, layer '%s' param %d has shape %s"
                                         % (spec.name, owner_desc, owner.shape, lp.name, pi, blob.shape))
                    layer.blobs[pi] = owner
                    continue
                if spec.name:
                    owners[spec.name] = (blob, "layer '%s' param %d" % (lp.name, pi), spec.share_mode)
                self.learnable_params.append(blob)
                self.param_lr_mults.append(spec.lr_mult)
                self.param_decay_mults.append(spec.decay_mult)
                self.param_layer_index.append(li)
                self.param_owner_names.append("%s[%d]" % (lp.name, pi))
            self.layer_param_need_backward.append(need)
            if layer.blobs:
                self.params[lp.name] = layer.blobs
        total = sum(b.count for b in self.learnable_params)
        self.param_data = self.xp.zeros(total, self.dtype)
        self.param_diff = self.xp.zeros(total, self.dtype)
        self.param_offsets = []
        off = 0
        for blob in self.learnable_params:
            n = blob.count
            blob.bind(self.param_data[off:off + n], self.param_diff[off:off + n])
            self.param_offsets.append(off)
            off += n

    def _init_backward(self):
        """Which layers and bottoms need backward (Caffe's Net::Init logic)."""
        nl = len(self.layers)
        blob_need = {}
        self.layer_need_backward = [False] * nl
        self.bottom_need_backward = []
        for i, lp in enumerate(self.net_param.layer):
            need = any(blob_need.get(n, False) for n in lp.bottom)
            bneed = []
            for j, n in enumerate(lp.bottom):
                b = blob_need.get(n, False)
                if len(lp.propagate_down):
                    if len(lp.propagate_down) != len(lp.bottom):
                        raise CaffeError("layer '%s': propagate_down must be given for every bottom" % lp.name)
                    b = lp.propagate_down[j]
                bneed.append(b)
            need = need or any(self.layer_param_need_backward[i])
            self.layer_need_backward[i] = need
            self.bottom_need_backward.append(bneed)
            for n in lp.top:
                blob_need[n] = need
        under_loss, skip_backp = set(), set()
        for i in range(nl - 1, -1, -1):
            lp = self.net_param.layer[i]
            contributes, skip_prop = False, True
            loss_tops = {j for j, _ in self.loss_weights[i]}
            for j, n in enumerate(lp.top):
                if j in loss_tops or n in under_loss:
                    contributes = True
                if n not in skip_backp:
                    skip_prop = False
                if contributes and not skip_prop:
                    break
            if self.layer_need_backward[i] and skip_prop:
                self.layer_need_backward[i] = False
                self.bottom_need_backward[i] = [False] * len(lp.bottom)
            if not contributes:
                self.layer_need_backward[i] = False
            for j, n in enumerate(lp.bottom):
                if contributes:
                    under_loss.add(n)
                else:
                    self.bottom_need_backward[i][j] = False
                if not self.bottom_need_backward[i][j]:
                    skip_backp.add(n)
        if self.net_param.force_backward:
            for i, layer in enumerate(self.layers):
                self.layer_need_backward[i] = True
                self.bottom_need_backward[i] = [
                    b or layer.allow_force_backward(j) for j, b in enumerate(self.bottom_need_backward[i])]

    def _init_chains(self):
        """The layer chains that run fused (:meth:`Layer.absorb`): a layer
        whose one top the next layers take in place, each its one bottom and
        top, no loss among them.  ``_chain_last``: first index -> last; a
        forward over the whole chain calls the first's ``forward_chain``.
        ``_chain_first``: last index -> first, where backward over the whole
        chain calls ``backward_chain`` at the last (so each layer's params
        have their gradients by its backward hook), when every layer of it
        runs a backward (the first's bottoms get gradients as the net
        says).  Not under the memory plan's recompute, which runs
        the layers one by one in backward."""
        self._chain_last, self._chain_first = {}, {}
        if not config.settings.fuse:
            return
        recomputed = self.memory.R
        alone = [len(tops) == 1 and not self.loss_weights[i] and i not in recomputed
                 for i, tops in enumerate(self.top_vecs)]
        i = 0
        while i < len(self.layers):
            last = i
            while (alone[i] and last + 1 < len(self.layers) and alone[last + 1]
                   and len(self.bottom_vecs[last + 1]) == 1
                   and self.bottom_vecs[last + 1][0] is self.top_vecs[i][0]
                   and self.top_vecs[last + 1][0] is self.top_vecs[i][0]):
                last += 1
            taken = self.layers[i].absorb(self.layers[i + 1:last + 1]) if last > i else 0
            if taken:
                self._chain_last[i] = i + taken
                chain = range(i, i + taken + 1)
                if all(self.layer_need_backward[j] for j in chain) \
                        and all(self.bottom_need_backward[j][0] for j in chain[1:]):
                    self._chain_first[i + taken] = i
            i += taken + 1

    def fused_chains(self):
        """The chains that run fused, as (first, last) layer indices: those
        of forward, and those whose backward also runs as one (profilers
        time each as one call: ``forward_range(first, last)``,
        ``backward_range(last, first)``)."""
        return (sorted(self._chain_last.items()),
                sorted((first, last) for last, first in self._chain_first.items()))

    # ---------------------------------------------------------------- running
    def forward_range(self, start=0, end=None, read=True):
        """Forward layers start..end (inclusive); returns the weighted loss
        (under batch shares, each loss also times its ``share_scale``: this
        rank's part of the mean over the ranks, as in backward), and runs
        the layers' deferred checks.  ``read=False`` on the GPU: the loss
        as a float64 device scalar (the same bits as the float), the
        checks left to the caller (:meth:`forward_backward`)."""
        end = len(self.layers) - 1 if end is None else end
        deferred = not read and defers_reads(self.xp)
        if start == 0:               # a pass that reads a batch: announced shares take effect now
            while self.next_batch_shares and self.next_batch_shares[0][0] <= self._passes:
                self._apply_batch_shares(self.next_batch_shares.pop(0)[1])
            self._passes += 1
        loss = 0.0
        mm = self.memory if self.memory.active or self.memory.probe else None
        before, after = self._hooks["before_forward"], self._hooks["after_forward"]
        fused_to = -1                # layers up to here ran in a chain (_init_chains)
        for i in range(start, end + 1):
            for hook in before:
                hook(i)
            layer = self.layers[i]
            if mm:
                mm.before_forward(i)
            layer.reshape(self.bottom_vecs[i], self.top_vecs[i])
            if i > fused_to:
                last = self._chain_last.get(i, i)
                if i < last <= end:
                    layer.forward_chain(self.bottom_vecs[i], self.top_vecs[i])
                    fused_to = last
                else:
                    layer.forward(self.bottom_vecs[i], self.top_vecs[i])
            for j, w in self.loss_weights[i]:
                total = self.top_vecs[i][j].data.sum()
                loss += w * self._loss_share_scales.get(i, 1.0) * (
                    total.astype(np.float64) if deferred else float(total))
            if mm:
                mm.after_forward(i)
            for hook in after:
                hook(i)
        if not read or not defers_reads(self.xp):
            return loss              # the checks ran in place, or are the caller's
        return PendingLoss(loss, self._take_checks(), self.xp).result()

    def _take_checks(self):
        """The (values, check) the layers deferred (Layer.check_values), taken."""
        checks = []
        for layer in self.layers:
            if layer.deferred_checks:
                checks += layer.deferred_checks
                layer.deferred_checks.clear()
        return checks

    def backward_range(self, start=None, end=0):
        """Backward layers start..end (start >= end), calling the hooks
        before and after each (also for layers that need no backward, as Caffe)."""
        start = len(self.layers) - 1 if start is None else start
        mm = self.memory if self.memory.active or self.memory.probe else None
        before, after = self._hooks["before_backward"], self._hooks["after_backward"]
        fused_from = len(self.layers)        # layers from here ran in a chain (_init_chains)
        for i in range(start, end - 1, -1):
            for hook in before:
                hook(i)
            if self.layer_need_backward[i]:
                if mm:
                    mm.before_backward(i)
                tops = self.top_vecs[i]
                for j, w in self.loss_weights[i]:
                    weight = w * self._loss_share_scales.get(i, 1.0)
                    tops[j].diff = self.xp.full(tops[j].shape, weight, self.dtype)
                first = self._chain_first.get(i, i)
                if i >= fused_from:
                    pass                         # its backward ran with its chain's last layer
                elif end <= first < i:
                    self.layers[first].backward_chain(tops, self.bottom_need_backward[first],
                                                      self.bottom_vecs[first])
                    fused_from = first
                else:
                    self.layers[i].backward(tops, self.bottom_need_backward[i], self.bottom_vecs[i])
            # the hooks see the blobs as backward left them (a gradient
            # strategy reads a layer's factors there), then the memory plan
            # may drop them
            for hook in after:
                hook(i)
            if mm:
                mm.after_backward(i)

    _forward, _backward = forward_range, backward_range      # pycaffe's _caffe.cpp names

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """pycaffe's forward: copy ``kwargs`` (input name -> array with the
        input blob's batch size, broadcast to its shape) into the inputs, run
        the layers ``start`` to ``end`` (names, inclusive), and return
        {name: data} of the outputs (of the tops of ``end`` when given) and of
        the blobs named in ``blobs``.  For another batch size, reshape the
        input blob first, as in pycaffe."""
        self._write_blobs(kwargs, self.inputs, "data", "forward")
        s = self._layer_index(start, 0, "forward")
        e = self._layer_index(end, len(self.layers) - 1, "forward")
        names = set(self.outputs if end is None else self.top_names[e]) | self._known_blob_names(blobs, "forward")
        keep = self.memory.extra_keep
        self.memory.extra_keep = keep | names
        try:
            self.last_loss = self.forward_range(s, e)
        finally:
            self.memory.extra_keep = keep
        return {n: self.blobs[n].data for n in self.blobs if n in names}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """pycaffe's backward: copy ``kwargs`` (output name -> diff array, as
        forward's inputs) into the outputs' diffs, run backward from layer
        ``start`` down to ``end`` (names, inclusive), and return {name: diff}
        of the inputs (of the bottoms of ``end`` when given) and of the blobs
        named in ``diffs``.  A loss output's diff is its loss weight (set
        every pass), so no diff may be given for it."""
        loss_weights = self.blob_loss_weights
        for name in kwargs:
            if loss_weights.get(name):
                raise CaffeError("backward: '%s' is a loss output (loss weight %g), whose diff is its "
                                 "loss weight; give diffs only for outputs that are no loss"
                                 % (name, loss_weights[name]))
        self._write_blobs(kwargs, self.outputs, "diff", "backward")
        s = self._layer_index(start, len(self.layers) - 1, "backward")
        e = self._layer_index(end, 0, "backward")
        names = set(self.inputs if end is None else self.bottom_names[e]) | self._known_blob_names(diffs, "backward")
        keep = self.memory.extra_keep_diff
        self.memory.extra_keep_diff = keep | names
        try:
            self.backward_range(s, e)
        finally:
            self.memory.extra_keep_diff = keep
        return {n: self.blobs[n].diff for n in self.blobs if n in names}

    def forward_all(self, blobs=None, **kwargs):
        """pycaffe's forward_all: ``kwargs`` (input name -> array of N items,
        any N) run through the net one batch at a time, the last batch padded
        with zeros; returns {name: NumPy array} of the outputs and ``blobs``
        with the batches joined and the padding cut off (N items).  An output
        without the batch axis (a scalar loss) gets one entry per batch.
        Without ``kwargs``, one forward pass (the data layers' next batch)."""
        outs = {}
        size, total = self._batch_plan(kwargs, "forward_all")
        for batch in self._batches(kwargs, size, total):
            self._collect(outs, self.forward(blobs=blobs, **batch))
        return self._join_batches(outs, size, total)

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """pycaffe's forward_backward_all: ``kwargs`` holds input arrays (for
        forward) and output diffs (for backward), all of N items, run a batch
        at a time as in :meth:`forward_all`; returns ({name: data} of the
        outputs and ``blobs``, {name: diff} of the inputs and ``diffs``)."""
        for name in kwargs:
            if name not in self.inputs and name not in self.outputs:
                raise CaffeError("forward_backward_all: '%s' is neither an input nor an output of net '%s' "
                                 "(inputs: %s; outputs: %s)" % (name, self.name, ", ".join(self.inputs),
                                                                 ", ".join(self.outputs)))
        size, total = self._batch_plan(kwargs, "forward_backward_all")
        inputs = {n: a for n, a in kwargs.items() if n in self.inputs}
        top_diffs = {n: a for n, a in kwargs.items() if n not in self.inputs}
        outs, grads = {}, {}
        for fb, bb in zip_longest(self._batches(inputs, size, total), self._batches(top_diffs, size, total),
                                  fillvalue={}):
            self._collect(outs, self.forward(blobs=blobs, **fb))
            self._collect(grads, self.backward(diffs=diffs, **bb))
        return self._join_batches(outs, size, total), self._join_batches(grads, size, total)

    def _batch_plan(self, arrays, what):
        """(batch size, N) for pycaffe's batching of ``arrays`` (the batch
        size of the first named blob, as every array has it), or (None, None)
        without arrays."""
        if not arrays:
            return None, None
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise CaffeError("%s: the arrays have different lengths %s" % (what, lengths))
        first = next(iter(arrays))
        if first not in self.blobs or not self.blobs[first].shape:
            raise CaffeError("%s: net '%s' has no batched blob '%s'" % (what, self.name, first))
        total = lengths[first]
        if total == 0:
            raise CaffeError("%s: the arrays are empty" % what)
        return self.blobs[first].shape[0], total

    @staticmethod
    def _batches(arrays, size, total):
        """The arrays cut into dicts of ``size`` items, the last padded with
        zeros (pycaffe's _batch); one empty dict without a plan."""
        if size is None:
            return [{}]
        if not arrays:
            return []
        arrays = {name: to_numpy(a) for name, a in arrays.items()}
        batches = []
        for i in range(0, total, size):
            batch = {}
            for name, a in arrays.items():
                part = a[i:i + size]
                if len(part) < size:
                    part = np.concatenate([part, np.zeros((size - len(part),) + a.shape[1:], a.dtype)])
                batch[name] = part
            batches.append(batch)
        return batches

    @staticmethod
    def _collect(pieces, arrays):
        for name, a in arrays.items():
            pieces.setdefault(name, []).append(to_numpy(a).copy())

    @staticmethod
    def _join_batches(pieces, size, total):
        """Per-batch arrays joined along the batch axis and cut to ``total``
        items; arrays without the batch axis are stacked, one per batch."""
        out = {}
        for name, arrays in pieces.items():
            if size is None:
                out[name] = arrays[0]
            elif arrays[0].ndim and arrays[0].shape[0] == size:
                out[name] = np.concatenate(arrays)[:total]
            else:
                out[name] = np.stack(arrays)
        return out

    def _layer_index(self, name, default, what):
        if name is None:
            return default
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise CaffeError("%s: net '%s' has no layer '%s'" % (what, self.name, name)) from None

    def _known_blob_names(self, names, what):
        names = set(names or ())
        unknown = sorted(names - set(self.blobs))
        if unknown:
            raise CaffeError("%s: net '%s' has no blob %s" % (what, self.name, ", ".join(map(repr, unknown))))
        return names

    def _write_blobs(self, arrays, allowed, attr, what):
        """Copy each array into ``blobs[name].<attr>`` (data or diff) in place,
        as pycaffe: the name is one of ``allowed``, the array has the blob's
        batch size and broadcasts to its shape."""
        kind = "input" if attr == "data" else "output"
        for name, value in arrays.items():
            if name not in allowed:
                raise CaffeError("%s: '%s' is not an %s of net '%s' (%ss: %s)" % (
                    what, name, kind, self.name, kind, ", ".join(allowed) or "none"))
            blob = self.blobs[name]
            value = self.xp.asarray(value)
            fits = value.shape[:1] == blob.shape[:1]
            if fits:
                try:
                    getattr(blob, attr)[...] = value
                except ValueError:              # does not broadcast to the blob's shape
                    fits = False
            if not fits:
                raise CaffeError("%s: %s '%s' has shape %s, the blob has shape %s (batch size %s; to change "
                                 "it, reshape the blob: net.blobs['%s'].reshape(...))" % (
                                     what, kind, name, tuple(value.shape), blob.shape,
                                     blob.shape[0] if blob.shape else "none", name))

    def reshape(self):
        """Caffe's Net::Reshape: every layer sets its tops' shapes from its
        bottoms' (after an input blob was reshaped)."""
        for layer, bottoms, tops in zip(self.layers, self.bottom_vecs, self.top_vecs):
            reshape_layer(layer, bottoms, tops)

    def set_input_arrays(self, data, labels):
        """pycaffe's set_input_arrays: N×C×H×W data and N labels that the net's
        first layer, a MemoryData layer, serves a batch at a time (N a multiple
        of its batch_size)."""
        first = self.layers[0].type if self.layers else "none"
        if first != "MemoryData":
            raise CaffeError("set_input_arrays: the first layer of net '%s' must be MemoryData, it is %s"
                             % (self.name, first))
        self.layers[0].reset(data, labels)

    _set_input_arrays = set_input_arrays

    def forward_backward(self, pending=False, start=0):
        """One training pass; returns the loss.  Param diffs accumulate.
        With ``pending``, a :class:`PendingLoss` of it instead, whose host
        read on the GPU is queued after forward and waited for only at
        ``result()``, so the host issues backward (and a solver its update
        and next pass) while the device works.  ``start``: the first layer
        to run forward, the ones before having run already (a replayed
        pass runs its data layers apart, solvers/captured.py)."""
        loss = self.forward_range(start, read=not pending)
        if pending:
            loss = PendingLoss(loss, self._take_checks(), self.xp)
        self.backward_range()
        return loss

    def clear_param_diffs(self):
        """Zero the gradients before a pass accumulates into them (Caffe's
        ClearParamDiffs), but for those of :meth:`set_diffs_written`."""
        if self._cleared is None:
            self.param_diff[...] = 0
        else:
            for start, end in self._cleared:
                self.param_diff[start:end] = 0

    def set_diffs_written(self, params):
        """The learnable params (indices) whose gradients something other
        than the layers' backward writes whole every iteration (the
        sufficient factors' product; their layers compute no weight
        gradient): :meth:`clear_param_diffs` leaves them, as zeroing them
        is a pass over memory that the write makes again (CaffeNet's fully
        connected weights: 234 MB).  An empty set: every gradient cleared."""
        params = sorted(set(params))
        self._cleared = self.param_ranges(0, self.param_diff.size, params) if params else None

    def param_ranges(self, start, end, exclude=()):
        """The [start, end) ranges of the flat param buffers within
        [``start``, ``end``) less those of the learnable params in
        ``exclude`` (indices)."""
        cuts = sorted((self.param_offsets[p], self.param_offsets[p] + self.learnable_params[p].count)
                      for p in exclude)
        ranges, pos = [], start
        for s, e in cuts:
            if s >= end or e <= pos:
                continue
            if s > pos:
                ranges.append((pos, s))
            pos = e
        if pos < end:
            ranges.append((pos, end))
        return ranges

    # ------------------------------------------------------------- callbacks
    def add_hook(self, when, fn):
        """``fn(layer_index)`` runs at ``when`` (one of LAYER_HOOKS) of every
        layer that forward_range/backward_range passes, wrapping the layer's
        work and its memory plan's, in the order added."""
        if when not in LAYER_HOOKS:
            raise CaffeError("net '%s': no callback point '%s' (%s)" % (self.name, when, ", ".join(LAYER_HOOKS)))
        if not callable(fn):
            raise CaffeError("net '%s': %s needs a callable taking the layer index, got %r" % (self.name, when, fn))
        self._hooks[when].append(fn)

    def remove_hook(self, when, fn):
        self._hooks[when].remove(fn)

    def before_forward(self, fn):
        """pycaffe's (BVLC master's Net_before_forward): ``fn(i)`` before layer i's forward."""
        self.add_hook("before_forward", fn)

    def after_forward(self, fn):
        """pycaffe's: ``fn(i)`` after layer i's forward."""
        self.add_hook("after_forward", fn)

    def before_backward(self, fn):
        """pycaffe's: ``fn(i)`` before layer i's backward."""
        self.add_hook("before_backward", fn)

    def after_backward(self, fn):
        """pycaffe's: ``fn(i)`` after layer i's backward (where the gradient
        sync starts the sums of the buckets layer i completes)."""
        self.add_hook("after_backward", fn)

    add_backward_hook = after_backward

    def remove_backward_hook(self, fn):
        self.remove_hook("after_backward", fn)

    # ------------------------------------------------------ data layer state
    # Data layers may define get_state()/set_state(state) (their position in
    # the data and their random state, JSON-serialisable) and a float
    # attribute wait_seconds (time forward spent waiting for a batch).
    def data_state(self):
        return {n: l.get_state() for n, l in zip(self.layer_names, self.layers) if hasattr(l, "get_state")}

    def set_data_state(self, state):
        for name, st in state.items():
            if name in self.layer_dict and hasattr(self.layer_dict[name], "set_state"):
                self.layer_dict[name].set_state(st)

    def data_wait_seconds(self):
        return sum(getattr(l, "wait_seconds", 0.0) for l in self.layers)

    # ------------------------------------------------------- uneven shares
    def shareable_batch(self):
        """(the nominal per-rank batch b of the data layers that read uneven
        shares of the global batch, None) or (None, why the ranks of this net
        must keep equal shares): every layer must be samplewise or a loss
        that says its weight (``Layer.share_scale``), and the data layers
        must read shares and agree on b."""
        batches = {}
        for name, layer in zip(self.layer_names, self.layers):
            batch = layer.share_batch()
            if batch is not None:
                batches.setdefault(batch, name)
        if len(batches) != 1:
            return None, ("no data layer that reads a share of the batch (Data, ImageData, HDF5Data, "
                          "MemoryData, DummyData)" if not batches else
                          "its data layers read different batches (%s)" % ", ".join(
                              "'%s' %d" % (n, b) for b, n in sorted(batches.items())))
        (batch,) = batches
        for name, layer in zip(self.layer_names, self.layers):
            if layer.share_scale(batch, batch) is None:
                return None, "layer '%s' (%s) mixes the samples of a batch" % (name, layer.type)
        return batch, None

    def share_lookahead(self):
        """Passes ahead that shares must be announced for the data layers'
        readers to read them without a restart (Layer.share_lookahead)."""
        return max([layer.share_lookahead() for layer in self.layers] + [0])

    def pending_batch_shares(self):
        """[(passes from now, shares)] announced and not yet in effect."""
        return [(at - self._passes, shares) for at, shares in self.next_batch_shares]

    def set_batch_shares(self, shares, ahead=0):
        """From the ``ahead``-th forward pass after the next one (0: the
        next) each rank reads ``shares[rank]`` records of the global batch
        (a count a rank, summing to ranks x b; None: equal shares, Caffe's
        rule), and each loss's gradient takes its ``share_scale``, so the
        ranks' mean gradient stays the global batch's.  Announced at least
        ``share_lookahead()`` passes ahead, the change costs the data
        layers' readers nothing; else they restart at the next batch.  The
        data layers reshape the net; the memory plan, made from lifetimes,
        holds for any batch."""
        shares = self._checked_shares(shares)
        if ahead > 0:
            for layer in self.layers:
                layer.schedule_batch_shares(shares, ahead)
            self.next_batch_shares.append((self._passes + ahead, shares))
            return
        self.next_batch_shares = []
        self._apply_batch_shares(shares)

    def _checked_shares(self, shares):
        if shares is None:
            return None
        size = self.data_shard[1]
        batch, why = self.shareable_batch()
        shares = tuple(int(n) for n in shares)
        if why is not None:
            raise CaffeError("net '%s' cannot split its batch unevenly: %s" % (self.name, why))
        if len(shares) != size or min(shares) < 1 or sum(shares) != size * batch:
            raise CaffeError("net '%s': batch shares %s must be %d positive counts summing to %d"
                             % (self.name, ":".join(map(str, shares)), size, size * batch))
        return shares

    def _apply_batch_shares(self, shares):
        self.batch_shares = shares
        for layer in self.layers:
            layer.set_batch_shares(shares)
        if shares is None:
            self._share_fraction, self._loss_share_scales = 1.0, {}
            return
        rank, batch = self.data_shard[0], self.shareable_batch()[0]
        self._share_fraction = shares[rank] / batch
        self._loss_share_scales = {i: self.layers[i].share_scale(shares[rank], batch)
                                   for i, weights in enumerate(self.loss_weights) if weights}

    def layer(self, name):
        return self.layer_dict[name]

    def output_values(self, share_weighted=False):
        """(blob name, values, loss weight) for every output, as Caffe logs
        them.  ``share_weighted``: each value times its weight under the
        batch shares (a loss its ``share_scale``, any other output this
        rank's share of its nominal batch), so that the mean over the ranks
        is the global batch's."""
        out = []
        for name in self.outputs:
            i, j = self._producer(name)
            w = dict(self.loss_weights[i]).get(j, 0.0)
            values = self.blobs[name].data
            if share_weighted and self.batch_shares is not None:
                values = values * (self._loss_share_scales[i] if w else self._share_fraction)
            out.append((name, values, w))
        return out

    def _producer(self, name):
        for i in range(len(self.layers) - 1, -1, -1):
            if name in self.top_names[i]:
                return i, self.top_names[i].index(name)
        raise KeyError(name)

    def first_nonfinite_layer(self):
        """Name of the first layer whose forward output is not finite, or None
        (where a diverged training step went wrong).

        The tops a pass left behind do not tell: in-place layers overwrite
        their input, and with memory reuse most tops are freed or hold other
        blobs' storage by now.  So the forward runs again, each layer's tops
        checked as it finishes, from the kept tops of the data layers (which
        are not run again: they would read the next batch).  The parameters
        (BatchNorm's running sums) and the random state (Dropout's draws) are
        restored afterwards."""
        xp = self.xp

        def nonfinite(i):
            return any(t.count and not bool(xp.isfinite(t.data).all()) for t in self.top_vecs[i])
        saved, rng_state = self.param_data.copy(), get_rng_state()
        try:
            for i in range(len(self.layers)):
                if self.bottom_names[i]:
                    self.forward_range(i, i)
                if nonfinite(i):
                    return self.layer_names[i]
            return None
        finally:
            self.param_data[...] = saved
            set_rng_state(rng_state)

    # ------------------------------------------------------------ weights I/O
    def copy_from(self, path_or_param):
        """Copy parameters by layer name from a .caffemodel (binary or text) or
        a NetParameter, as Caffe's CopyTrainedLayersFrom."""
        if isinstance(path_or_param, caffe_pb2.NetParameter):
            src, where = path_or_param, "<NetParameter>"
        else:
            where = str(path_or_param)
            if where.endswith(".h5") or where.endswith(".hdf5"):
                return self.load_hdf5(where)
            src = proto_io.read_net_param(where)
        for lp in src.layer:
            if lp.name not in self.layer_dict or not lp.blobs:
                continue
            target = self.layer_dict[lp.name].blobs
            if len(target) != len(lp.blobs):
                raise CaffeError("%s: layer '%s' has %d parameter blobs, the net expects %d"
                                 % (where, lp.name, len(lp.blobs), len(target)))
            for k, bp in enumerate(lp.blobs):
                try:
                    arr = proto_io.blob_proto_to_array(bp)
                except proto_io.ProtoError as e:
                    raise CaffeError("%s: layer '%s' param %d: %s" % (where, lp.name, k, e)) from None
                blob = target[k]
                arr = self._fit_shape(arr, bp, blob.shape, where, lp.name, k)
                blob.data = self.xp.asarray(arr, self.dtype)

    @staticmethod
    def _fit_shape(arr, bp, shape, where, layer_name, k):
        if arr.shape == tuple(shape):
            return arr
        if proto_io.legacy_shape_matches(bp, shape):
            return arr.reshape(shape)
        raise CaffeError("%s: cannot copy param %d of layer '%s': source shape %s, target shape %s"
                         % (where, k, layer_name, arr.shape, tuple(shape)))

    def load_hdf5(self, path):
        """Copy parameters by layer name from Caffe's HDF5 layout (data/<layer>/<i>),
        as Caffe's CopyTrainedLayersFromHDF5."""
        import h5py
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise CaffeError("cannot read weights from %s: %s" % (os.fspath(path), e)) from None
        with f:
            if "data" not in f:
                raise CaffeError("%s: no 'data' group (not Caffe's HDF5 weights layout)" % os.fspath(path))
            group = f["data"]
            for name in group:
                if name not in self.layer_dict:
                    continue
                target = self.layer_dict[name].blobs
                if len(group[name]) != len(target):
                    raise CaffeError("%s: layer '%s' has %d parameter blobs, the net expects %d"
                                     % (path, name, len(group[name]), len(target)))
                for k in range(len(target)):
                    arr = np.asarray(group[name][str(k)])
                    if arr.shape != target[k].shape:
                        raise CaffeError("%s: cannot copy param %d of layer '%s': source shape %s, target shape %s"
                                         % (path, k, name, arr.shape, target[k].shape))
                    target[k].data = self.xp.asarray(arr, self.dtype)

    def to_proto(self, write_diff=False):
        """NetParameter with every layer and its parameter blobs (a .caffemodel)."""
        from .backend import to_numpy
        out = caffe_pb2.NetParameter()
        out.name = self.name
        for layer, lp in zip(self.layers, self.net_param.layer):
            new = out.layer.add()
            new.CopyFrom(lp)
            del new.blobs[:]
            for blob in layer.blobs:
                proto_io.array_to_blob_proto(to_numpy(blob.data), new.blobs.add(),
                                             diff=to_numpy(blob.diff) if write_diff else None)
        return out

    def save(self, path, write_diff=False):
        """Write a binary .caffemodel (atomically)."""
        proto_io.write_binary_proto_atomic(path, self.to_proto(write_diff))

    def save_hdf5(self, path, write_diff=False):
        """Write weights in Caffe's HDF5 layout (data/<layer>/<i>), atomically
        (:mod:`caffempi.io.atomic`)."""
        import h5py
        from .backend import to_numpy
        groups = [("data", "data")] + ([("diff", "diff")] if write_diff else [])
        try:
            with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
                for gname, attr in groups:
                    g = f.create_group(gname)
                    for name, layer in zip(self.layer_names, self.layers):
                        if layer.blobs:
                            lg = g.create_group(name)
                            for k, blob in enumerate(layer.blobs):
                                lg.create_dataset(str(k), data=to_numpy(getattr(blob, attr)))
        except OSError as e:
            raise CaffeError("cannot write %s: %s" % (os.fspath(path), e.strerror or e)) from None

    def share_weights(self, other):
        """Make this net's same-named layers use ``other``'s parameter blobs
        (a test net sharing the train net's weights, as Caffe's ShareTrainedLayersWith)."""
        for name, layer in zip(self.layer_names, self.layers):
            if name in other.layer_dict and layer.blobs:
                src = other.layer_dict[name].blobs
                if len(src) != len(layer.blobs):
                    raise CaffeError("layer '%s': %d parameter blobs in the train net, %d in the test net"
                                     % (name, len(src), len(layer.blobs)))
                for k, blob in enumerate(src):
                    if blob.shape != layer.blobs[k].shape:
                        raise CaffeError("layer '%s' param %d: train net shape %s, test net shape %s"
                                         % (name, k, blob.shape, layer.blobs[k].shape))
                    layer.blobs[k] = blob
                if name in self.params:
                    self.params[name] = layer.blobs

    share_with = share_weights      # pycaffe's name

    def memory_summary(self):
        """Sizes of the activation blobs (all of them, as Caffe allocates) and
        of the parameters; ``caffempi.memory.measure``
        gives the peaks a pass actually reaches."""
        act = sum(b.count for b in self.blobs.values()) * self.dtype.itemsize
        par = self.param_data.size * self.dtype.itemsize
        return {"activation_bytes": act, "param_bytes": par}


# RNN and LSTM run an unrolled Net inside (they cannot import this module).
use_net_class(Net)


def phase_from_name(name):
    try:
        return {"TRAIN": TRAIN, "TEST": TEST}[name.upper()]
    except KeyError:
        raise CaffeError("unknown phase '%s' (TRAIN or TEST)" % name)

