"""Recurrent layers (LSTMUnit, LSTM, RNN): forward values against NumPy step
loops written here, finite-difference gradients, the state carried between
forward calls, changes of T and N, Caffe's parameter order (blobs stored in
BVLC's order load into a net), shape errors, and an LSTM that learns a
sequence task through a prototxt net and the Adam solver."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffempi.common import TEST, TRAIN, CaffeError
from caffempi.io import proto_io
from caffempi.layer_types.base import LAYER_REGISTRY, Layer, register
from caffempi.net import Net
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver
from caffempi.testing.gradient_check import check_gradient, run_layer

T, N, D, H, S = 3, 2, 3, 2, 2       # steps, streams, input size, hidden size, static input size


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# Sequence starts in the middle of stream 0 (t=2) and stream 1 (t=1); CONT
# starts both streams at t=0, so the state carried from an earlier call
# does not matter, while CONT_EXPOSED continues stream 0 from h_0 (and c_0).
CONT = np.array([[0, 0], [1, 0], [0, 1]], dtype=float)
CONT_EXPOSED = np.array([[1, 0], [1, 0], [0, 1]], dtype=float)


# --------------------------------------------------------- NumPy references
def lstm_reference(x, cont, params, h0, c0, x_static=None):
    """Caffe's LSTM one step at a time: (h over time, h_T, c_T)."""
    if x_static is None:
        w_x, b, w_h = params
    else:
        w_x, b, w_static, w_h = params
    steps, n = cont.shape
    hidden = w_h.shape[1]
    h, c = h0.reshape(n, hidden), c0.reshape(n, hidden)
    hs = []
    for t in range(steps):
        keep = cont[t][:, None]
        gates = x[t].reshape(n, -1) @ w_x.T + b + (keep * h) @ w_h.T
        if x_static is not None:
            gates = gates + x_static.reshape(n, -1) @ w_static.T
        i, f, o = (sigmoid(gates[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        g = np.tanh(gates[:, 3 * hidden:])
        c = keep * f * c + i * g
        h = o * np.tanh(c)
        hs.append(h)
    return np.stack(hs), h[None], c[None]


def rnn_reference(x, cont, params, h0, x_static=None):
    """Caffe's RNN one step at a time: (o over time, h_T)."""
    if x_static is None:
        w_x, b_h, w_h, w_o, b_o = params
    else:
        w_x, b_h, w_static, w_h, w_o, b_o = params
    steps, n = cont.shape
    h = h0.reshape(n, -1)
    outs = []
    for t in range(steps):
        pre = x[t].reshape(n, -1) @ w_x.T + b_h + (cont[t][:, None] * h) @ w_h.T
        if x_static is not None:
            pre = pre + x_static.reshape(n, -1) @ w_static.T
        h = np.tanh(pre)
        outs.append(np.tanh(h @ w_o.T + b_o))
    return np.stack(outs), h[None]


def reference(kind, x, cont, params, states, x_static=None):
    """Output and final states of ``kind`` from initial ``states``."""
    if kind == "LSTM":
        return lstm_reference(x, cont, params, *states, x_static=x_static)
    return rnn_reference(x, cont, params, *states, x_static=x_static)


NUM_STATES = {"LSTM": 2, "RNN": 1}


def layer_text(kind, expose=False, name="rec", hidden=H):
    return ('name: "%s" type: "%s" recurrent_param { num_output: %d expose_hidden: %s '
            'weight_filler { type: "uniform" min: -0.8 max: 0.8 } '
            'bias_filler { type: "uniform" min: -0.5 max: 0.5 } }'
            % (name, kind, hidden, "true" if expose else "false"))


def params_of(layer):
    return [np.array(b.data) for b in layer.blobs]


def zero_states(kind, n=N):
    return [np.zeros((1, n, H))] * NUM_STATES[kind]


def bottoms_for(kind, static, expose, seed=0):
    """x, cont, [x_static], [initial states] for a T x N batch."""
    bottoms = [rand(T, N, D, seed=seed), CONT_EXPOSED if expose else CONT]
    if static:
        bottoms.append(rand(N, S, seed=seed + 1))
    if expose:
        bottoms += [rand(1, N, H, seed=seed + 2 + k) for k in range(NUM_STATES[kind])]
    return bottoms


# ----------------------------------------------------------------- LSTMUnit
def test_lstm_unit_forward_matches_formulas():
    c_prev, gates, cont = rand(1, 3, H, seed=1), rand(1, 3, 4 * H, seed=2), np.array([[1.0, 0.0, 1.0]])
    _, _, (c, h) = run_layer('type: "LSTMUnit"', [c_prev, gates, cont], num_top=2)
    i, f, o = (sigmoid(gates[..., k * H:(k + 1) * H]) for k in range(3))
    g = np.tanh(gates[..., 3 * H:])
    want_c = cont[..., None] * f * c_prev + i * g
    np.testing.assert_allclose(c.data, want_c, rtol=1e-12)
    np.testing.assert_allclose(h.data, o * np.tanh(want_c), rtol=1e-12)
    # cont = 0 forgets the previous cell entirely
    np.testing.assert_allclose(c.data[0, 1], (i * g)[0, 1], rtol=1e-12)


@pytest.mark.parametrize("cont", [[1.0, 0.0, 1.0], [1.0, 0.0, 0.5]])
def test_lstm_unit_gradient(cont):
    bottoms = [rand(1, 3, H, seed=1), rand(1, 3, 4 * H, seed=2), np.array([cont])]
    check_gradient('type: "LSTMUnit"', bottoms, check_bottoms=[0, 1], num_top=2)


def test_lstm_unit_refuses_cont_gradient_and_bad_shapes():
    layer, bottom, top = run_layer('name: "u" type: "LSTMUnit"',
                                   [rand(1, 2, H), rand(1, 2, 4 * H), np.ones((1, 2))], num_top=2)
    assert not layer.allow_force_backward(2) and layer.allow_force_backward(1)
    with pytest.raises(CaffeError, match="'u'.*continuation indicators"):
        layer.backward(top, [True, True, True], bottom)
    with pytest.raises(CaffeError, match=r"'u'.*bottom 1 \(gate inputs\).*\(1, 2, 8\).*\(1, 2, 6\)"):
        run_layer('name: "u" type: "LSTMUnit"', [rand(1, 2, H), rand(1, 2, 6), np.ones((1, 2))], num_top=2)
    with pytest.raises(CaffeError, match=r"'u'.*bottom 2 \(cont\).*\(1, 2\).*\(2,\)"):
        run_layer('name: "u" type: "LSTMUnit"', [rand(1, 2, H), rand(1, 2, 4 * H), np.ones(2)], num_top=2)


# ----------------------------------------------------------- LSTM and RNN
@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,expose", [(False, False), (True, False), (False, True), (True, True)])
def test_forward_matches_numpy_step_loop(kind, static, expose):
    bottoms = bottoms_for(kind, static, expose)
    layer, _, tops = run_layer(layer_text(kind, expose), bottoms, num_top=1 + expose * NUM_STATES[kind])
    states = bottoms[2 + static:] if expose else zero_states(kind)
    want = reference(kind, bottoms[0], bottoms[1], params_of(layer), states, bottoms[2] if static else None)
    np.testing.assert_allclose(tops[0].data, want[0], rtol=1e-10, atol=1e-12)
    for top, state in zip(tops[1:], want[1:]):
        np.testing.assert_allclose(top.data, state, rtol=1e-10, atol=1e-12)
    assert tops[0].shape == (T, N, H)


def test_param_blobs_have_caffes_order_and_shapes():
    lstm, _, _ = run_layer(layer_text("LSTM"), bottoms_for("LSTM", True, False))
    assert [b.shape for b in lstm.blobs] == [(4 * H, D), (4 * H,), (4 * H, S), (4 * H, H)]
    rnn, _, _ = run_layer(layer_text("RNN"), bottoms_for("RNN", True, False))
    assert [b.shape for b in rnn.blobs] == [(H, D), (H,), (H, S), (H, H), (H, H), (H,)]
    rnn, _, _ = run_layer(layer_text("RNN"), bottoms_for("RNN", False, False))
    assert [b.shape for b in rnn.blobs] == [(H, D), (H,), (H, H), (H, H), (H,)]


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,expose", [(False, False), (True, True)])
def test_gradients(kind, static, expose):
    """x, x_static, the exposed initial states and every parameter, with
    gradients coming from the output and the exposed final states."""
    bottoms = bottoms_for(kind, static, expose, seed=3)
    check_bottoms = [i for i in range(len(bottoms)) if i != 1]
    check_gradient(layer_text(kind, expose), bottoms, check_bottoms=check_bottoms,
                   num_top=1 + expose * NUM_STATES[kind])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_param_gradients_add_to_diff_and_cont_takes_none(kind):
    layer, bottom, top = run_layer(layer_text(kind, name="r"), bottoms_for(kind, False, False))
    top[0].diff = rand(*top[0].shape, seed=4)
    for b in layer.blobs:
        b.diff = np.zeros(b.shape)
    layer.backward(top, [True, False], bottom)
    once = [np.array(b.diff) for b in layer.blobs]
    assert all(np.abs(g).sum() > 0 for g in once)
    layer.backward(top, [True, False], bottom)
    for b, g in zip(layer.blobs, once):
        np.testing.assert_allclose(b.diff, 2 * g, rtol=1e-12)
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)
    with pytest.raises(CaffeError, match="'r'.*continuation indicators"):
        layer.backward(top, [True, True], bottom)


def forward_again(layer, bottom, top, arrays):
    """Run ``layer`` forward on new bottom values (shapes may change)."""
    for b, a in zip(bottom, arrays):
        b.reshape(a.shape)
        b.data = np.array(a, dtype=np.float64)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_state_carries_over_between_forward_calls(kind):
    """Without expose_hidden, h_T (and c_T) of one call start the next; a
    continuing batch matches one long sequence, and cont = 0 cuts it."""
    x = rand(2 * T, N, D, seed=5)
    cont = np.ones((2 * T, N))
    cont[0] = 0
    cont[T + 1, 1] = 0
    layer, bottom, top = run_layer(layer_text(kind), [x[:T], cont[:T]])
    want, *_ = reference(kind, x, cont, params_of(layer), zero_states(kind))
    np.testing.assert_allclose(top[0].data, want[:T], rtol=1e-10, atol=1e-12)
    forward_again(layer, bottom, top, [x[T:], cont[T:]])
    np.testing.assert_allclose(top[0].data, want[T:], rtol=1e-10, atol=1e-12)
    # a batch starting with cont = 0 everywhere begins afresh
    restart = cont[T:].copy()
    restart[0] = 0
    forward_again(layer, bottom, top, [x[T:], restart])
    fresh, *_ = reference(kind, x[T:], restart, params_of(layer), zero_states(kind))
    np.testing.assert_allclose(top[0].data, fresh, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_changes_of_T_and_N(kind):
    """A new T rebuilds the unrolled net around the same parameter blobs
    (values, gradients and carried state intact); a new N restarts the state."""
    x = rand(T + 2, N, D, seed=6)
    cont = np.ones((T + 2, N))
    cont[0] = 0
    layer, bottom, top = run_layer(layer_text(kind), [x[:T], cont[:T]])
    blobs = list(layer.blobs)
    forward_again(layer, bottom, top, [x[T:], cont[T:]])          # T = 2 now
    assert all(a is b for a, b in zip(layer.blobs, blobs))
    want, *_ = reference(kind, x, cont, params_of(layer), zero_states(kind))
    np.testing.assert_allclose(top[0].data, want[T:], rtol=1e-10, atol=1e-12)
    # the rebuilt net's gradients reach the layer's blobs: compare with a
    # layer built for T = 2 holding the same values
    fresh, fbottom, ftop = run_layer(layer_text(kind), [x[T:], 0 * cont[T:]])
    forward_again(layer, bottom, top, [x[T:], 0 * cont[T:]])
    for src, dst in zip(layer.blobs, fresh.blobs):
        dst.data = src.data.copy()
    forward_again(fresh, fbottom, ftop, [x[T:], 0 * cont[T:]])
    np.testing.assert_allclose(top[0].data, ftop[0].data, rtol=1e-12)
    dy = rand(*top[0].shape, seed=7)
    for lay, tp, bt in ((layer, top, bottom), (fresh, ftop, fbottom)):
        tp[0].diff = dy
        for b in lay.blobs:
            b.diff = np.zeros(b.shape)
        lay.backward(tp, [True, False], bt)
    for a, b in zip(layer.blobs, fresh.blobs):
        np.testing.assert_allclose(a.diff, b.diff, rtol=1e-10, atol=1e-14)
    # N = 3 with cont = 1: the carried state of 2 streams cannot continue, it restarts at 0
    x3, cont3 = rand(T, 3, D, seed=8), np.ones((T, 3))
    forward_again(layer, bottom, top, [x3, cont3])
    want3, *_ = reference(kind, x3, cont3, params_of(layer), zero_states(kind, n=3))
    np.testing.assert_allclose(top[0].data, want3, rtol=1e-10, atol=1e-12)


def test_weights_in_caffes_blob_order_load_into_a_net():
    """A NetParameter holding the LSTM's blobs as BVLC writes them (W_xc,
    b_c, W_xc_static, W_hc) loads by layer name and drives the forward."""
    net_text = """
layer { name: "in" type: "Input" top: "x" top: "cont" top: "xs"
  input_param { shape { dim: %d dim: %d dim: %d } shape { dim: %d dim: %d } shape { dim: %d dim: %d } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" bottom: "xs" top: "h"
  recurrent_param { num_output: %d } }
""" % (T, N, D, T, N, N, S, H)
    net = Net(text_format.Parse(net_text, caffe_pb2.NetParameter()), TEST, dtype=np.float64)
    weights = [rand(4 * H, D, seed=10), rand(4 * H, seed=11), rand(4 * H, S, seed=12), rand(4 * H, H, seed=13)]
    saved = caffe_pb2.NetParameter()
    saved_layer = saved.layer.add(name="lstm", type="LSTM")
    for w in weights:
        proto_io.array_to_blob_proto(w.astype(np.float32), saved_layer.blobs.add())
    net.copy_from(saved)
    for blob, w in zip(net.params["lstm"], weights):
        np.testing.assert_allclose(blob.data, w.astype(np.float32))
    x, xs = rand(T, N, D, seed=14), rand(N, S, seed=15)
    out = net.forward(x=x, cont=CONT, xs=xs)["h"]
    want, *_ = lstm_reference(x, CONT, [w.astype(np.float32) for w in weights],
                              *zero_states("LSTM"), x_static=xs)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    # the net writes them back in the same order
    assert [tuple(b.shape.dim) for b in net.to_proto().layer[1].blobs] == [w.shape for w in weights]
    # the blobs of a layer without the static input do not fit
    del saved_layer.blobs[2]
    with pytest.raises(CaffeError, match="layer 'lstm' has 3 parameter blobs, the net expects 4"):
        net.copy_from(saved)


def test_test_net_sharing_the_train_nets_weights():
    """share_weights replaces the layer's blobs; the unrolled net follows."""
    net_text = """
layer { name: "in" type: "Input" top: "x" top: "cont"
  input_param { shape { dim: %d dim: %d dim: %d } shape { dim: %d dim: %d } } }
layer { name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "o"
  recurrent_param { num_output: %d weight_filler { type: "gaussian" std: 0.5 } } }
""" % (T, N, D, T, N, H)
    param = text_format.Parse(net_text, caffe_pb2.NetParameter())
    train = Net(param, TRAIN, dtype=np.float64)
    test = Net(param, TEST, dtype=np.float64)
    test.share_weights(train)
    train.params["rnn"][3].data = rand(H, H, seed=16)
    x = rand(T, N, D, seed=17)
    cont = np.zeros((T, N))          # independent steps: no state from earlier calls
    out = test.forward(x=x, cont=cont)["o"]
    want, _ = rnn_reference(x, cont, [np.array(b.data) for b in train.params["rnn"]], *zero_states("RNN"))
    np.testing.assert_allclose(out, want, rtol=1e-10)


@pytest.mark.parametrize("text,bottoms,num_top,pattern", [
    (layer_text("LSTM"), [rand(T, N, D), np.ones((T, N + 1))], 1,
     r"bottom 1 \(cont\) must be T x N = \(3, 2\) to match x of shape \(3, 2, 3\), got shape \(3, 3\)"),
    (layer_text("LSTM"), [rand(T, N), np.ones((T, N))], 1, r"bottom 0 \(x\) must be T x N x \.\.\."),
    (layer_text("RNN"), [rand(T, N, D), np.ones((T, N)), rand(N + 1, S)], 1,
     r"bottom 2 \(x_static\) must be N x \.\.\. with N = 2"),
    (layer_text("LSTM", expose=True), [rand(T, N, D), np.ones((T, N)), rand(1, N, H)], 3,
     r"takes bottoms x, cont, \[x_static\], h_0, c_0, got 3"),
    (layer_text("LSTM", expose=True), [rand(T, N, D), np.ones((T, N)), rand(1, N, H), rand(1, N, H)], 1,
     r"takes tops h, h_T, c_T, got 1"),
    (layer_text("RNN", expose=True), [rand(T, N, D), np.ones((T, N)), rand(1, N, H + 1)], 2,
     r"bottom 2 \(h_0\) must be 1 x N x num_output = \(1, 2, 2\), got shape \(1, 2, 3\)"),
    (layer_text("RNN", hidden=0), [rand(T, N, D), np.ones((T, N))], 1,
     "recurrent_param.num_output must be positive, got 0"),
])
def test_shape_errors_name_the_layer(text, bottoms, num_top, pattern):
    with pytest.raises(CaffeError, match=r"layer 'rec' \((LSTM|RNN)\): " + pattern):
        run_layer(text, bottoms, num_top=num_top)


def test_input_size_must_stay_what_the_weights_take():
    layer, bottom, top = run_layer(layer_text("LSTM"), [rand(T, N, D), CONT])
    with pytest.raises(CaffeError, match=r"'rec'.*bottom 0 \(x\) of shape \(3, 2, 4\) has 4 inputs.*W_xc take 3"):
        forward_again(layer, bottom, top, [rand(T, N, D + 1), CONT])


# ------------------------------------------------------------------ training
SEQ_T, SEQ_N = 8, 16

if "TestParityStream" not in LAYER_REGISTRY:
    @register("TestParityStream")
    class ParityStreamLayer(Layer):
        """Tops x (T x N x 1, bits as -1/+1), cont (T x N) and label (T x N):
        N endless streams cut into T-step batches; a new sequence starts with
        probability 0.15 at every step, and the label is the parity of the
        ones seen so far in the current sequence, which often began in an
        earlier batch."""
        exact_num_bottom = 0
        exact_num_top = 3

        def setup(self, bottom, top):
            self._rs = np.random.RandomState(5)
            self._parity = np.zeros(SEQ_N)
            self._first = True

        def reshape(self, bottom, top):
            top[0].reshape((SEQ_T, SEQ_N, 1))
            top[1].reshape((SEQ_T, SEQ_N))
            top[2].reshape((SEQ_T, SEQ_N))

        def forward(self, bottom, top):
            bits = self._rs.randint(0, 2, (SEQ_T, SEQ_N))
            cont = (self._rs.rand(SEQ_T, SEQ_N) > 0.15).astype(float)
            if self._first:
                cont[0] = 0
                self._first = False
            label = np.empty((SEQ_T, SEQ_N))
            parity = self._parity
            for t in range(SEQ_T):
                parity = (parity * cont[t] + bits[t]) % 2
                label[t] = parity
            self._parity = parity
            for blob, value in zip(top, (2.0 * bits[..., None] - 1, cont, label)):
                blob.data = self.xp.asarray(value, self.dtype)

        def backward(self, top, propagate_down, bottom):
            """No bottoms."""


PARITY_NET = """
layer { name: "data" type: "TestParityStream" top: "x" top: "cont" top: "label" }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
  recurrent_param { num_output: 8 weight_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "score" type: "InnerProduct" bottom: "h" top: "score"
  inner_product_param { num_output: 2 axis: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
  softmax_param { axis: 2 } }
layer { name: "accuracy" type: "Accuracy" bottom: "score" bottom: "label" top: "accuracy"
  accuracy_param { axis: 2 } }
"""


def test_lstm_learns_the_running_parity_of_a_stream():
    """Chance is 0.5 at every step (loss ln 2).  The first step of a batch
    that continues a sequence needs the state carried from the previous
    batch: without it, the label is a coin flip given what the batch holds."""
    sp = text_format.Parse('type: "Adam" base_lr: 0.05 momentum: 0.9 momentum2: 0.999 '
                           'lr_policy: "fixed" max_iter: 300 display: 0 random_seed: 1 solver_mode: CPU',
                           caffe_pb2.SolverParameter())
    text_format.Merge(PARITY_NET, sp.net_param)
    solver = get_solver(sp)
    solver.step(300)
    correct, first_step, losses = [], [], []
    for _ in range(10):
        out = solver.net.forward(blobs=["score", "label", "cont"])
        right = out["score"].argmax(-1) == out["label"]
        correct.append(right.mean())
        first_step.append(right[0][out["cont"][0] > 0].mean())
        losses.append(float(out["loss"]))
    assert np.mean(losses) < 0.1, losses
    assert np.mean(correct) > 0.95 and np.mean(first_step) > 0.9, (correct, first_step)
