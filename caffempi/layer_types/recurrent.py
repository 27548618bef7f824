"""Recurrent layers (BVLC Caffe's RecurrentLayer family): RNN and LSTM, which
unroll their recurrence over the T time steps of the input into a net of
ordinary layers and run it inside the layer, and LSTMUnit, the LSTM's
per-step non-linearity.

Blobs are time-major: x is T x N x ..., the sequence continuation indicators
``cont`` are T x N (0 where a sequence starts, which cuts the recurrence from
the previous step).  As in Caffe, the unrolled net is a
:class:`caffempi.net.Net` built from a generated NetParameter; its T copies of
the recurrent weight are one parameter shared by name, and its learnable
parameters, in Caffe's order, are the layer's ``blobs``, so a ``.caffemodel``
written by BVLC Caffe loads as it is.
"""
from ..proto import caffe_pb2
from .base import Layer, register
from .neuron import sigmoid

# The class that runs unrolled nets.  caffempi.net hands over its Net class at
# import (net.py imports every layer module, so importing it here would be an
# import cycle).
_NET_CLASS = []


def use_net_class(net_class):
    """Make ``net_class`` (caffempi.net.Net) the engine of unrolled nets."""
    _NET_CLASS[:] = [net_class]


# ------------------------------------------------------------------ LSTMUnit
@register("LSTMUnit")
class LSTMUnitLayer(Layer):
    """One LSTM step.  Bottoms c_{t-1} (1 x N x H), the gate inputs
    (1 x N x 4H: i', f', o', g' in that order) and cont_t (1 x N); tops c_t and
    h_t (1 x N x H), with i, f, o = sigmoid(i', f', o'), g = tanh(g'),
    c_t = cont_t * f * c_{t-1} + i * g and h_t = o * tanh(c_t).

    Backward recomputes the activations from the bottoms (cheap, and nothing
    is kept between the passes).  The gradient of f' is the exact one,
    cont * f * (1 - f) * dc * c_{t-1}; Caffe's formula agrees with it for
    the binary cont it is meant for.  There is no gradient for cont."""
    backward_reads_top_data = False
    recompute_cheap = True
    exact_num_bottom = 3
    exact_num_top = 2

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def reshape(self, bottom, top):
        c_prev, gates, cont = bottom
        if c_prev.num_axes != 3 or c_prev.shape[0] != 1:
            raise self.error("bottom 0 (c_{t-1}) must be 1 x N x H, got shape %s", c_prev.shape)
        _, n, h = c_prev.shape
        if gates.shape != (1, n, 4 * h):
            raise self.error("bottom 1 (gate inputs) must be 1 x N x 4H = %s for c_{t-1} of shape %s, "
                             "got shape %s", (1, n, 4 * h), c_prev.shape, gates.shape)
        if cont.shape != (1, n):
            raise self.error("bottom 2 (cont) must be 1 x N = %s for c_{t-1} of shape %s, got shape %s",
                             (1, n), c_prev.shape, cont.shape)
        self._hidden = h
        top[0].reshape(c_prev.shape)
        top[1].reshape(c_prev.shape)

    def _gates(self, bottom):
        """(i, sigmoid(f'), o, g, cont) with cont shaped 1 x N x 1."""
        xp, h = self.xp, self._hidden
        x = bottom[1].data
        sig = sigmoid(xp, x[..., :3 * h])
        return (sig[..., :h], sig[..., h:2 * h], sig[..., 2 * h:], xp.tanh(x[..., 3 * h:]),
                bottom[2].data[..., None])

    def forward(self, bottom, top):
        i, f, o, g, cont = self._gates(bottom)
        c = cont * f * bottom[0].data + i * g
        top[0].data = c
        top[1].data = o * self.xp.tanh(c)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[2]:
            raise self.error("cannot backpropagate to the sequence continuation indicators (bottom 2)")
        if not (propagate_down[0] or propagate_down[1]):
            return
        xp = self.xp
        i, f, o, g, cont = self._gates(bottom)
        c_prev = bottom[0].data
        kept = cont * f
        tanh_c = xp.tanh(kept * c_prev + i * g)
        dh = top[1].diff
        dc = top[0].diff + dh * o * (1 - tanh_c * tanh_c)
        if propagate_down[0]:
            bottom[0].diff = dc * kept
        if propagate_down[1]:
            bottom[1].diff = xp.concatenate([dc * g * i * (1 - i),
                                             dc * c_prev * kept * (1 - f),
                                             dh * tanh_c * o * (1 - o),
                                             dc * i * (1 - g * g)], axis=-1)


# ------------------------------------------------------- unrolled-net pieces
def _add_layer(net_param, name, type_name, bottoms=(), tops=(), param_names=()):
    lp = net_param.layer.add()
    lp.name = name
    lp.type = type_name
    lp.bottom.extend(bottoms)
    lp.top.extend(tops)
    for p in param_names:
        lp.param.add().name = p
    return lp


def _add_inner_product(net_param, name, bottom, top, num_output, axis, fillers, param_names,
                       propagate_down=False):
    """An InnerProduct whose params are shared by ``param_names`` (a bias
    when two names are given); ``fillers`` is (weight, bias) or None;
    ``propagate_down`` asks for the gradient of an input of the unrolled net,
    which Net would not compute by itself."""
    lp = _add_layer(net_param, name, "InnerProduct", [bottom], [top], param_names)
    if propagate_down:
        lp.propagate_down.append(True)
    ip = lp.inner_product_param
    ip.num_output = num_output
    ip.axis = axis
    ip.bias_term = len(param_names) == 2
    if fillers is not None:
        ip.weight_filler.CopyFrom(fillers[0])
        if ip.bias_term:
            ip.bias_filler.CopyFrom(fillers[1])
    return lp


def _add_input(net_param, name, tops_and_shapes):
    lp = _add_layer(net_param, name, "Input", tops=[t for t, _ in tops_and_shapes])
    for _, shape in tops_and_shapes:
        lp.input_param.shape.add().dim.extend(shape)


class _RecurrentLayer(Layer):
    """Caffe's RecurrentLayer.  Bottoms x (T x N x ...), cont (T x N), an
    optional static input x_static (N x ...) seen at every step, and with
    ``expose_hidden`` the initial states (1 x N x num_output each, in
    ``state_names`` order) after them; tops the output (T x N x num_output)
    and with ``expose_hidden`` the final states.

    Without ``expose_hidden`` the final states of one forward are the initial
    states of the next (zero at first and whenever N changes), as Caffe carries
    them; cont = 0 at the start of a sequence cuts them off.  Backward reaches
    x, x_static and the exposed initial states, with gradients from the output
    and the exposed final states (Caffe's unrolled net takes neither state
    gradient, which leaves them unusable for backpropagation across calls),
    never cont.  A change of T builds the unrolled net anew around the same
    parameter blobs (Caffe refuses it; batches of varying length need it).
    ``recurrent_param.debug_info`` is accepted and ignored (Net has no
    per-layer debug output).

    Subclasses name their parameters and blobs and add one step's layers
    (:meth:`_add_step`)."""
    # The unrolled net keeps its own references to the arrays its backward reads.
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    min_bottom = 2

    state_names = ()          # recurrent states: bottoms/tops "<s>_0" / "<s>_T" when exposed
    output_name = None        # the output blob (T x N x num_output)
    gates_per_unit = 1        # rows of the input and hidden weights per output unit
    param_names = None        # (input weight, its bias, static-input weight, hidden weight)
    sum_name = None           # blob holding a step's summed pre-activations

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    # ----------------------------------------------------------------- setup
    def setup(self, bottom, top):
        p = self.param.recurrent_param
        self.num_output = int(p.num_output)
        if self.num_output <= 0:
            raise self.error("recurrent_param.num_output must be positive, got %d", self.num_output)
        self.expose_hidden = p.expose_hidden
        exposed = len(self.state_names) if self.expose_hidden else 0
        initial = ["%s_0" % s for s in self.state_names[:exposed]]
        final = ["%s_T" % s for s in self.state_names[:exposed]]
        if len(bottom) not in (2 + exposed, 3 + exposed):
            raise self.error("takes bottoms %s, got %d", ", ".join(["x", "cont", "[x_static]"] + initial),
                             len(bottom))
        if len(top) != 1 + exposed:
            raise self.error("takes tops %s, got %d", ", ".join([self.output_name] + final), len(top))
        self.static_input = len(bottom) == 3 + exposed
        # the unrolled net's outputs whose gradients come from this layer's tops
        self._graded_outputs = [self.output_name] + final
        self._check_shapes(bottom)
        self._build(bottom, with_fillers=True)
        self.blobs = list(self._net.learnable_params)
        self._state = None

    def _build(self, bottom, with_fillers):
        """Create the unrolled net for bottom's T (fillers only when its
        parameters are new: a rebuild takes the existing ones)."""
        if not _NET_CLASS:
            raise self.error("the unrolled net needs caffempi.net (import caffempi first)")
        self._T = bottom[0].shape[0]
        net_param = self._unrolled_net_param(bottom, with_fillers)
        self._net = _NET_CLASS[0](net_param, phase=self.phase, xp=self.xp, dtype=self.dtype,
                                  source_name="layer '%s' unrolled" % self.name)
        net = self._net
        self._last_layer = len(net.layers) - 1 - len(self._graded_outputs)   # before the pseudo-losses
        owner = {id(b): k for k, b in enumerate(net.learnable_params)}
        # (unrolled layer, param index, index into self.blobs) for every param slot
        self._param_slots = [(layer, j, owner[id(b)]) for layer in net.layers
                             for j, b in enumerate(layer.blobs)]

    def _link_params(self):
        """Point every param slot of the unrolled net at ``self.blobs`` (the
        net may have rebound or replaced those blobs, as a test net sharing
        the train net's weights does)."""
        for layer, j, k in self._param_slots:
            layer.blobs[j] = self.blobs[k]

    def _unrolled_net_param(self, bottom, with_fillers):
        """Caffe's FillUnrolledNet for T = bottom[0].shape[0]: layer names
        prefixed with this layer's name, outputs with pseudo-losses."""
        T, n = bottom[0].shape[:2]
        p = self.param.recurrent_param
        fillers = (p.weight_filler, p.bias_filler) if with_fillers else None
        gate_dim = self.gates_per_unit * self.num_output
        w_x, b_x, w_static, w_h = self.param_names
        net_param = caffe_pb2.NetParameter()
        inputs = [("x", bottom[0].shape), ("cont", bottom[1].shape)]
        if self.static_input:
            inputs.append(("x_static", bottom[2].shape))
        _add_input(net_param, "input", inputs)
        _add_input(net_param, "state_input", [("%s_0" % s, (1, n, self.num_output)) for s in self.state_names])
        cont_slice = _add_layer(net_param, "cont_slice", "Slice", ["cont"])
        cont_slice.slice_param.axis = 0
        # W_x * x + b for all steps at once
        _add_inner_product(net_param, "x_transform", "x", w_x + "_x", gate_dim, 2, fillers, [w_x, b_x],
                           propagate_down=True)
        step_terms = []
        if self.static_input:
            static = w_x + "_x_static"
            _add_inner_product(net_param, static, "x_static", static + "_preshape", gate_dim, 1,
                               fillers, [w_static], propagate_down=True)
            reshape = _add_layer(net_param, static + "_reshape", "Reshape", [static + "_preshape"], [static])
            reshape.reshape_param.shape.dim.extend([1, -1, gate_dim])
            step_terms.append(static)
        x_slice = _add_layer(net_param, w_x + "_x_slice", "Slice", [w_x + "_x"])
        x_slice.slice_param.axis = 0
        concat = caffe_pb2.LayerParameter(name=self.output_name + "_concat", type="Concat",
                                          top=[self.output_name])
        concat.concat_param.axis = 0
        for t in range(1, T + 1):
            cont_t = "cont_%d" % t
            cont_slice.top.append(cont_t)
            x_slice.top.append("%s_x_%d" % (w_x, t))
            # h_conted_{t-1} = cont_t * h_{t-1}: a sequence start forgets h
            scale = _add_layer(net_param, "h_conted_%d" % (t - 1), "Scale",
                               ["h_%d" % (t - 1), cont_t], ["h_conted_%d" % (t - 1)])
            scale.scale_param.axis = 0
            _add_inner_product(net_param, "%s_h_%d" % (w_h, t - 1), "h_conted_%d" % (t - 1),
                               "%s_h_%d" % (w_h, t - 1), gate_dim, 2, fillers, [w_h])
            pre = "%s_%d" % (self.sum_name, t)
            _add_layer(net_param, pre, "Eltwise",
                       ["%s_h_%d" % (w_h, t - 1), "%s_x_%d" % (w_x, t)] + step_terms, [pre])
            concat.bottom.append(self._add_step(net_param, t, pre, cont_t, fillers))
        for s in self.state_names:   # the final states under T-independent names
            _add_layer(net_param, "%s_T_copy" % s, "Split", ["%s_%d" % (s, T)], ["%s_T" % s])
        net_param.layer.add().CopyFrom(concat)
        # Caffe's pseudo-losses, the last layers, make Net backpropagate from
        # the outputs that take a gradient; they are never run.
        for name in self._graded_outputs:
            loss = _add_layer(net_param, name + "_pseudoloss", "Reduction", [name], [name + "_pseudoloss"])
            loss.loss_weight.append(1)
        if self.expose_hidden:
            # The initial states reach only layers without parameters, which
            # Net runs backward only when forced to (cont's gradient, a few
            # sums, is then computed and dropped; LSTMUnit refuses it).
            net_param.force_backward = True
        for lp in net_param.layer:
            lp.name = "%s_%s" % (self.name, lp.name)
        return net_param

    def _add_step(self, net_param, t, pre, cont_t, fillers):
        """Add the layers that make step t's states from their summed
        pre-activations ``pre``; return the name of step t's output blob."""
        raise NotImplementedError

    # --------------------------------------------------------------- running
    def _check_shapes(self, bottom):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 3:
            raise self.error("bottom 0 (x) must be T x N x ... (at least 3 axes), got shape %s", x.shape)
        T, n = x.shape[:2]
        if cont.shape != (T, n):
            raise self.error("bottom 1 (cont) must be T x N = %s to match x of shape %s, got shape %s",
                             (T, n), x.shape, cont.shape)
        if self.static_input and (bottom[2].num_axes < 1 or bottom[2].shape[0] != n):
            raise self.error("bottom 2 (x_static) must be N x ... with N = %d (x of shape %s), got shape %s",
                             n, x.shape, bottom[2].shape)
        if self.expose_hidden:
            first = 2 + self.static_input
            for k, s in enumerate(self.state_names):
                b = bottom[first + k]
                if b.shape != (1, n, self.num_output):
                    raise self.error("bottom %d (%s_0) must be 1 x N x num_output = %s, got shape %s",
                                     first + k, s, (1, n, self.num_output), b.shape)

    def _check_input_sizes(self, bottom):
        """x and x_static must keep the sizes the weights were made for."""
        checks = [(0, "x", 2, 0)]
        if self.static_input:
            checks.append((2, "x_static", 1, 2))
        for i, what, axis, k in checks:
            size, want = bottom[i].count_range(axis), self.blobs[k].shape[1]
            if size != want:
                raise self.error("bottom %d (%s) of shape %s has %d inputs per item, the weights %s take %d",
                                 i, what, bottom[i].shape, size, self.param_names[k], want)

    def reshape(self, bottom, top):
        self._check_shapes(bottom)
        self._check_input_sizes(bottom)
        if bottom[0].shape[0] != self._T:
            self._build(bottom, with_fillers=False)
        net = self._net
        T, n = bottom[0].shape[:2]
        state_shape = (1, n, self.num_output)
        net.blobs["x"].reshape(bottom[0].shape)
        net.blobs["cont"].reshape(bottom[1].shape)
        if self.static_input:
            net.blobs["x_static"].reshape(bottom[2].shape)
        for s in self.state_names:
            net.blobs["%s_0" % s].reshape(state_shape)
        if not self.expose_hidden and (self._state is None or self._state[0].shape != state_shape):
            self._state = [self.xp.zeros(state_shape, self.dtype) for _ in self.state_names]
        top[0].reshape((T, n, self.num_output))
        for t in top[1:]:
            t.reshape(state_shape)

    def forward(self, bottom, top):
        net = self._net
        self._link_params()
        net.blobs["x"].data = bottom[0].data
        net.blobs["cont"].data = bottom[1].data
        if self.static_input:
            net.blobs["x_static"].data = bottom[2].data
        initial = bottom[2 + self.static_input:] if self.expose_hidden else None
        for k, s in enumerate(self.state_names):
            net.blobs["%s_0" % s].data = initial[k].data if initial else self._state[k]
        net.forward_range(0, self._last_layer)
        top[0].data = net.blobs[self.output_name].data
        final = [net.blobs["%s_T" % s].data for s in self.state_names]
        if self.expose_hidden:
            for t, state in zip(top[1:], final):
                t.data = state
        else:
            self._state = final

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to the sequence continuation indicators (bottom 1)")
        net = self._net
        net.blobs[self.output_name].diff = top[0].diff
        if self.expose_hidden:
            for t, s in zip(top[1:], self.state_names):
                net.blobs["%s_T" % s].diff = t.diff
        net.backward_range(self._last_layer, 0)
        inputs = ["x", "cont"] + (["x_static"] if self.static_input else [])
        if self.expose_hidden:
            inputs += ["%s_0" % s for s in self.state_names]
        for i, name in enumerate(inputs):
            if propagate_down[i]:
                bottom[i].diff = net.blobs[name].diff


@register("LSTM")
class LSTMLayer(_RecurrentLayer):
    """Long short-term memory (Caffe's LSTMLayer; Graves 2013 without
    peepholes).  Per step, gates = W_xc x_t + b_c + W_xc_static x_static +
    W_hc (cont_t h_{t-1}), then :class:`LSTMUnitLayer`.  Params W_xc
    (4H x D), b_c (4H), [W_xc_static (4H x D_static)], W_hc (4H x H); states
    h and c; bottoms x, cont, [x_static], [h_0, c_0]; tops h, [h_T, c_T]."""
    max_bottom = 5
    state_names = ("h", "c")
    output_name = "h"
    gates_per_unit = 4
    param_names = ("W_xc", "b_c", "W_xc_static", "W_hc")
    sum_name = "gate_input"

    def _add_step(self, net_param, t, pre, cont_t, fillers):
        h_t = "h_%d" % t
        _add_layer(net_param, "unit_%d" % t, "LSTMUnit", ["c_%d" % (t - 1), pre, cont_t], ["c_%d" % t, h_t])
        return h_t


@register("RNN")
class RNNLayer(_RecurrentLayer):
    """Simple recurrent net (Caffe's RNNLayer): h_t = tanh(W_xh x_t + b_h +
    W_xh_static x_static + W_hh (cont_t h_{t-1})), o_t = tanh(W_ho h_t + b_o).
    Params W_xh (H x D), b_h (H), [W_xh_static (H x D_static)], W_hh (H x H),
    W_ho (H x H), b_o (H); state h; bottoms x, cont, [x_static], [h_0];
    tops o, [h_T]."""
    max_bottom = 4
    state_names = ("h",)
    output_name = "o"
    param_names = ("W_xh", "b_h", "W_xh_static", "W_hh")
    sum_name = "h_neuron_input"

    def _add_step(self, net_param, t, pre, cont_t, fillers):
        h_t, o_t = "h_%d" % t, "o_%d" % t
        _add_layer(net_param, "h_neuron_%d" % t, "TanH", [pre], [h_t])
        _add_inner_product(net_param, "W_ho_h_%d" % t, h_t, "W_ho_h_%d" % t, self.num_output, 2,
                           fillers, ["W_ho", "b_o"])
        _add_layer(net_param, "o_neuron_%d" % t, "TanH", ["W_ho_h_%d" % t], [o_t])
        return o_t
