"""The training loop: Caffe's Solver (solver.cpp) and SGDSolver's shared parts
(sgd_solver.cpp): nets from a SolverParameter, Step/Solve, testing, display,
snapshots and restore.  The update rules live in the subclasses (see
``caffempi.solvers``) and in :mod:`caffempi.solvers.updates`.
"""
import json
import math
import os
import time

import numpy as np
from google.protobuf import text_format

from .. import common, config
from ..backend import default_array_module, kernels, threads, to_numpy
from ..backend.reads import defers_reads, read_later
from ..common import AgreedError, CaffeError, SolverAction, TEST, TRAIN, log
from ..io import proto_io
from ..io.atomic import atomic_path
from ..io.proto_io import ProtoError
from ..memory import TRAINING_DEFAULT, check_mode
from ..net import Net
from ..parallel.comm import SingleWorld
from ..parallel.sync import BucketedAllreduce
from ..proto import caffe_pb2
from . import lr_policy
from .captured import CapturedSteps

f32 = np.float32


def fmt(v):
    """A number as C++'s ostream prints a float (precision 6, %g)."""
    return "%.6g" % float(v)


def loss_suffix(weight, value):
    """The " (* w = l loss)" Caffe appends to an output line of a blob with
    loss weight ``weight``: the weighted value as a float32 product; "" for
    a blob that is not a loss (weight 0)."""
    if not weight:
        return ""
    return " (* %s = %s loss)" % (fmt(weight), fmt(f32(weight) * f32(value)))


def part(values, block):
    """Per-param values (a flat vector over the params' elements, or a 0-d
    array or scalar where every param has the same) over ``block`` of the
    flat buffers: a 0-d array or scalar as it is; of a vector its slice, or,
    for a block with a start (the update's blocks on the CPU, none of
    which crosses a change of the values), its value there as a scalar:
    the same numbers without a pass over the vector (and NumPy's scalar
    operands are faster than broadcast ones)."""
    if not getattr(values, "ndim", 0):
        return values
    return values[block] if block.start is None else values[block.start]


# -------------------------------------------------------------- solver files
def read_solver(path):
    """Read a solver prototxt as Caffe's ReadSolverParamsFromTextFileOrDie:
    legacy solver_type upgraded, a missing snapshot_prefix set from the file
    name, a directory prefix completed with the file's stem."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CaffeError("solver file %s does not exist" % path)
    try:
        param = proto_io.read_solver_param(path)
    except ProtoError as e:
        raise CaffeError(str(e)) from None
    upgrade_snapshot_prefix(param, path)
    return param


def upgrade_snapshot_prefix(param, path):
    stem = os.path.splitext(os.path.basename(path))[0]
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = os.path.splitext(path)[0]
    elif param.snapshot_prefix.endswith(os.sep) or os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)


def _rng_state_to_json(state):
    name, keys, pos, has_gauss, cached = state
    return [name, [int(k) for k in np.asarray(keys)], int(pos), int(has_gauss), float(cached)]


def _rng_state_from_json(obj):
    name, keys, pos, has_gauss, cached = obj
    return (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))


class Solver:
    """Base solver: Caffe's Solver + SGDSolver's shared parts.

    ``Solver(param_or_path, xp=numpy, sync=None, weights=None, source=None, memory="reuse")``

    pycaffe's API: ``step(n)``, ``solve(resume_file=None)``, ``net``,
    ``test_nets``, ``iter`` (here also writable), ``param`` (the
    SolverParameter; the loop reads it every iteration, so a changed
    ``base_lr`` takes effect), ``lr``, ``snapshot()``, ``restore(path)``,
    ``apply_update()``, ``share_weights(net)``,
    ``add_callback(on_start, on_gradients_ready)``; and ``test(i)``.

    Data parallelism (layers and solvers never call MPI) is ``sync``, a
    :class:`~caffempi.parallel.sync.GradientSync` that the loop drives (its
    docstring lists the calls), and its ``collectives`` for everything that
    is not gradients.  Without one, one process: the caller picks the
    job's strategy (``caffempi train``: its flags; pycaffe's
    ``caffe.SGDSolver(path)``: train's defaults under a launcher, see
    caffempi.pycaffe), so building a solver starts no MPI.  Only rank 0
    logs and writes snapshots (``is_root``).
    ``set_action_function(fn)`` installs the signal poller (Caffe's
    SetActionFunction).
    """

    type = None          # Caffe's solver type name
    num_history = 1      # flat history buffers per learnable parameter set
    uses_scratch = False  # a second scratch buffer for the rule (scratch())

    def __init__(self, param, xp=None, sync=None, weights=None, source=None, memory=TRAINING_DEFAULT):
        self.memory = check_mode(memory)
        if isinstance(param, caffe_pb2.SolverParameter):
            p = caffe_pb2.SolverParameter()
            p.CopyFrom(param)
            try:
                proto_io.upgrade_solver_param(p, source or "<SolverParameter>")
            except ProtoError as e:
                raise CaffeError(str(e)) from None
            param = p
        else:
            source = os.fspath(param)
            param = read_solver(source)
        self.param = param
        self.source = source
        self.xp = xp if xp is not None else default_array_module()
        self.sync = sync if sync is not None else BucketedAllreduce(SingleWorld())
        self.collectives = self.sync.collectives
        self.action_function = None
        self.callbacks = []              # (on_start, on_gradients_ready) pairs: add_callback
        self.captured = None             # CapturedSteps, made by step() under CAFFEMPI_CUDA_GRAPH
        self.requested_early_exit = False
        self.iter = 0
        self.current_step = 0
        self.smoothed_loss = 0.0
        self._losses = []
        self._loss_base = 0
        self._pending_window = None
        self._pending_sync_state = None    # this rank's gradient-strategy state from restore()
        self._loaded_blobs = None          # rank 0: every rank's snapshot arrays, in restore()
        self._params_synced = False
        self._snapshot_iter = None       # the iteration of the last snapshot
        self.test_scores = []

        self._info("Initializing solver from parameters: \n%s",
                   text_format.MessageToString(param).rstrip())
        self._check_param()
        if param.random_seed >= 0:
            common.set_random_seed(common.rank_seed(param.random_seed, self.collectives.rank))
        self._check_snapshot_write_permissions()
        self.net = self._init_train_net()
        self.test_nets = self._init_test_nets()
        self.collectives.check_same_net(self.net, "train net")
        for i, tn in enumerate(self.test_nets):
            self.collectives.check_same_net(tn, "test net #%d" % i)
        names = list(param.weights)
        if weights:
            names += [weights] if isinstance(weights, str) else list(weights)
        files = [w for entry in names for w in str(entry).split(",") if w]
        for w in files:
            self._info("Finetuning from %s", w)
            self._on_root(self._load_weights, w)
        if files:
            self.collectives.broadcast_arrays([self.net.param_data])
        for tn in self.test_nets:
            tn.share_weights(self.net)
        self.test_scores = [[] for _ in self.test_nets]
        self._info("Solver scaffolding done.")
        self._init_buffers()

    # ------------------------------------------------------------ properties
    @property
    def is_root(self):
        return self.collectives.is_root

    def _on_root(self, fn, *args):
        """fn(*args) on rank 0 alone, its result on every rank: files that
        only rank 0 reads (weights, snapshots) need not exist on the other
        hosts.  A CaffeError on rank 0 is raised on every rank together."""
        if self.collectives.size == 1:
            return fn(*args)
        outcome = None
        if self.is_root:
            try:
                outcome = (True, fn(*args))
            except CaffeError as e:
                outcome = (False, str(e))
        ok, value = self.collectives.broadcast_object(outcome)
        if not ok:
            raise AgreedError(value)
        return value

    def _info(self, msg, *args):
        if self.is_root:
            log.info(msg, *args, stacklevel=2)

    def _warn(self, msg, *args):
        if self.is_root:
            log.warning(msg, *args, stacklevel=2)

    # --------------------------------------------------------------- checks
    def _check_param(self):
        p = self.param
        if p.average_loss < 1:
            raise CaffeError("average_loss should be >= 1, got %d" % p.average_loss)
        if p.iter_size < 1:
            raise CaffeError("iter_size should be >= 1, got %d" % p.iter_size)
        if p.weight_decay and p.regularization_type not in ("L1", "L2"):
            raise CaffeError("unknown regularization_type '%s' (L1 or L2)" % p.regularization_type)
        lr_policy.check_policy(p)
        self._check_solver_param()

    def _check_solver_param(self):
        """Solver-type specific sanity checks (overridden)."""

    def _check_snapshot_write_permissions(self):
        p = self.param
        if not (self.is_root and p.snapshot):
            return
        if not p.snapshot_prefix:
            raise CaffeError("snapshot is specified but snapshot_prefix is not")
        probe = self._snapshot_filename(".tempfile")
        try:
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError:
            raise CaffeError("cannot write to snapshot prefix '%s'; make sure that the directory "
                             "exists and is writable" % p.snapshot_prefix) from None

    # ----------------------------------------------------------------- nets
    def _resolve(self, path):
        """A path as given (Caffe: relative to the working directory), else
        relative to the solver file's directory."""
        if os.path.exists(path) or not self.source or os.path.isabs(path):
            return path
        alt = os.path.join(os.path.dirname(self.source), path)
        return alt if os.path.exists(alt) else path

    def _read_net(self, path):
        path = self._resolve(path)
        if not os.path.exists(path):
            raise CaffeError("net file %s does not exist" % path)
        try:
            return proto_io.read_net_param(path), path
        except ProtoError as e:
            raise CaffeError(str(e)) from None

    def _make_net(self, net_param, state, source):
        net_param.state.CopyFrom(state)
        try:
            return Net(net_param, phase=state.phase, level=state.level, stages=list(state.stage),
                       xp=self.xp, source_name=source,
                       data_shard=(self.collectives.rank, self.collectives.size), memory=self.memory)
        except ProtoError as e:
            raise CaffeError(str(e)) from None

    def _init_train_net(self):
        p = self.param
        n = sum(p.HasField(f) for f in ("net", "net_param", "train_net", "train_net_param"))
        fields = "net, net_param, train_net, train_net_param"
        if n < 1:
            raise CaffeError("SolverParameter must specify a train net using one of these fields: " + fields)
        if n > 1:
            raise CaffeError("SolverParameter must not contain more than one of these fields "
                             "specifying a train net: " + fields)
        if p.HasField("train_net_param"):
            self._info("Creating training net specified in train_net_param.")
            net_param, src = caffe_pb2.NetParameter(), "train_net_param"
            net_param.CopyFrom(p.train_net_param)
        elif p.HasField("train_net"):
            self._info("Creating training net from train_net file: %s", p.train_net)
            net_param, src = self._read_net(p.train_net)
        elif p.HasField("net_param"):
            self._info("Creating training net specified in net_param.")
            net_param, src = caffe_pb2.NetParameter(), "net_param"
            net_param.CopyFrom(p.net_param)
        else:
            self._info("Creating training net from net file: %s", p.net)
            net_param, src = self._read_net(p.net)
        state = caffe_pb2.NetState(phase=TRAIN)
        state.MergeFrom(net_param.state)
        state.MergeFrom(p.train_state)
        return self._make_net(net_param, state, src)

    def _init_test_nets(self):
        p = self.param
        has_net_param, has_net_file = p.HasField("net_param"), p.HasField("net")
        generic = has_net_param + has_net_file
        num_specific = len(p.test_net_param) + len(p.test_net)
        if generic:
            if len(p.test_iter) < num_specific:
                raise CaffeError("test_iter must be specified for each test network "
                                 "(%d test_iter for %d test nets)" % (len(p.test_iter), num_specific))
        elif len(p.test_iter) != num_specific:
            if num_specific == 0:
                raise CaffeError("test_iter is given but the solver has no test net "
                                 "(test_net, test_net_param, net or net_param)")
            raise CaffeError("test_iter must be specified for each test network "
                             "(%d test_iter for %d test nets)" % (len(p.test_iter), num_specific))
        num_instances = num_specific + (len(p.test_iter) - num_specific)
        if p.test_state and len(p.test_state) != num_instances:
            raise CaffeError("test_state must be unspecified or specified once per test net "
                             "(%d test_state for %d test nets)" % (len(p.test_state), num_instances))
        if num_instances and p.test_interval <= 0:
            raise CaffeError("test_interval must be > 0 when there are test nets")
        sources, params = [], []
        for tp in p.test_net_param:
            np_ = caffe_pb2.NetParameter()
            np_.CopyFrom(tp)
            sources.append(("test_net_param", "test_net_param"))
            params.append(np_)
        for f in p.test_net:
            np_, path = self._read_net(f)
            sources.append(("test_net file: " + f, path))
            params.append(np_)
        remaining = len(p.test_iter) - len(params)
        for _ in range(max(remaining, 0)):
            if has_net_param:
                np_ = caffe_pb2.NetParameter()
                np_.CopyFrom(p.net_param)
                sources.append(("net_param", "net_param"))
            else:
                np_, path = self._read_net(p.net)
                sources.append(("net file: " + p.net, path))
            params.append(np_)
        nets = []
        for i, (np_, (desc, src)) in enumerate(zip(params, sources)):
            state = caffe_pb2.NetState(phase=TEST)
            state.MergeFrom(np_.state)
            if p.test_state:
                state.MergeFrom(p.test_state[i])
            self._info("Creating test net (#%d) specified by %s", i, desc)
            nets.append(self._make_net(np_, state, src))
        return nets

    def _load_weights(self, path):
        path = self._resolve(path)
        if not os.path.exists(path):
            raise CaffeError("weights file %s does not exist" % path)
        try:
            self.net.copy_from(path)
        except ProtoError as e:
            raise CaffeError(str(e)) from None

    # -------------------------------------------------------------- buffers
    def _init_buffers(self):
        xp, n = self.xp, self.net.param_data.size
        self.history = [xp.zeros(n, np.float32) for _ in range(self.num_history)]
        self._tmp = xp.zeros(n, np.float32)
        # per name: the params' common multiplier, else each param's
        self._mults = {}
        for name, mults in (("rate", self.net.param_lr_mults), ("decay", self.net.param_decay_mults)):
            mults = [f32(m) for m in mults] or [f32(1)]
            self._mults[name] = mults[0] if all(m == mults[0] for m in mults) else mults
        self._scaled = {}       # name -> (factor, the array of its products)
        self._scratch = xp.zeros_like(self._tmp) if self.uses_scratch else None
        # where the update's blocks must begin: a param whose multipliers
        # differ from the one's before it
        mults = list(zip(self.net.param_lr_mults, self.net.param_decay_mults))
        self._mult_starts = [off for p, off in enumerate(self.net.param_offsets) if p and mults[p] != mults[p - 1]]

    def scratch(self):
        """The second scratch buffer of the params' length of the rules
        that need one (``uses_scratch``: Nesterov, AdaDelta; Caffe's
        update_)."""
        return self._scratch

    def _scaled_mults(self, name, factor):
        """``factor`` times each param's multiplier (``name``: rate or decay),
        float32 products as Caffe's local_rate and local_decay, in one array
        of the net's module per name, filled again in place only when
        ``factor`` changes: 0-d when all params share a multiplier, else a
        flat vector of each param's product over its slice.  One buffer: a
        new vector every step would cost a pass over the params and an
        allocation.  In place and an operand (not a kernel's scalar
        argument): a replayed step (a captured CUDA graph) reads the
        current rate from it."""
        factor = f32(factor)
        mults = self._mults[name]
        last, scaled = self._scaled.get(name, (None, None))
        if last == factor:
            return scaled
        if scaled is None:
            scaled = self.xp.empty(self.net.param_data.size if isinstance(mults, list) else (), np.float32)
        if isinstance(mults, list):
            for mult, blob, off in zip(mults, self.net.learnable_params, self.net.param_offsets):
                scaled[off:off + blob.count] = factor * mult
        else:
            scaled[...] = factor * mults
        self._scaled[name] = (factor, scaled)
        return scaled

    # --------------------------------------------------------------- update
    def get_learning_rate(self):
        rate, self.current_step = lr_policy.learning_rate(
            self.param, self.iter, self.current_step, info=self._info)
        return rate

    def clip_gradients(self):
        """Caffe's ClipGradients.  Where reads are deferred (the GPU) the
        device scales by min(1, clip / norm) itself, the same float32
        factor, and the norm's read comes back (a PendingRead) for
        :meth:`apply_update` to log the message once the update is issued:
        reading the norm here would stall the device's queue."""
        clip = float(f32(self.param.clip_gradients))
        if clip < 0:
            return None
        xp, diff = self.xp, self.net.param_diff
        if not defers_reads(xp):
            self._clipped(math.sqrt(float(xp.dot(diff, diff))), clip, diff)
            return None
        norm = xp.sqrt(xp.dot(diff, diff).astype(np.float64))
        diff *= xp.where(norm > clip, (clip / norm).astype(np.float32), np.float32(1))
        return read_later(xp, [norm])

    def _clipped(self, l2norm, clip, diff=None):
        """Caffe's message when the norm exceeds the threshold (and the
        scaling, for ``diff``)."""
        if l2norm > clip:
            scale = f32(clip / l2norm)
            self._info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale factor %s",
                       fmt(l2norm), fmt(clip), fmt(scale))
            if diff is not None:
                diff *= scale

    def normalize(self, block=slice(None)):
        if self.param.iter_size == 1:
            return
        diff = self.net.param_diff[block]
        diff *= f32(1) / f32(self.param.iter_size)

    def regularize(self, block=slice(None)):
        wd = f32(self.param.weight_decay)
        mults = self._mults["decay"]
        if not wd or (not isinstance(mults, list) and not wd * mults):
            return                 # decided on the host: the products are device values
        local_decay = part(self._scaled_mults("decay", wd), block)
        xp, data, diff, tmp = self.xp, self.net.param_data[block], self.net.param_diff[block], self._tmp[block]
        if self.param.regularization_type == "L2":
            xp.multiply(data, local_decay, out=tmp)
        elif self.param.regularization_type == "L1":
            xp.sign(data, out=tmp)
            tmp *= local_decay
        else:
            raise CaffeError("unknown regularization_type '%s'" % self.param.regularization_type)
        diff += tmp

    def compute_update_value(self, rate, block):
        """The rule's update value into ``param_diff[block]`` (``block``: a
        slice of the flat buffers; the rule is elementwise)."""
        raise NotImplementedError

    def local_rate(self, rate, block=slice(None)):
        """Caffe's local_rate of each param (``rate`` times its lr_mult),
        over ``block`` of the flat buffers: a 0-d array where every param
        has the same, else a slice of a flat vector."""
        return part(self._scaled_mults("rate", rate), block)

    @property
    def lr(self):
        """pycaffe's ``solver.lr``: the rate the next update applies (read
        without advancing multistep's step, unlike Caffe's GetLearningRate:
        reading a property should change nothing)."""
        return lr_policy.learning_rate(self.param, self.iter, self.current_step, info=lambda *args: None)[0]

    def apply_update(self):
        """Caffe's ApplyUpdate: the update from the net's gradients as they
        are (step averages them over the ranks first; a script's own loop
        that calls this after net.backward() updates each rank alone)."""
        rate = self.prepare_update()
        norm = self.update_params(rate)
        if norm is not None:
            self._clipped(float(norm.result()[0]), float(f32(self.param.clip_gradients)))
        return rate

    def prepare_update(self):
        """The host's part of the update: the rate (and its display line),
        and the arrays of per-step values the device part reads, filled in
        place where they changed.  Returns the rate."""
        rate = self.get_learning_rate()
        p = self.param
        if p.display and self.iter % p.display == 0:
            self._info("Iteration %d, lr = %s", self.iter, fmt(rate))
        self.local_rate(rate)
        self._scaled_mults("decay", self.param.weight_decay)
        return rate

    def update_params(self, rate):
        """The device's part: clipping, normalisation, regularisation, the
        rule's update value and data -= diff, reading per-step values only
        from the arrays :meth:`prepare_update` filled, so the work can be
        captured once and replayed (solvers/captured.py).  Returns the
        clipping norm's pending read, or None.

        The steps after clipping run block by block over the flat buffers
        (:func:`~caffempi.backend.kernels.flat_blocks`): on the CPU each
        block lies in params of the same multipliers and stays in cache
        through all of them (its rate and decay one value, not a vector
        read), as the steps one by one over the whole buffers went to
        memory and back at every step (CaffeNet's SGD update: about 17
        passes over 244 MB); the rules are elementwise, so the numbers are
        the same bits.  On the GPU one block, the whole buffers."""
        norm = self.clip_gradients()
        kernels.flat_blocks(self.xp, self.net.param_data.size, self.net.param_data.itemsize,
                            lambda block: self._update_block(rate, block), starts=self._mult_starts)
        return norm

    def _update_block(self, rate, block):
        self.normalize(block)
        self.regularize(block)
        self.compute_update_value(rate, block)
        data = self.net.param_data[block]
        data -= self.net.param_diff[block]

    # ----------------------------------------------------------------- loop
    def add_callback(self, on_start, on_gradients_ready):
        """pycaffe's ``solver.add_callback`` (Caffe's Solver::Callback):
        every iteration of :meth:`step` calls ``on_start()`` before its
        forward/backward passes (after a test pass due then) and
        ``on_gradients_ready()`` after them, once the gradients are averaged
        over the ranks, before the update (which applies what ``param_diff``
        then holds); callbacks run in the order added."""
        for name, fn in (("on_start", on_start), ("on_gradients_ready", on_gradients_ready)):
            if not callable(fn):
                raise CaffeError("add_callback: %s must be callable, got %r" % (name, fn))
        self.callbacks.append((on_start, on_gradients_ready))

    def share_weights(self, net):
        """pycaffe's ``solver.share_weights(net)``: ``net``'s layers use the
        train net's parameter blobs of the same layer names (Net.share_with)."""
        net.share_with(self.net)

    def set_action_function(self, fn):
        """``fn()`` -> SolverAction value, polled once every iteration
        (before its gradient sums; acted on after its update) and test
        batch (Caffe's SetActionFunction; the CLI's signal handler)."""
        self.action_function = fn

    def _requested_action(self):
        return self.collectives.combine_action(self._polled_action())

    def _polled_action(self):
        return self.action_function() if self.action_function else SolverAction.NONE

    def _update_smoothed_loss(self, loss):
        avg = self.param.average_loss
        if len(self._losses) < avg:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = (self.smoothed_loss * (size - 1) + loss) / size
        else:
            idx = (self.iter - self._loss_base) % avg
            self.smoothed_loss += (loss - self._losses[idx]) / avg
            self._losses[idx] = loss

    def _check_finite_loss(self, loss, diverged):
        """Stop every rank at this iteration, before any weight changes, if
        the loss of any rank is not finite (``diverged``: whether one is,
        as the ranks agreed)."""
        mine = None
        if not math.isfinite(loss):
            mine = {"loss": fmt(loss), "layer": self.net.first_nonfinite_layer()}
        bad = self.collectives.diverged_ranks(mine, diverged)
        if not bad:
            return
        rank, info = bad[0]
        where = ("first non-finite output in layer '%s'" % info["layer"]) if info["layer"] else \
            "no layer output is non-finite (check the loss weights)"
        if self.collectives.size == 1:
            raise AgreedError("Iteration %d: training diverged, loss = %s (%s); stopped without "
                              "updating the weights or writing a snapshot" % (self.iter, info["loss"], where))
        raise AgreedError("Iteration %d: training diverged on rank%s %s (rank %d: loss = %s, %s); all %d "
                          "ranks stopped without updating the weights or writing a snapshot"
                          % (self.iter, "s" if len(bad) > 1 else "", ", ".join(str(r) for r, _ in bad),
                             rank, info["loss"], where, self.collectives.size))

    def _display(self, lapse):
        p, net = self.param, self.net
        outputs = net.output_values(share_weighted=True)
        flat = [float(v) for _, vals, _ in outputs for v in to_numpy(vals).ravel()]
        combined = self.collectives.mean_scalars([self.smoothed_loss] + flat)
        if not self.is_root:
            return
        per_s = (self.iter - self._iterations_last) / (lapse if lapse else 1.0)
        log.info("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter, fmt(per_s),
                 fmt(lapse), p.display, fmt(combined[0]))
        k, idx = 0, 1
        for name, vals, w in outputs:
            for _ in range(int(np.size(vals))):
                v = combined[idx]
                idx += 1
                log.info("    Train net output #%d: %s = %s%s", k, name, fmt(v), loss_suffix(w, v))
                k += 1
        # Time forward spent waiting for the data layers' prefetch queues.
        waited = net.data_wait_seconds()
        since, self._wait_last = waited - self._wait_last, waited
        if lapse and self.iter > self._iterations_last:
            log.info("    Data wait: %.3f ms/iter (%.2f%% of the step time)",
                     1e3 * since / (self.iter - self._iterations_last), 100.0 * since / lapse)

    def step(self, iters):
        """Run ``iters`` training iterations (Caffe's Solver::Step)."""
        p, net, sync = self.param, self.net, self.sync
        start_iter = self.iter
        stop_iter = self.iter + int(iters)
        if self._pending_window is not None:
            self._losses, self.smoothed_loss, self._loss_base = self._pending_window
            self._pending_window = None
        else:
            self._losses, self.smoothed_loss, self._loss_base = [], 0.0, start_iter
        if not self._params_synced:
            sync.on_start(net)
            self._params_synced = True
        if self._pending_sync_state is not None:
            sync.attach(net, iter_size=p.iter_size)     # the state is the attached net's
            sync.load_state(self._pending_sync_state)
            self._pending_sync_state = None
        timer = time.time()
        self._iterations_last = self.iter
        self._wait_last = net.data_wait_seconds()
        iter_size = p.iter_size
        if config.settings.cuda_graph and self.captured is None:
            self.captured = CapturedSteps(self)
        captured = self.captured if config.settings.cuda_graph else None
        while self.iter < stop_iter:
            net.clear_param_diffs()
            if p.test_interval and self.iter % p.test_interval == 0 and \
                    (self.iter > 0 or p.test_initialization):
                self.test_all()
                if self.requested_early_exit:
                    break
            for on_start, _ in self.callbacks:
                on_start()
            display = p.display and self.iter % p.display == 0
            sync.start_iteration(net, iter_size)
            replay = captured is not None and captured.ready()
            if replay:
                loss = captured.passes()
            else:
                passes = []
                for i in range(iter_size):
                    sync.before_pass(net, i, i == iter_size - 1)
                    # the strategy's sums progress between the kernels' chunks
                    with threads.progress(sync.progress):
                        passes.append(net.forward_backward(pending=True))
                loss = 0.0
                for pending in passes:      # read once backward is issued (Net.PendingLoss)
                    loss += pending.result()
                loss /= iter_size
                if captured is not None:
                    captured.ran_eagerly()
            # the ranks' agreement (divergence, signals) travels with the
            # sums; finish first: no allreduce is left pending if they stop here
            agreement = self.collectives.start_agreement(not math.isfinite(loss), self._polled_action())
            sync.finish(net)
            diverged, request = agreement()
            self._check_finite_loss(loss, diverged)
            self._update_smoothed_loss(loss)
            if display:
                now = time.time()
                self._display(now - timer)
                timer = now
                self._iterations_last = self.iter
            for _, on_gradients_ready in self.callbacks:
                on_gradients_ready()
            if replay and captured.ready():
                captured.update()
            else:
                self.apply_update()
            sync.after_update(net)
            self.iter += 1
            if (p.snapshot and self.iter % p.snapshot == 0) or SolverAction.snapshots(request):
                self.snapshot()
            if SolverAction.stops(request):
                self.requested_early_exit = True
                break

    def solve(self, resume_file=None):
        """Train to max_iter (Caffe's Solver::Solve), optionally resuming."""
        p = self.param
        self._info("Solving %s", self.net.name)
        self._info("Learning Rate Policy: %s", p.lr_policy)
        self.requested_early_exit = False
        if resume_file:
            self._info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0) \
                and self._snapshot_iter != self.iter:
            self.snapshot()
        if self.requested_early_exit:
            self._info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            loss = self.net.forward_range()
            self._update_smoothed_loss(loss)
            smoothed = self.collectives.mean_scalars([self.smoothed_loss])[0]
            self._info("Iteration %d, loss = %s", self.iter, fmt(smoothed))
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        self._info("Optimization Done.")

    # -------------------------------------------------------------- testing
    def test_all(self):
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, test_net_id=0, iterations=None):
        """One test pass of test net ``test_net_id`` (Caffe's Solver::Test).

        ``iterations`` is this rank's number of batches (default
        ``collectives.split_test_iters(test_iter)``); the scores, loss and
        batch counts of all ranks are summed and the means logged by rank 0.
        Returns the mean scores."""
        p = self.param
        self._info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        self.sync.synchronize_model(self.net, self.history)
        test_net = self.test_nets[test_net_id]
        total = p.test_iter[test_net_id]
        n = self.collectives.split_test_iters(total) if iterations is None else int(iterations)
        outputs = test_net.output_values()
        sizes = [int(np.size(vals)) for _, vals, _ in outputs]
        scores = [0.0] * sum(sizes)
        loss = 0.0
        start = last = time.time()
        done = 0
        for i in range(n):
            request = self._requested_action()
            while request != SolverAction.NONE:
                if SolverAction.snapshots(request):
                    self.snapshot()
                if SolverAction.stops(request):
                    self.requested_early_exit = True
                request = self._requested_action()
            if self.requested_early_exit:
                break
            iter_loss = test_net.forward_range()
            if p.test_compute_loss:
                loss += iter_loss
            idx = 0
            for _, vals, _ in test_net.output_values():
                for v in to_numpy(vals).ravel():
                    scores[idx] += float(v)
                    idx += 1
            done += 1
            now = time.time()
            if now - last > 5.0 and i + 1 < n:
                self._info("Test net (#%d): %d/%d batches (%.1fs)", test_net_id, i + 1, n, now - start)
                last = now
        if self.requested_early_exit:
            self._info("Test interrupted.")
            return None
        sums = self.collectives.sum_scalars(scores + [loss, float(done)])
        count = sums[-1] or 1.0
        if p.test_compute_loss:
            self._info("Test loss: %s", fmt(sums[-2] / count))
        means = [s / count for s in sums[:-2]]
        self.test_scores[test_net_id] = means
        k = 0
        for name, vals, w in outputs:
            for _ in range(int(np.size(vals))):
                m = means[k]
                self._info("    Test net output #%d: %s = %s%s", k, name, fmt(m), loss_suffix(w, m))
                k += 1
        return means

    # ------------------------------------------------------------ snapshots
    def _snapshot_filename(self, ext):
        return "%s_iter_%d%s" % (self.param.snapshot_prefix, self.iter, ext)

    def _check_finite_weights(self):
        xp, net = self.xp, self.net
        if bool(xp.isfinite(net.param_data).all()):
            return
        bad = "?"
        for blob, name in zip(net.learnable_params, net.param_owner_names):
            if not bool(xp.isfinite(blob.data).all()):
                bad = name
                break
        raise CaffeError("Iteration %d: weights of %s are not finite; refusing to write a snapshot "
                         "(earlier snapshots are kept)" % (self.iter, bad))

    def _extra_state(self):
        """Our additions to SolverState, on rank 0: (JSON for field
        caffempi_state, the arrays for caffempi_blobs).  Each rank's
        gradient-strategy state keeps its arrays in the blobs, its JSON
        naming them ({"blob": index} within the rank's ``sync_blobs``
        [start, count])."""
        window = {"losses": list(self._losses), "smoothed": self.smoothed_loss, "base": self._loss_base}
        arrays = []
        mine = {"rng": _rng_state_to_json(common.get_rng_state()),
                "train_data": self.net.data_state(),
                "test_data": [tn.data_state() for tn in self.test_nets],
                "loss_window": window,
                "sync": _arrays_out(self.sync.state(), arrays)}
        gathered = self.collectives.gather_object((mine, arrays))
        if gathered is None:
            return None, None
        ranks, blobs = [], []
        for state, own in gathered:
            state["sync_blobs"] = [len(blobs), len(own)]
            ranks.append(state)
            blobs.extend(own)
        return {"version": 1, "ranks": ranks, "loss_window": window}, blobs

    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel (or .caffemodel.h5) and the
        matching .solverstate atomically (rank 0); returns the model path."""
        p = self.param
        self.sync.synchronize_model(self.net, self.history)
        self._check_finite_weights()
        self._snapshot_iter = self.iter
        extra, blobs = self._extra_state()
        if not self.is_root:
            return None
        if not p.snapshot_prefix:
            raise CaffeError("cannot snapshot: snapshot_prefix is not set")
        try:
            if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
                model = self._snapshot_filename(".caffemodel.h5")
                self._info("Snapshotting to HDF5 file %s", model)
                self.net.save_hdf5(model, p.snapshot_diff)
                self._snapshot_state_hdf5(model, extra, blobs)
            else:
                model = self._snapshot_filename(".caffemodel")
                self._info("Snapshotting to binary proto file %s", model)
                self.net.save(model, p.snapshot_diff)
                self._snapshot_state_binary(model, extra, blobs)
        except ProtoError as e:
            raise CaffeError(str(e)) from None
        return model

    def _history_arrays(self):
        """(buffer index, param index, array shaped as the param) in Caffe's
        order: all params of history set 0, then set 1, ..."""
        net = self.net
        for h, buf in enumerate(self.history):
            for i, (blob, off) in enumerate(zip(net.learnable_params, net.param_offsets)):
                yield h, i, to_numpy(buf[off:off + blob.count]).reshape(blob.shape)

    def _snapshot_state_binary(self, model, extra, blobs):
        state = caffe_pb2.SolverState()
        state.iter = self.iter
        state.learned_net = model
        state.current_step = self.current_step
        for _, _, arr in self._history_arrays():
            proto_io.array_to_blob_proto(arr, state.history.add())
        state.caffempi_state = json.dumps(extra).encode("utf-8")
        for arr in blobs:
            proto_io.array_to_blob_proto(arr, state.caffempi_blobs.add())
        path = self._snapshot_filename(".solverstate")
        self._info("Snapshotting solver state to binary proto file %s", path)
        proto_io.write_binary_proto_atomic(path, state)

    def _snapshot_state_hdf5(self, model, extra, blobs):
        import h5py
        path = self._snapshot_filename(".solverstate.h5")
        self._info("Snapshotting solver state to HDF5 file %s", path)
        with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
            f.create_dataset("iter", data=np.array([self.iter], np.int32))
            f.create_dataset("learned_net", data=np.bytes_(model.encode("utf-8")))
            f.create_dataset("current_step", data=np.array([self.current_step], np.int32))
            g = f.create_group("history")
            for k, (_, _, arr) in enumerate(self._history_arrays()):
                g.create_dataset(str(k), data=arr)
            f.attrs["caffempi_state"] = json.dumps(extra)
            if blobs:
                g = f.create_group("caffempi_blobs")
                for k, arr in enumerate(blobs):
                    g.create_dataset(str(k), data=arr)

    # -------------------------------------------------------------- restore
    def restore(self, path):
        """Resume from a .solverstate (binary, ours or Caffe's) or a
        .solverstate.h5: iteration, weights (learned_net), history,
        current_step and, from our snapshots, data position and random state.
        Rank 0 reads the files and sends the other ranks their part."""
        path = os.fspath(path)
        it, step, extra = self._on_root(self._load_state, path)
        self.collectives.broadcast_arrays([self.net.param_data] + list(self.history))
        self.iter = it
        self.current_step = step
        if extra:
            self._restore_extra(json.loads(extra), path)
        self._loaded_blobs = None

    def _load_state(self, path):
        """Read a solver state into this rank's weights and history; returns
        (iter, current_step, our JSON extra or None)."""
        if not os.path.exists(path):
            raise CaffeError("solver state file %s does not exist" % path)
        if path.endswith(".h5"):
            it, learned, step, hist, extra, blobs = self._read_state_hdf5(path)
        else:
            try:
                state = proto_io.read_binary_proto(path, caffe_pb2.SolverState)
            except ProtoError as e:
                raise CaffeError(str(e)) from None
            it, step = state.iter, state.current_step
            learned = state.learned_net if state.HasField("learned_net") else None
            hist = state.history
            extra = state.caffempi_state.decode("utf-8") if state.HasField("caffempi_state") else None
            try:
                blobs = [proto_io.blob_proto_to_array(b) for b in state.caffempi_blobs]
            except ProtoError as e:
                raise CaffeError("%s: caffempi_blobs: %s" % (path, e)) from None
        if learned:
            model = self._find_learned_net(learned, path)
            try:
                self.net.copy_from(model)
            except ProtoError as e:
                raise CaffeError("%s (learned_net of %s)" % (e, path)) from None
        self._restore_history(hist, path)
        self._loaded_blobs = blobs        # rank 0's, for each rank's part (_restore_extra)
        return int(it), int(step), extra

    def _find_learned_net(self, learned, state_path):
        if os.path.exists(learned):
            return learned
        alt = os.path.join(os.path.dirname(state_path), os.path.basename(learned))
        if os.path.exists(alt):
            return alt
        raise CaffeError("%s: its learned_net %s does not exist" % (state_path, learned))

    def _read_state_hdf5(self, path):
        import h5py
        with h5py.File(path, "r") as f:
            def scalar(name, default=0):
                return int(np.asarray(f[name]).reshape(-1)[0]) if name in f else default
            learned = None
            if "learned_net" in f:
                raw = np.asarray(f["learned_net"]).reshape(-1)[0] if np.asarray(f["learned_net"]).shape \
                    else f["learned_net"][()]
                learned = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
                learned = learned.rstrip("\x00")
            hist = []
            if "history" in f:
                g = f["history"]
                hist = [np.asarray(g[str(k)], np.float32) for k in range(len(g))]
            extra = f.attrs.get("caffempi_state")
            if isinstance(extra, bytes):
                extra = extra.decode("utf-8")
            g = f.get("caffempi_blobs")
            blobs = [np.asarray(g[str(k)]) for k in range(len(g))] if g is not None else []
            return scalar("iter"), learned, scalar("current_step"), hist, extra, blobs

    def _restore_history(self, hist, path):
        net = self.net
        nparams = len(net.learnable_params)
        if len(hist) != nparams * self.num_history:
            raise CaffeError("%s: %d history blobs, the %s solver for this net needs %d "
                             "(%d learnable params x %d)" % (path, len(hist), self.type,
                                                             nparams * self.num_history,
                                                             nparams, self.num_history))
        for k, h in enumerate(hist):
            which, i = divmod(k, nparams)
            blob, off = net.learnable_params[i], net.param_offsets[i]
            if isinstance(h, caffe_pb2.BlobProto):
                try:
                    arr = proto_io.blob_proto_to_array(h)
                except ProtoError as e:
                    raise CaffeError("%s: history %d: %s" % (path, k, e)) from None
            else:
                arr = np.asarray(h, np.float32)
            if arr.size != blob.count:
                raise CaffeError("%s: history %d (param %s) has shape %s, the param has shape %s"
                                 % (path, k, net.param_owner_names[i], tuple(arr.shape), blob.shape))
            self.history[which][off:off + blob.count] = self.xp.asarray(arr.reshape(-1), np.float32)

    def _restore_extra(self, extra, path):
        def set_window(lw):
            if lw:
                self._pending_window = ([float(v) for v in lw["losses"]], float(lw["smoothed"]),
                                        int(lw["base"]))
        set_window(extra.get("loss_window"))
        ranks = extra.get("ranks") or []
        if len(ranks) != self.collectives.size:
            self._warn("%s was written by %d process(es), this run has %d: data position, random state "
                       "and each rank's gradient state (low rank's error) not restored", path, len(ranks),
                       self.collectives.size)
            return
        mine = ranks[self.collectives.rank]
        set_window(mine.get("loss_window"))
        if any(r.get("sync") is not None for r in ranks):
            parts = None
            if self.is_root:
                parts = [self._loaded_blobs[r["sync_blobs"][0]:sum(r["sync_blobs"])] for r in ranks]
            self._pending_sync_state = _arrays_in(mine.get("sync"), self.collectives.scatter_object(parts))
        if mine.get("rng"):
            common.set_rng_state(_rng_state_from_json(mine["rng"]))
        self.net.set_data_state(mine.get("train_data") or {})
        for tn, st in zip(self.test_nets, mine.get("test_data") or []):
            tn.set_data_state(st or {})


def _arrays_out(obj, arrays):
    """``obj`` (dicts, lists, scalars, NumPy arrays) with each array moved to
    ``arrays`` and replaced by {"blob": its index}: JSON for a snapshot."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return {"blob": len(arrays) - 1}
    if isinstance(obj, dict):
        return {k: _arrays_out(v, arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_arrays_out(v, arrays) for v in obj]
    return obj


def _arrays_in(obj, arrays):
    """The inverse of :func:`_arrays_out`."""
    if isinstance(obj, dict):
        if set(obj) == {"blob"}:
            return arrays[obj["blob"]]
        return {k: _arrays_in(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_arrays_in(v, arrays) for v in obj]
    return obj
