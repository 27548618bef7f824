"""Activation-memory planning (Layrub-style layer-centric reuse).

Selected per net with ``Net(..., memory=MODE)`` (``--memory`` on the command
line):

``none``
    Caffe's behaviour: every blob keeps its data and diff after a pass.
``reuse``
    A plan made at set-up from the lifetimes of every blob's data and diff
    over one forward and backward pass.  Blobs own their arrays and layers
    rebind them, so ending a lifetime means dropping the net's reference at
    the right moment; the allocator then hands the storage to the next array
    (a diff allocated in backward reuses the storage of the activations and
    diffs that died just before it: Layrub's intra- and inter-layer reuse).

    * forward: a blob's data dies after its last forward consumer when no
      backward step reads it (what a layer's backward reads is declared on the
      layer class: ``backward_reads_bottom_data``, ``backward_reads_top_data``,
      ``in_place_keeps_input``; see :class:`caffempi.layer_types.base.Layer`);
    * backward: a data array dies after the last backward step that reads
      it; a top diff dies after the backward of the layer that produced the
      blob; what a layer kept for its backward (``backward_state``) is
      dropped after that backward (after forward when it runs no backward).

    Numerics are bitwise those of ``none`` (the same operations run in the
    same order).  After ``forward``, intermediate blobs may hold a freed
    placeholder (a read-only, zero-strided array of zeros of the blob's
    shape): net outputs, the tops of data/input layers, and the blobs asked for
    with ``net.forward(blobs=[...])`` / ``net.backward(diffs=[...])`` or
    :meth:`MemoryManager.keep` always keep their values.
``recompute``
    ``reuse`` plus: the outputs and state of cheap layers (``recompute_cheap``:
    the neuron layers but Dropout, BatchNorm, MVN, Scale, Bias, Softmax, Concat,
    Slice, Split, Flatten, Reshape, Crop, Tile, Eltwise SUM; not pooling or LRN,
    whose NumPy forward is a noticeable part of a pass) are dropped after
    forward and recomputed in backward from their inputs just before the
    first backward step that reads them.  Inputs that an expensive layer
    produced are kept (referenced) for that; inputs made by other cheap
    layers are themselves recomputed.  Layers whose forward updates
    statistics (BatchNorm in TRAIN) get those restored after the recomputation,
    so running statistics are updated once per pass.  Identical numbers
    (forward is deterministic; Dropout, whose forward draws random numbers, is
    never recomputed).
``offload``
    Layrub's migration of large activations to host memory and back: GPU
    only (the CuPy backend), not implemented yet.

With reuse or recompute on NumPy, :func:`tune_allocator` makes glibc keep
freed memory for the next arrays (a pool) instead of unmapping and faulting
it in again every pass.  It is an explicit process step, not a side effect of
building a Net, because it changes malloc for the whole process: the CLI's
train, test and time call it, and a Python user may.

History and measurements: docs/design/cpu.md
"""
import ctypes
import sys
import tracemalloc

from . import config
from .common import CaffeError

MODES = ("none", "reuse", "recompute")
# Nets that only their owner reads (the solver's, `caffempi time/test`) free
# what a pass no longer needs; a Net built from Python keeps every blob
# readable, as pycaffe users expect, unless asked otherwise.
TRAINING_DEFAULT = "reuse"


def check_mode(mode):
    mode = (mode or "none").lower()
    if mode == "offload":
        raise CaffeError("--memory=offload (moving activations to host memory and back, GPU only) "
                         "is not implemented yet (use none, reuse or recompute)")
    if mode not in MODES:
        raise CaffeError("unknown --memory mode '%s' (choose from %s)" % (mode, ", ".join(MODES)))
    return mode


_TUNED = []


def tune_allocator():
    """Make glibc's malloc keep freed memory for reuse instead of handing it
    back to the OS (large arrays are otherwise mmap'ed and unmapped every time,
    so each pass would page-fault its activations in again): no mmap, no trim.
    The process then reuses the storage the plan frees, like a memory pool,
    and its footprint is the planned peak.  Once per process; Linux/glibc
    only; ``config.settings.malloc_tune`` (CAFFEMPI_MALLOC_TUNE=0) turns it
    off.  Returns True when applied."""
    if _TUNED:
        return _TUNED[0]
    ok = False
    if config.settings.malloc_tune and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
            ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
        except (OSError, AttributeError):
            ok = False
    _TUNED.append(ok)
    return ok


_HUGETLB = "glibc.malloc.hugetlb"


def hugepage_heap_env(environ):
    """The environment for a re-exec that makes glibc's malloc back its heap
    with transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, read
    only at process start), or None when it is set already or does not apply.
    With :func:`tune_allocator` the activations live in the heap, which
    otherwise gets 4 KiB pages (large mmap'ed arrays get huge pages through
    NumPy's madvise), and strided kernels then keep missing the TLB.  Older
    glibc ignores the unknown tunable.  CAFFEMPI_MALLOC_TUNE=0 in ``environ``
    turns it off with the rest of the allocator tuning."""
    if not config.read(environ).malloc_tune or not sys.platform.startswith("linux"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if _HUGETLB in tunables:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ("%s:%s=1" % (tunables, _HUGETLB)) if tunables else "%s=1" % _HUGETLB
    return env


def layer_flag(layer, name):
    """A class annotation of a layer: a bool, or a method returning one."""
    v = getattr(layer, name)
    return bool(v()) if callable(v) else bool(v)


def _root(a):
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def _unique_nbytes(arrays):
    seen = {}
    for a in arrays:
        if a is None or not hasattr(a, "nbytes"):
            continue
        r = _root(a)
        seen[id(r)] = r.nbytes
    return sum(seen.values())


class MemoryManager:
    """The plan and the hooks the net calls around each layer step."""

    def __init__(self, net, mode="none"):
        self.net = net
        self.mode = check_mode(mode)
        self.active = self.mode != "none"
        self.extra_keep = set()         # blob names kept for the current call
        self.extra_keep_diff = set()
        self.probe = None               # fn(event, i) while measuring
        self.state_nbytes = {}          # layer -> bytes of its backward state (seen while measuring)
        self._zero = net.xp.zeros((), net.dtype)
        self._plan()

    # ------------------------------------------------------------------ plan
    def _plan(self):
        net = self.net
        n = len(net.layers)
        names = list(net.blobs)
        self.data_tops = set()
        last_write, first_write = {}, {}
        version_src = []                # per layer: producer index of each bottom's version
        current = {}
        for i in range(n):
            version_src.append([current.get(b) for b in net.bottom_names[i]])
            if not net.bottom_names[i]:
                self.data_tops.update(net.top_names[i])
            for t in net.top_names[i]:
                current[t] = i
                last_write[t] = i
                first_write.setdefault(t, i)
        self.version_src = version_src
        self.last_write, self.first_write = last_write, first_write
        # forward readers of each blob's final version
        last_fwd = dict(last_write)
        for i in range(n):
            for b in net.bottom_names[i]:
                if i > last_write.get(b, -1):
                    last_fwd[b] = max(last_fwd.get(b, -1), i)
        # backward readers (backward reads the final version of every blob)
        self.bwd_readers = {b: set() for b in names}
        self.bwd_reads = [[] for _ in range(n)]
        for i, layer in enumerate(net.layers):
            if not net.layer_need_backward[i]:
                continue
            tops = set(net.top_names[i])
            reads = []
            if layer_flag(layer, "backward_reads_bottom_data"):
                keeps = layer_flag(layer, "in_place_keeps_input")
                reads += [b for b in net.bottom_names[i] if not (keeps and b in tops)]
            if layer_flag(layer, "backward_reads_top_data"):
                reads += list(net.top_names[i])
            for b in reads:
                self.bwd_readers[b].add(i)
            self.bwd_reads[i] = sorted(set(reads))
        self.state_attrs = [tuple(getattr(l, "backward_state", ()) or ()) for l in net.layers]
        # recomputable layers
        R = set()
        if self.mode == "recompute":
            outputs = set(net.outputs)
            for i, layer in enumerate(net.layers):
                if (net.bottom_names[i] and net.layer_need_backward[i]
                        and layer_flag(layer, "recompute_cheap")
                        and not outputs.intersection(net.top_names[i])):
                    R.add(i)
        self.R = R
        # schedules
        self.free_after_fwd = [[] for _ in range(n)]
        self.free_data_after_bwd = [[] for _ in range(n)]
        self.free_diff_after_bwd = [[] for _ in range(n)]
        self.recompute_before_bwd = [[] for _ in range(n)]
        self.consumers = {}             # (producer, top index) -> number of R layers reading it
        for b in names:
            if b in self.data_tops or b not in last_write:
                continue
            p = last_write[b]
            readers = self.bwd_readers[b]
            regenerated = p in R
            if not readers or regenerated:
                self.free_after_fwd[last_fwd[b]].append(b)
            if readers:
                self.free_data_after_bwd[min(readers)].append(b)
            self.free_diff_after_bwd[first_write[b]].append(b)
        for i in sorted(R):
            t = i
            for j, name in enumerate(net.top_names[i]):
                if last_write[name] == i and self.bwd_readers[name]:
                    t = max(t, max(self.bwd_readers[name]))
            self.recompute_before_bwd[t].append(i)
            for k, src in enumerate(version_src[i]):
                if src in R:
                    j = net.top_names[src].index(net.bottom_names[i][k])
                    self.consumers[(src, j)] = self.consumers.get((src, j), 0) + 1
        self._stash = {}
        self._cache = {}
        self._pending = {}
        self._done = set()

    # ----------------------------------------------------------------- hooks
    def _kept(self, name):
        return name in self.net_outputs or name in self.extra_keep

    @property
    def net_outputs(self):
        return self.net.outputs

    def free_data(self, name):
        """Drop the net's reference to a blob's data; the blob then holds a
        read-only zero-strided placeholder of its shape (no storage)."""
        blob = self.net.blobs[name]
        if not blob.bound:
            blob.release_data(self._zero)

    def is_freed(self, blob):
        return blob._data is not None and _root(blob._data) is self._zero

    def free_all(self):
        """Free every blob the plan may free (at set-up: the zeros that
        reshape allocated)."""
        for name in self.net.blobs:
            if name not in self.data_tops and not self._kept(name):
                self.free_data(name)
                self.net.blobs[name].release_diff()

    def _check(self, i, names, when):
        for name in names:
            if self.is_freed(self.net.blobs[name]):
                raise CaffeError("memory=%s: layer '%s' needs blob '%s' in %s, but its data was freed "
                                 "(run forward first, or keep it: net.forward(blobs=[...]), "
                                 "net.memory.keep(...), or memory='none')"
                                 % (self.mode, self.net.layer_names[i], name, when))

    def _drop_state(self, i):
        layer = self.net.layers[i]
        for a in self.state_attrs[i]:
            if getattr(layer, a, None) is not None:
                setattr(layer, a, None)

    def keep(self, *names):
        """Keep these blobs' data (and diffs) through every pass."""
        self.extra_keep.update(names)
        self.extra_keep_diff.update(names)

    def before_forward(self, i):
        if not self.active:
            return
        net = self.net
        self._check(i, [n for n in net.bottom_names[i]], "forward")
        if i in self.R:
            self._done.discard(i)
            for j in range(len(net.top_names[i])):
                self._cache.pop((i, j), None)
                self._pending.pop((i, j), None)
            self._stash[i] = [None if src in self.R else blob._data
                              for blob, src in zip(net.bottom_vecs[i], self.version_src[i])]

    def _record_state(self, i):
        layer = self.net.layers[i]
        self.state_nbytes[i] = _unique_nbytes([getattr(layer, a, None) for a in self.state_attrs[i]])

    def after_forward(self, i):
        net = self.net
        if self.probe:
            self._record_state(i)
        if not self.active:
            if self.probe:
                self.probe("forward", i)
            return
        if i in self.R:
            self._drop_state(i)
        elif not net.layer_need_backward[i]:
            self._drop_state(i)
        for name in self.free_after_fwd[i]:
            if not self._kept(name):
                self.free_data(name)
        if self.probe:
            self.probe("forward", i)

    def before_backward(self, i):
        if not self.active:
            return
        for j in self.recompute_before_bwd[i]:
            self._recompute(j)
        if self.bwd_reads[i]:
            self._check(i, self.bwd_reads[i], "backward")

    def after_backward(self, i):
        if not self.active:
            if self.probe:
                self.probe("backward", i)
            return
        self._drop_state(i)
        for name in self.free_diff_after_bwd[i]:
            if name not in self.extra_keep_diff:
                self.net.blobs[name].release_diff()
        for name in self.free_data_after_bwd[i]:
            if not self._kept(name):
                self.free_data(name)
        if self.probe:
            self.probe("backward", i)

    def _recompute(self, i):
        if i in self._done:
            return
        net = self.net
        stash = self._stash.get(i)
        if stash is None:
            raise CaffeError("memory=recompute: layer '%s' must run forward before backward"
                             % net.layer_names[i])
        for k, src in enumerate(self.version_src[i]):
            if src in self.R:
                self._recompute(src)
        layer = net.layers[i]
        bottoms, tops = net.bottom_vecs[i], net.top_vecs[i]
        saved = [b._data for b in bottoms], [t._data for t in tops]
        for k, (blob, src) in enumerate(zip(bottoms, self.version_src[i])):
            if src in self.R:
                key = (src, net.top_names[src].index(net.bottom_names[i][k]))
                blob._data = self._cache[key]
                self._pending[key] -= 1
                if self._pending[key] == 0:
                    del self._cache[key], self._pending[key]
            else:
                blob._data = stash[k]
        stats = [b.data.copy() for b in layer.blobs] if layer.statistics_params else None
        layer.forward(bottoms, tops)
        if stats is not None:
            for b, s in zip(layer.blobs, stats):
                b.data = s
        outs = [t._data for t in tops]
        for blob, old in zip(bottoms, saved[0]):
            blob._data = old
        for j, (t, name) in enumerate(zip(tops, net.top_names[i])):
            if self.last_write[name] == i and self.bwd_readers[name]:
                t._data = outs[j]       # a final version some backward step reads
            else:
                t._data = saved[1][j]
            if self.consumers.get((i, j)):
                self._cache[(i, j)] = outs[j]
                self._pending[(i, j)] = self.consumers[(i, j)]
        del self._stash[i]
        self._done.add(i)

    # ------------------------------------------------------------- accounting
    def live_bytes(self):
        """(activation bytes, gradient bytes) alive now: unique buffers of
        blob data and layer-held state (and recompute stashes), and of diffs."""
        net = self.net
        act = [b._data for b in net.blobs.values() if not b.bound and b._data is not None]
        for i, layer in enumerate(net.layers):
            for a in getattr(layer, "backward_state", ()) or ():
                act.append(getattr(layer, a, None))
        for arrs in self._stash.values():
            act.extend(arrs)
        act.extend(self._cache.values())
        act = [a for a in act if a is not None and _root(a) is not self._zero]
        diff = [b._diff for b in net.blobs.values() if not b.bound and b._diff is not None]
        return _unique_nbytes(act), _unique_nbytes(diff)


def measure(net, passes=2, setup=None):
    """Run ``passes`` forward-backward passes and measure memory on the last:
    peak live activation and gradient bytes (blob data, declared layer state,
    blob diffs; sampled at every layer step) and the tracemalloc peak of
    everything allocated meanwhile, less what was alive before the pass
    outside the activation blobs (parameters, ...).  Returns a dict."""
    mm = net.memory
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()   # before the warm-up pass, so the live arrays are traced
    for _ in range(passes - 1):
        if setup:
            setup(net)
        net.forward_backward()
    peak = {"act": 0, "grad": 0, "sum": 0}

    def probe(event, i):
        a, g = mm.live_bytes()
        peak["act"] = max(peak["act"], a)
        peak["grad"] = max(peak["grad"], g)
        peak["sum"] = max(peak["sum"], a + g)

    if setup:
        setup(net)
    mm.probe = probe
    try:
        a0, g0 = mm.live_bytes()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        net.forward_backward()
        peak_traced = tracemalloc.get_traced_memory()[1] - base
    finally:
        mm.probe = None
        if started:
            tracemalloc.stop()
    return {"mode": mm.mode, "peak_activation_bytes": peak["act"], "peak_gradient_bytes": peak["grad"],
            "peak_live_bytes": peak["sum"],
            "start_live_bytes": a0 + g0,
            # tracemalloc sees new allocations only: add what was alive at the start
            "peak_traced_bytes": peak_traced + a0 + g0,
            "predicted_peak_bytes": predict(net, mm.state_nbytes)}


def training_variant(net_param, batch_size=None, source_name="<NetParameter>"):
    """A copy of a NetParameter ready to train at ``batch_size`` (for
    benchmarks and tests): legacy inputs upgraded, Input layers resized, and,
    for a deploy net without a loss, the final Softmax replaced by a
    SoftmaxWithLoss on a label Input; BatchNorm set to compute batch
    statistics (use_global_stats cleared), as in training."""
    from .io import proto_io
    from .proto import caffe_pb2
    param = caffe_pb2.NetParameter()
    param.CopyFrom(net_param)
    proto_io.upgrade_net_param(param, source_name)
    if batch_size:
        for lp in param.layer:
            if lp.type == "Input":
                for s in lp.input_param.shape:
                    if len(s.dim):
                        s.dim[0] = batch_size
    losses = [lp for lp in param.layer if lp.type.endswith("Loss")]
    if not losses:
        last = param.layer[-1]
        inputs = [lp for lp in param.layer if lp.type == "Input"]
        if last.type == "Softmax" and inputs:
            # the label: a second top of the first Input layer (left at 0 by
            # timing.randomize_inputs, a valid class)
            data = inputs[0]
            shapes = data.input_param.shape
            n = shapes[0].dim[0] if shapes and shapes[0].dim else (batch_size or 1)
            while len(shapes) < len(data.top):
                shapes.add().CopyFrom(shapes[0])
            data.top.append("label")
            shapes.add().dim.append(n)
            last.type = "SoftmaxWithLoss"
            last.bottom.append("label")
            del last.top[:]
            last.top.append("loss")
            last.ClearField("softmax_param")
    for lp in param.layer:
        if lp.type == "BatchNorm":
            lp.batch_norm_param.ClearField("use_global_stats")
    return param


_ALIASING = ("Split", "Flatten", "Reshape")    # tops are views of the bottom


def predict(net, state_bytes):
    """The planner's predicted steady-state peak of live activation + gradient
    bytes: the schedule walked with blob sizes (and the layer-state sizes
    ``state_bytes[i]`` seen in a pass), ignoring layer temporaries.  Returns
    the peak over the second of two simulated passes."""
    mm = net.memory
    n = len(net.layers)
    item = net.dtype.itemsize
    size = {name: b.count * item for name, b in net.blobs.items()}
    active, R = mm.active, mm.R
    holders = {}            # version (blob, producer) -> set of holders
    current = {}            # blob -> its version held by the blob
    diffs, states = {}, {}
    vsize = {}

    def hold(v, h):
        holders.setdefault(v, set()).add(h)

    def unhold(v, h):
        s = holders.get(v)
        if s is not None:
            s.discard(h)
            if not s:
                del holders[v]

    def set_blob(name, v):
        if name in current:
            unhold(current[name], ("blob", name))
        current[name] = v
        if v is not None:
            vsize.setdefault(v, size[name])
            hold(v, ("blob", name))

    def live():
        return sum(vsize[v] for v in holders) + sum(diffs.values()) + sum(states.values())

    kept = set(net.outputs) | mm.data_tops
    peak = 0
    src_key = lambda i, k: (net.bottom_names[i][k], mm.version_src[i][k])
    for p in range(2):
        top_peak = 0
        for i in range(n):
            if active and i in R:
                for k, src in enumerate(mm.version_src[i]):
                    if src not in R:
                        hold(src_key(i, k), ("stash", i))
            for name in net.top_names[i]:
                if net.layers[i].type in _ALIASING and net.bottom_names[i][0] in current:
                    set_blob(name, current[net.bottom_names[i][0]])   # shares the bottom's array
                else:
                    set_blob(name, (name, i))
            if state_bytes.get(i):
                states[i] = state_bytes[i]
            top_peak = max(top_peak, live())
            if active:
                if i in R or not net.layer_need_backward[i]:
                    states.pop(i, None)
                for name in mm.free_after_fwd[i]:
                    if name not in kept:
                        set_blob(name, None)
        for i in range(n - 1, -1, -1):
            if active:
                for j in mm.recompute_before_bwd[i]:
                    for k in range(len(mm.version_src[j])):
                        unhold(src_key(j, k), ("stash", j))
                    if state_bytes.get(j):
                        states[j] = state_bytes[j]
                    for name in net.top_names[j]:
                        if mm.last_write[name] == j and mm.bwd_readers[name]:
                            set_blob(name, (net.bottom_names[j][0], "r%d" % j)
                                     if net.layers[j].type in _ALIASING else (name, j))
            if net.layer_need_backward[i]:
                for j, _ in net.loss_weights[i]:
                    diffs[net.top_names[i][j]] = size[net.top_names[i][j]]
                for name, need in zip(net.bottom_names[i], net.bottom_need_backward[i]):
                    if need:
                        diffs[name] = size[name]
            top_peak = max(top_peak, live())
            if active:
                states.pop(i, None)
                for name in mm.free_diff_after_bwd[i]:
                    diffs.pop(name, None)
                for name in mm.free_data_after_bwd[i]:
                    if name not in kept:
                        set_blob(name, None)
        peak = top_peak
    return peak
