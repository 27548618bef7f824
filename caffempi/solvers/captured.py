"""Training iterations replayed as CUDA graphs (``CAFFEMPI_CUDA_GRAPH=1``).

A small net's step on the GPU is paced by the host issuing its kernels:
LeNet took 4.1 ms of host time a pass against 0.6 ms of GPU time on an
H200 (docs/performance/gpu.md).  After :data:`WARMUP` eager iterations
(cuDNN's algorithm searches, kernel compilation, the memory plan), the
pass (forward from the first layer after the data layers, then backward)
and the update are each captured once and replayed.  Per iteration the
host runs the data layers, copies their tops into the arrays the pass
graph reads, launches the pass, reads the loss and the layers' checks,
fills the update's per-step arrays (Solver.prepare_update) and launches
the update: two graphs, so a diverged loss or a bad label still stops the
step before any weight changes.

A replay repeats the captured kernels with the arguments they had, so it
is the same step only where nothing per-iteration is a kernel argument or
a host read: :meth:`CapturedSteps.refusal` names what rules it out, and
the solver then runs as without it, saying why once.  A capture that
fails (an operation CUDA cannot capture) does the same.
"""
import numpy as np

from ..common import log

WARMUP = 2                 # eager iterations before the capture

# layer types whose forward, after the data layers, takes a per-iteration
# value from the host (a kernel argument or a file): a replay would repeat it
HOST_FORWARD = {
    "Dropout": "draws its mask's seed on the host each forward",
    "Python": "runs the user's Python each forward",
    "HDF5Output": "writes a file each forward",
    "DummyData": "draws its data on the host",
    **{data: "reads a batch each forward"
       for data in ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData")},
}


def leading_data_layers(net):
    """How many layers at the start of ``net`` take no bottoms (its data
    layers, run eagerly before each replay)."""
    count = 0
    while count < len(net.layers) and not net.bottom_vecs[count]:
        count += 1
    return count


class CapturedSteps:
    """A solver's iterations as replays of two captured graphs (the pass
    and the update), once :meth:`ready`."""

    def __init__(self, solver):
        self.solver = solver
        self.net = solver.net
        self.first = leading_data_layers(self.net)
        self.reason = self.refusal()
        self.eager = 0               # eager iterations so far
        self.replays = 0             # iterations replayed
        self._stream = None
        self._pass = self._update = None
        self._pending = None         # the captured pass's PendingLoss, read after each replay
        self._inputs = []            # (blob, array the pass graph reads)
        if self.reason:
            log.info("CUDA graphs off: %s; training runs eagerly", self.reason)

    def refusal(self):
        """Why a replay could not be this solver's step, or None."""
        s, net = self.solver, self.net
        if s.sync.active:
            return "the gradients are summed across ranks during backward"
        if s.callbacks:
            return "solver callbacks run Python each iteration"
        if s.param.iter_size != 1:
            return "iter_size is %d (a pass per batch, its data read between them)" % s.param.iter_size
        if np.float32(s.param.clip_gradients) >= 0:
            return "clip_gradients reads the gradients' norm each iteration"
        for layer in net.layers[self.first:]:
            if layer.type in HOST_FORWARD:
                return "layer '%s' (%s) %s" % (layer.name, layer.type, HOST_FORWARD[layer.type])
        if not hasattr(s.xp, "cuda"):
            return "the net is not on a GPU"
        return None

    def ready(self):
        """Whether this iteration replays (after the eager warm-up)."""
        return self.reason is None and self.eager >= WARMUP

    def ran_eagerly(self):
        self.eager += 1

    def _off(self, error):
        self.reason = "capturing failed (%s: %s)" % (type(error).__name__, error)
        log.warning("CUDA graphs off: %s; training runs eagerly", self.reason)

    def passes(self):
        """This iteration's forward and backward; returns the loss."""
        net = self.net
        if self.first:
            net.forward_range(0, self.first - 1)
        if self._pass is None:
            from ..backend import gpu
            self._stream = gpu.GraphStream()
            self._inputs = [(blob, blob.data) for tops in net.top_vecs[:self.first] for blob in tops]
            try:
                self._pass, self._pending = self._stream.capture(
                    lambda: net.forward_backward(pending=True, start=self.first))
            except Exception as e:
                self._off(e)
                return net.forward_backward(pending=True, start=self.first).result()
            log.info("CUDA graphs: the pass (layers %d-%d, forward and backward) and the update "
                     "replay from iteration %d", self.first, len(net.layers) - 1, self.solver.iter)
        else:
            for blob, array in self._inputs:     # this iteration's batch where the graph reads it
                if blob.data is not array:
                    array[...] = blob.data
                    blob.data = array
        self._stream.launch(self._pass).synchronize()
        self.replays += 1
        return self._pending.result()

    def update(self):
        """This iteration's update (Caffe's ApplyUpdate)."""
        s = self.solver
        rate = s.prepare_update()
        if self._update is None:
            try:
                self._update, _ = self._stream.capture(lambda: s.update_params(rate))
            except Exception as e:
                self._off(e)
                s.update_params(rate)
                return
        self._stream.launch(self._update)
