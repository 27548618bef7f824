"""Gradient averaging across ranks: layer-bucketed allreduce overlapped with
backward (Poseidon's wait-free backprop), or one blocking allreduce.

The net keeps every learnable parameter's gradient in one flat buffer,
``net.param_diff``, in layer order.  The reducer groups whole layers, taken
in *reverse* layer order, into buckets (contiguous ranges of that buffer).
A bucket is complete once the backward of its lowest layer has run (shared
parameters belong to their earliest layer, so nothing writes into a bucket
after that); the net's backward hook then starts a non-blocking sum over
ranks on it.  ``finish`` waits for all buckets.  The sums are already means:
the reducer sets the net's ``gradient_scale`` to 1/N, so backward produces
each rank's gradient divided by N (no pass over the buffer after the wait).

The network is reached only through a *transport* (the GPU seam):

    handle = transport.allreduce_start(buf)   # sum over ranks, in place
    transport.poll()                           # give the MPI a chance to progress
    transport.wait(handle)

For host (NumPy) buffers, :mod:`caffempi.parallel.shm_transport` sums in
shared memory when every rank is on one host, and ``MPIHostTransport``
through MPI; for device (CuPy) buffers, :mod:`caffempi.parallel.gpu_transport`
has NCCL and MPI-through-pinned-host-copies.  The transport is chosen when the reducer
meets the net, from ``--comm`` and the net's array module.

Modes (``--comm``):
  auto      the default: for CPU nets shm when every rank is on one host,
            otherwise overlap; for GPU nets nccl when NCCL can join the
            ranks, otherwise overlap
  shm       ranks on one host: each bucket summed in shared memory by
            whichever rank is waiting (shm_transport.py), no MPI messages
  blocking  one Allreduce of the whole gradient after backward (baseline)
  overlap   Iallreduce per bucket, MPI_Testall between layers and between
            the chunks of a CPU kernel (threads.set_progress)
  thread    a communication thread runs a blocking Allreduce per bucket
            (MPI_THREAD_MULTIPLE; the GIL is released inside MPI and BLAS)
  async     Iallreduce per bucket, progress left to MPICH's own progress
            thread (MPIR_CVAR_ASYNC_PROGRESS=1, set before MPI_Init)
  nopoll    Iallreduce per bucket, no polling (shows what MPI does alone)
  nccl      GPU nets: NCCL allreduce per bucket on a side stream
"""
import os
import queue
import threading
import time

import numpy as np

from ..backend import threads, to_numpy
from ..common import CaffeError, log

COMM_MODES = ("auto", "shm", "overlap", "blocking", "thread", "async", "nopoll", "nccl")
_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))
# Measured on this 2-core machine (benchmarks/scaling.py; README, "Scaling"):
# LeNet's 1.7 MB of gradients in one or two buckets is best; 4 MB behaves the
# same on CIFAR10-quick.  DDP's small first bucket starts the first message early.
DEFAULT_BUCKET_MB = 4.0
DEFAULT_FIRST_BUCKET_MB = 1.0


# ----------------------------------------------------------------- transports
class LocalTransport:
    """One rank: nothing to do."""
    name = "local"
    device_buffers = True

    def allreduce_start(self, buf):
        return None

    def poll(self):
        return True

    def wait(self, handle):
        pass

    def allreduce(self, buf):
        pass

    def backward_end(self):
        pass

    def close(self):
        pass


class MPIHostTransport:
    """Sum over ranks of NumPy buffers with MPI (non-blocking, or a thread)."""
    device_buffers = False     # a CUDA-aware MPI / NCCL transport sets True

    def __init__(self, world, mode="overlap"):
        self.world = world
        self.MPI = world.MPI
        # Gradient traffic gets its own communicator: the solver's blocking
        # collectives (displayed losses, actions) on COMM_WORLD may then run
        # while buckets are in flight, from another thread too (--comm=thread).
        self.comm = world.comm.Dup()
        self.mode = mode
        self.name = "mpi-host-" + mode
        self._pending = []
        self.comm_seconds = 0.0          # time inside blocking Allreduce calls
        self._thread = None
        if mode == "thread":
            if world.thread_level < self.MPI.THREAD_MULTIPLE:
                raise CaffeError("--comm=thread needs MPI_THREAD_MULTIPLE; this MPI gives level %d"
                                 % world.thread_level)
            self._queue = queue.Queue()
            self._error = None
            self._thread = threading.Thread(target=self._run, name="caffempi-comm", daemon=True)
            self._thread.start()

    # -- blocking
    def allreduce(self, buf):
        t = time.perf_counter()
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        self.comm_seconds += time.perf_counter() - t

    # -- non-blocking
    def allreduce_start(self, buf):
        if self.mode == "thread":
            done = threading.Event()
            self._queue.put((buf, done))
            return done
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        self._pending.append(req)
        if self.mode == "overlap":
            self.MPI.Request.Testall(self._pending)
            # a long layer (LeNet's conv2: a third of backward) would
            # otherwise leave the sum idle until its end
            threads.set_progress(self.poll)
        return req

    def backward_end(self):
        if self.mode == "overlap":
            threads.set_progress(None)

    def poll(self):
        if self.mode == "overlap" and self._pending:
            if self.MPI.Request.Testall(self._pending):
                self._pending = []
        return not self._pending

    def wait(self, handle):
        if self.mode == "thread":
            handle.wait()
            if self._error is not None:
                raise self._error
            return
        # Poll, yielding the core (and the GIL) between polls to whatever
        # else wants it, such as this rank's data readers.  Sleeping between
        # polls instead woke up late: on LeNet the wait outlasted the slower
        # rank's backward by 0.08-0.25 ms, against 0.01-0.035 ms yielding;
        # plain spinning would starve the readers.
        while not handle.Test():
            _yield_core()
        self._pending = [r for r in self._pending if r != self.MPI.REQUEST_NULL]

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, done = item
            try:
                self.allreduce(buf)
            except BaseException as e:  # reported to the waiting thread
                self._error = e
            done.set()

    def close(self):
        self.backward_end()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self.comm is not None:
            try:
                self.comm.Free()
            except Exception:
                pass
            self.comm = None


def make_transport(world, mode="overlap", xp=np, nbytes=0):
    """The transport for ``--comm=mode`` and buffers of array module ``xp``,
    at most ``nbytes`` of them summed per iteration (collective: every rank
    must call it)."""
    if mode not in COMM_MODES:
        raise CaffeError("unknown --comm '%s' (one of %s)" % (mode, ", ".join(COMM_MODES)))
    if world.size == 1:
        return LocalTransport()
    if xp is np:
        if mode == "nccl":
            raise CaffeError("--comm=nccl needs GPU nets (--gpu)")
        if mode in ("auto", "shm"):
            from . import shm_transport
            transport = shm_transport.make(world, nbytes, mode == "shm")
            if transport is not None:
                return transport
            mode = "overlap"
        return MPIHostTransport(world, mode)
    if mode == "shm":
        raise CaffeError("--comm=shm needs CPU nets (GPU nets: nccl, or overlap through pinned host copies)")
    from . import gpu_transport
    if mode in ("auto", "nccl"):
        reason = gpu_transport.nccl_unavailable_reason(world)
        if reason is None:
            return gpu_transport.NCCLTransport(world)
        if mode == "nccl":
            raise CaffeError("--comm=nccl: %s" % reason)
        if world.rank == 0:
            log.warning("NCCL not used (%s): gradients go through host memory and MPI", reason)
        mode = "overlap"
    return gpu_transport.StagedTransport(MPIHostTransport(world, mode))


# -------------------------------------------------------------------- buckets
def layer_param_ranges(net):
    """{layer index: (start, end)} of the flat-buffer range each layer owns."""
    ranges = {}
    for p, li in enumerate(net.param_layer_index):
        s = net.param_offsets[p]
        e = s + net.learnable_params[p].count
        if li in ranges:
            ranges[li] = (min(ranges[li][0], s), max(ranges[li][1], e))
        else:
            ranges[li] = (s, e)
    return ranges


def group_buckets(nbytes, bucket_mb=DEFAULT_BUCKET_MB, first_bucket_mb=DEFAULT_FIRST_BUCKET_MB):
    """The bucket rule, on the byte sizes of the layers with parameters in
    reverse layer order: lists of positions in ``nbytes``, one per bucket.
    The first bucket closes at first_bucket_mb, the others at bucket_mb
    (None: never), and the lowest layer always has a bucket of its own: its
    gradient is final only when backward ends, so its sum is never hidden
    (LeNet: conv2's bucket then starts under pool1's and conv1's backward).
    tools/scaling_model.py models the reducer with the same rule."""
    groups, cur, size = [], [], 0
    cap = first_bucket_mb
    for i, b in enumerate(nbytes):
        cur.append(i)
        size += b
        if cap is not None and size >= cap * 2 ** 20:
            groups.append(cur)
            cur, size, cap = [], 0, bucket_mb
    if cur:
        groups.append(cur)
    if groups and len(groups[-1]) > 1:
        groups.append([groups[-1].pop()])
    return groups


def make_buckets(net, bucket_mb=DEFAULT_BUCKET_MB, first_bucket_mb=DEFAULT_FIRST_BUCKET_MB):
    """Buckets of whole layers in reverse layer order (:func:`group_buckets`):
    list of (ready_layer, start, end, layer indices); ready_layer is the
    bucket's lowest layer, after whose backward the bucket's gradients are
    final."""
    itemsize = np.dtype(net.dtype).itemsize
    ranges = layer_param_ranges(net)
    order = sorted(ranges, reverse=True)
    out = []
    for group in group_buckets([(ranges[li][1] - ranges[li][0]) * itemsize for li in order],
                               bucket_mb, first_bucket_mb):
        layers = [order[i] for i in group]
        lo, hi = min(layers), max(layers)
        out.append((lo, ranges[lo][0], ranges[hi][1], layers))
    return out


# -------------------------------------------------------------------- reducer
class Reducer:
    """The solver's seam to data parallelism.

    start_iteration(net)   before the iteration's forward/backward passes
    finish(net)            after the last backward: gradients are averaged
    diverged_ranks(info)   the ranks whose loss is not finite, agreed by all
    synchronize_model(net, history)  before tests and snapshots (no-op here)
    mean_scalars(values)   mean over ranks of displayed numbers
    test_share(test_iter)  how many test iterations this rank runs
    combine_test(sums, n)  test scores over all ranks' batches
    """

    def __init__(self, world, comm="overlap", bucket_mb=DEFAULT_BUCKET_MB,
                 first_bucket_mb=DEFAULT_FIRST_BUCKET_MB, transport=None):
        self.world = world
        self.size = world.size
        self.rank = world.rank
        self.is_root = world.rank == 0
        self.comm = comm if world.size > 1 else "local"
        self.bucket_mb = bucket_mb
        self.first_bucket_mb = first_bucket_mb
        self.transport = transport       # made in attach(), for the net's buffers
        self.iter_size = 1
        self.net = None
        self.buckets = []
        self._ready = {}
        self._handles = []
        self._pass = 0
        self._armed = False
        self._explicit = False
        self._warned_test = set()
        # timings of the last iteration (seconds)
        self.last_exposed = 0.0       # wait in finish() after backward
        self.last_comm = 0.0          # time inside blocking allreduce calls
        self.total_exposed = 0.0
        self.iterations = 0

    @property
    def active(self):
        return self.size > 1

    # --------------------------------------------------------------- set-up
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
        net.gradient_scale = 1.0 / self.size     # the sums are then means
        if self.transport is None:
            self.transport = make_transport(self.world, self.comm, net.xp, net.param_diff.nbytes)
        if not isinstance(net.param_diff, np.ndarray) and not self.transport.device_buffers:
            raise CaffeError("the %s transport needs host (NumPy) gradient buffers" % self.transport.name)
        if self.comm != "blocking":
            self.buckets = make_buckets(net, self.bucket_mb, self.first_bucket_mb)
            self._ready = {b[0]: k for k, b in enumerate(self.buckets)}
            net.add_backward_hook(self._hook)
        if self.is_root:
            desc = ("one blocking allreduce of %.2f MB" % (net.param_diff.nbytes / 2 ** 20)
                    if self.comm == "blocking" else
                    "%d bucket(s) of %s MB" % (len(self.buckets), ", ".join(
                        "%.2f" % ((b[2] - b[1]) * net.param_diff.itemsize / 2 ** 20) for b in self.buckets)))
            log.info("Data parallel over %d ranks (%s): %s", self.size, self.transport.name, desc)

    def detach(self):
        if self.net is not None:
            self.net.gradient_scale = 1.0
            if self.buckets:
                try:
                    self.net.remove_backward_hook(self._hook)
                except ValueError:
                    pass
        self.net = None
        self.buckets = []

    def close(self):
        self.detach()
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ iteration
    def start_iteration(self, net, iter_size=None):
        if iter_size is not None:
            self.iter_size = max(1, int(iter_size))
        if self.net is not net:
            self.attach(net, self.iter_size)
        self._pass = 0
        self._explicit = False
        self._armed = self.iter_size == 1
        self._handles = []
        self._comm0 = getattr(self.transport, "comm_seconds", 0.0)

    def before_pass(self, net, index, last):
        """The solver says which forward/backward pass is the iteration's
        last: only its backward starts the allreduces."""
        self._explicit = True
        self._armed = bool(last)

    def _hook(self, layer_index):
        if layer_index == self._top_layer and not self._explicit:
            self._pass += 1                      # first hook of a backward pass
            self._armed = self._pass >= self.iter_size
        if not self._armed:
            return
        k = self._ready.get(layer_index)
        if k is None:
            self.transport.poll()
            return
        _, s, e, _ = self.buckets[k]
        self._handles.append(self.transport.allreduce_start(self.net.param_diff[s:e]))

    def finish(self, net):
        """Wait for the sums (means: backward ran with the net's
        gradient_scale at 1/N); returns the exposed seconds."""
        t0 = time.perf_counter()
        if self.active:
            self.transport.backward_end()
            if self.comm == "blocking":
                self.transport.allreduce(net.param_diff)
            else:
                if len(self._handles) != len(self.buckets):
                    # backward ran fewer passes than iter_size said, or was
                    # not hooked: reduce what is left, in bucket order
                    started = len(self._handles)
                    for _, s, e, _ in self.buckets[started:]:
                        self._handles.append(self.transport.allreduce_start(net.param_diff[s:e]))
                for h in self._handles:
                    self.transport.wait(h)
        self._handles = []
        self._armed = False
        self.last_exposed = time.perf_counter() - t0
        self.last_comm = getattr(self.transport, "comm_seconds", 0.0) - getattr(self, "_comm0", 0.0)
        self.total_exposed += self.last_exposed
        self.iterations += 1
        return self.last_exposed

    # ----------------------------------------------------------- scalars
    def mean_scalars(self, values):
        """Mean over ranks (the loss of the global batch); list of floats."""
        values = [float(v) for v in values]
        if not self.active or not values:
            return values
        return [float(v) / self.size for v in self.world.allreduce_scalars(values)]

    def sum_scalars(self, values):
        values = [float(v) for v in values]
        if not self.active or not values:
            return values
        return [float(v) for v in self.world.allreduce_scalars(values)]

    def any(self, flag):
        """True on every rank if flag is true on any rank."""
        return self.world.any(flag) if self.active else bool(flag)

    def diverged_ranks(self, info):
        """[(rank, info)] of the ranks whose info is not None (their loss is
        not finite), the same on every rank: one scalar allreduce per
        iteration; the descriptions are gathered only when some rank has one."""
        if not self.any(info is not None):
            return []
        return [(r, i) for r, i in enumerate(self.world.allgather(info)) if i is not None]

    def combine_action(self, action):
        """The signal action all ranks take (SIGINT/SIGHUP reach the ranks at
        different moments): STOP if any rank asks to stop, else SNAPSHOT if
        any asks for one, else NONE (Caffe's SolverAction values 1 and 2)."""
        if not self.active:
            return action
        stop, snap = self.world.allreduce_scalars([1.0 if action == 1 else 0.0,
                                                   1.0 if action == 2 else 0.0], "max")
        return 1 if stop else (2 if snap else 0)

    def gather_object(self, obj):
        """Per-rank objects in rank order on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        return self.world.comm.gather(obj, root=0)

    def broadcast_object(self, obj):
        return self.world.bcast(obj, 0) if self.active else obj

    def broadcast_arrays(self, arrays):
        if self.active:
            for a in arrays:
                self.world.bcast_array(a, 0)

    def split_test_iters(self, n):
        return self.test_share(n)

    # -------------------------------------------------------------- testing
    def test_share(self, test_iter):
        """Test iterations this rank runs: ceil(test_iter / N) on every rank.
        With the data sharding (record i to rank i mod N) and N dividing
        test_iter, the ranks together test exactly the records one process
        would.  Otherwise every rank still runs the same count (the solver
        polls signal actions collectively per test batch, so unequal counts
        would mismatch collectives): N*ceil(test_iter/N) batches are tested,
        a little more than one process would, and rank 0 warns once."""
        n = -(-int(test_iter) // self.size)
        if self.size > 1 and int(test_iter) % self.size and self.is_root \
                and test_iter not in self._warned_test:
            self._warned_test.add(test_iter)
            log.warning("test_iter %d is not a multiple of the %d ranks: testing %d batches "
                        "(%d per rank)", test_iter, self.size, n * self.size, n)
        return n

    def combine_test(self, sums, count):
        """sums: per-output sums of the batch values over this rank's count
        test iterations.  Returns (per-output means over all batches of all
        ranks, total batch count)."""
        sums = [float(s) for s in sums]
        if not self.active:
            return [s / count if count else 0.0 for s in sums], count
        tot = self.world.allreduce_scalars(sums + [float(count)])
        n = tot[-1]
        return [float(s) / n if n else 0.0 for s in tot[:-1]], int(n)

    def combine_test_arrays(self, sums, count):
        """As combine_test for a list of arrays (per-element test scores)."""
        flat = [np.asarray(s, np.float64).reshape(-1) for s in sums]
        sizes = [f.size for f in flat]
        vec = np.concatenate(flat + [np.array([float(count)])]) if flat else np.array([float(count)])
        if self.active:
            vec = self.world.allreduce_scalars(vec)
        n = vec[-1]
        out, off = [], 0
        for s, f in zip(sums, sizes):
            out.append((vec[off:off + f] / n if n else vec[off:off + f] * 0).reshape(np.shape(s)))
            off += f
        return out, int(n)

    # ------------------------------------------------------------ weights
    def broadcast_params(self, net, root=0):
        if self.active:
            self.world.bcast_array(net.param_data, root)

    def synchronize_model(self, net, history):
        """Averaged gradients keep every rank's weights and history equal."""

    def check_in_sync(self, net):
        """True when every rank holds the same weights (a debugging aid)."""
        if not self.active:
            return True
        w = to_numpy(net.param_data).astype(np.float64)
        h = float(np.sum(w * (1 + np.arange(w.size) % 7)))
        lo = self.world.allreduce_scalars([h], "min")[0]
        hi = self.world.allreduce_scalars([h], "max")[0]
        return lo == hi


def make_reducer(world=None, comm="overlap", bucket_mb=DEFAULT_BUCKET_MB,
                 first_bucket_mb=DEFAULT_FIRST_BUCKET_MB):
    from .comm import get_world
    world = world or get_world(comm)
    return Reducer(world, comm, bucket_mb, first_bucket_mb)
