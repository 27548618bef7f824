"""A built caffempi Net as an equivalent PyTorch nn.Module, so that a
benchmark can time the same net in both frameworks.

    net = caffempi.net.Net(param, phase=TRAIN)     # NumPy backend
    tnet = torch_net.build(net, torch).to("cuda")  # weights copied from net
    loss = tnet({"data": x, "label": y})           # Caffe's weighted total loss
    loss.backward()

The translation walks ``net.layers``: the layer order, the Split layers,
in-place tops and parameter sharing are those caffempi built, and on the
first forward with the built input shapes every top's shape is checked
against caffempi's.  Tops live in a dict by name (an in-place layer replaces
its bottom's entry; torch itself never runs in place, for autograd).
``torch`` is passed in, not imported, so caffempi's own environment needs no
torch; this module needs caffempi importable (the repository root on sys.path).

Where Caffe and torch differ, the translation follows Caffe (caffempi):

* Pooling: Caffe's ceil-mode size (last window clipped, and dropped when it
  would start in the right padding) and its AVE divisor (padding counted,
  overhang past the padding not) are torch's ceil_mode=True and
  count_include_pad=True, except where torch refuses (pad > kernel / 2) or
  sizes differ (stride > kernel without padding): there the input is padded
  explicitly (-inf for MAX) and AVE rescaled by Caffe's divisors.
* BatchNorm has no affine part (Caffe pairs it with a Scale layer).  It uses
  batch statistics or the stored ones exactly as the caffempi layer does
  (``layer.use_global_stats``: the prototxt's use_global_stats, else true in
  TEST only); the stored ones are Caffe's blobs[0] / blobs[2] and
  blobs[1] / blobs[2] (0 when blobs[2] is 0), kept as buffers.  With batch
  statistics torch's running averages are updated with momentum
  1 - moving_average_fraction, which is Caffe's average only in the limit
  (no output depends on them in TRAIN).
* SoftmaxWithLoss: torch's log-softmax is not clamped at FLT_MIN as Caffe's
  probability is (they differ only when a probability is below 1e-38).
* Eltwise MAX follows Caffe's tie rule (the gradient goes to one bottom), not
  torch.maximum's (split between them).
* Accuracy is skipped (no gradient; its tops are not produced); Dropout is
  torch's (inverted dropout, as Caffe) while the module is in training mode
  and the caffempi net is in TRAIN phase.
"""
import functools
import math

import numpy as np

from caffempi.backend import to_numpy
from caffempi.common import TRAIN
from caffempi.layer_types.pooling import pooled_size
from caffempi.proto import caffe_pb2

_PP = caffe_pb2.PoolingParameter
_ELTWISE = caffe_pb2.EltwiseParameter
_LOSS = caffe_pb2.LossParameter


def build(net, torch, batchnorm_batch_stats=None):
    """A TorchNet computing what ``net`` (a caffempi Net) computes, with its
    parameters initialised from ``net``'s, in its dtype (float32 unless the
    net was built otherwise), on the CPU: move it with .to().

    ``batchnorm_batch_stats``: None follows each caffempi BatchNorm layer;
    True (batch statistics) or False (stored statistics) forces it in torch
    and also sets ``use_global_stats`` on the caffempi layers, so that both
    frameworks compute the same thing (needed e.g. for a deploy net such as
    ResNet-50-deploy, whose BatchNorm says use_global_stats: true)."""
    return _module_class(torch)(net, batchnorm_batch_stats)


def randomize_params(net, seed=0):
    """Fill a caffempi net's parameters with plausible random values, for
    deploy prototxts (no fillers: all-zero weights) and numerical checks:
    He-scaled weights for Convolution / Deconvolution / InnerProduct, scales
    near 1, small biases, and BatchNorm statistics with a non-trivial scale
    factor (means N(0, 0.1^2), variances in [0.5, 1.5], factor 2)."""
    rs = np.random.RandomState(seed)
    xp, dtype = net.xp, net.dtype

    def put(blob, values):
        blob.data = xp.asarray(np.asarray(values, dtype).reshape(blob.shape))

    for i, layer in enumerate(net.layers):
        blobs = layer.blobs
        if not blobs:
            continue
        if layer.type == "BatchNorm":
            c = blobs[0].shape[0]
            put(blobs[0], 2 * 0.1 * rs.standard_normal(c))
            put(blobs[1], 2 * rs.uniform(0.5, 1.5, c))
            put(blobs[2], [2.0])
        elif layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
            w = blobs[0]
            fan_in = w.count // w.shape[0] if layer.type != "InnerProduct" else w.shape[-1]
            put(w, rs.standard_normal(w.shape) * math.sqrt(2.0 / fan_in))
            for b in blobs[1:]:
                put(b, 0.01 * rs.standard_normal(b.shape))
        elif layer.type == "Scale":
            for k, b in enumerate(blobs):
                base = 1.0 if (k == 0 and len(net.bottom_vecs[i]) == 1) else 0.0
                put(b, base + 0.1 * rs.standard_normal(b.shape))
        else:
            for b in blobs:
                put(b, 0.1 * rs.standard_normal(b.shape))


# ------------------------------------------------------------------ module
class _Step:
    """One caffempi layer: ``fn(module, params, bottoms) -> tops`` (None for
    Input, whose tops come from the caller, and for skipped layers)."""

    def __init__(self, net, i, fn):
        self.name = net.layer_names[i]
        self.type = net.layers[i].type
        self.fn = fn
        self.bottoms = list(net.bottom_names[i])
        self.tops = list(net.top_names[i])
        self.loss = list(net.loss_weights[i])
        lp = net.layers[i].param
        # propagate_down: false cuts the gradient to that bottom, as in Caffe
        self.detach = [not p for p in lp.propagate_down] if len(lp.propagate_down) else None
        self.shapes = [tuple(t.shape) for t in net.top_vecs[i]]


class _Ctx:
    """What a translator sees: the layer, torch, and registration of the
    layer's parameters (shared caffempi blobs map to one torch Parameter)."""

    def __init__(self, module, net, i, torch):
        self.module, self.net, self.i, self.torch = module, net, i, torch
        self.F = torch.nn.functional
        self.layer = net.layers[i]
        self.lp = self.layer.param
        self.bottoms = net.bottom_vecs[i]
        self.tops = net.top_vecs[i]

    def param(self, k):
        """Index into module.params of the layer's parameter blob k."""
        m, blob = self.module, self.layer.blobs[k]
        if id(blob) not in m._param_index:
            data = self.torch.tensor(to_numpy(blob.data))    # the net's dtype
            need = self.net.layer_param_need_backward[self.i][k]
            m.params.append(self.torch.nn.Parameter(data, requires_grad=bool(need)))
            m._param_index[id(blob)] = len(m.params) - 1
            m.param_slots.append(("%s[%d]" % (self.net.layer_names[self.i], k), self.i, k,
                                  len(m.params) - 1))
        return m._param_index[id(blob)]

    def buffer(self, suffix, value):
        name = "_buf%d_%s" % (self.i, suffix)
        self.module.register_buffer(name, value)
        return name


@functools.lru_cache(maxsize=None)
def _module_class(torch):
    class TorchNet(torch.nn.Module):
        """A caffempi Net in PyTorch; see the module docstring and build()."""

        def __init__(self, net, batchnorm_batch_stats=None):
            super().__init__()
            self.params = torch.nn.ParameterList()
            self._param_index = {}      # id(caffempi Blob) -> index in params
            # (display name, layer index, blob index, index in params), for
            # copy_weights_from and for comparing gradients with caffempi's
            self.param_slots = []
            self._bn_batch_stats = batchnorm_batch_stats
            self._bn_buffers = []       # (layer index, mean buffer, var buffer)
            self._shapes_checked = False
            self.steps = []
            for i, layer in enumerate(net.layers):
                translate = _TRANSLATORS.get(layer.type)
                if translate is None:
                    raise NotImplementedError("torch_net: layer '%s' has type %s, which has no "
                                              "translation" % (net.layer_names[i], layer.type))
                ctx = _Ctx(self, net, i, torch)
                step = _Step(net, i, translate(ctx))
                if step.fn is None and step.loss and layer.type != "Input":
                    raise NotImplementedError("torch_net: layer '%s' (%s) is skipped but carries a "
                                              "loss weight" % (step.name, step.type))
                self.steps.append(step)
            self.input_shapes = {n: s for st in self.steps if st.type == "Input"
                                 for n, s in zip(st.tops, st.shapes)}
            self.copy_weights_from(net)

        def forward(self, inputs):
            """Total loss (sum of loss tops times their loss_weight), a scalar tensor."""
            return self.run(inputs)[0]

        def run(self, inputs):
            """(total loss, dict of every top by name) for ``inputs`` (name -> tensor)."""
            check = not self._shapes_checked and all(
                tuple(inputs[n].shape) == s for n, s in self.input_shapes.items() if n in inputs)
            params = list(self.params)
            blobs = {}
            loss = None
            for st in self.steps:
                if st.type == "Input":
                    try:
                        ys = [inputs[n] for n in st.tops]
                    except KeyError as e:
                        raise KeyError("torch_net: no input given for top %s of layer '%s'"
                                       % (e, st.name)) from None
                elif st.fn is None:
                    continue
                else:
                    xs = [blobs[n] for n in st.bottoms]
                    if st.detach:
                        xs = [x.detach() if d else x for x, d in zip(xs, st.detach)]
                    ys = st.fn(self, params, xs)
                if check:
                    got = [tuple(y.shape) for y in ys]
                    if got != st.shapes:
                        raise ValueError("torch_net: layer '%s' (%s) gives top shapes %s, caffempi "
                                         "built %s" % (st.name, st.type, got, st.shapes))
                for name, y in zip(st.tops, ys):
                    blobs[name] = y
                for j, w in st.loss:
                    term = ys[j].sum() if w == 1 else ys[j].sum() * w
                    loss = term if loss is None else loss + term
            if check:
                self._shapes_checked = True
            if loss is None:
                loss = torch.zeros((), device=params[0].device if params else None)
            return loss, blobs

        @torch.no_grad()
        def copy_weights_from(self, net):
            """Copy a caffempi net's parameter values (and BatchNorm statistics)
            into this module; ``net`` must be built from the same NetParameter."""
            if list(net.layer_names) != [st.name for st in self.steps]:
                raise ValueError("torch_net: the net's layers differ from those this module "
                                 "was built from")
            for _, i, k, p in self.param_slots:
                src = torch.as_tensor(to_numpy(net.layers[i].blobs[k].data))
                self.params[p].copy_(src.reshape(self.params[p].shape))
            for i, mean_name, var_name in self._bn_buffers:
                blobs = [to_numpy(b.data).astype(np.float64) for b in net.layers[i].blobs]
                factor = blobs[2][0]
                inv = 0.0 if factor == 0 else 1.0 / factor     # Caffe: no statistics yet -> 0
                getattr(self, mean_name).copy_(torch.as_tensor(blobs[0] * inv))
                getattr(self, var_name).copy_(torch.as_tensor(blobs[1] * inv))

        def grads(self):
            """[(name "layer[k]", gradient or None)] of the learnable parameters."""
            return [(name, self.params[p].grad) for name, _, _, p in self.param_slots]

    return TorchNet


# ------------------------------------------------------------- translators
_TRANSLATORS = {}


def _translates(*types):
    def deco(fn):
        for t in types:
            _TRANSLATORS[t] = fn
        return fn
    return deco


def _canonical(axis, ndim):
    return axis % ndim if ndim else 0


@_translates("Input")
def _input(c):
    return None


@_translates("Accuracy")
def _skip(c):
    return None


@_translates("Silence")
def _silence(c):
    return lambda m, P, xs: []


@_translates("Split")
def _split(c):
    n = len(c.tops)
    return lambda m, P, xs: [xs[0]] * n      # autograd sums the consumers' gradients


@_translates("Convolution", "Deconvolution")
def _convolution(c):
    layer, F = c.layer, c.F
    kh, kw, sh, sw, ph, pw, dh, dw = layer.geom
    w = c.param(0)
    b = c.param(1) if layer.bias_term else None
    # Caffe's Deconvolution weight (C_in, C_out / group, kh, kw) is torch's layout too
    op = F.conv_transpose2d if layer.transposed else F.conv2d
    kw_args = dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=layer.group)

    def fn(m, P, xs):
        bias = P[b] if b is not None else None
        return [op(x, P[w], bias, **kw_args) for x in xs]    # tops share the weights
    return fn


def _torch_pooled(size, k, s, p, ceil):
    """torch's pooled length (aten pooling_output_shape)."""
    out = (size + 2 * p - k + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _native_pooling_matches(size, k, s, p, out, ceil):
    return 2 * p <= k and _torch_pooled(size, k, s, p, ceil) == out


def _ave_divisors(size, k, s, p, out):
    """Caffe's AVE divisor per output position along one axis: the window
    clipped to the padded input (padding counts, overhang does not)."""
    return [min(o * s - p + k, size + p) - (o * s - p) for o in range(out)]


@_translates("Pooling")
def _pooling(c):
    layer, F, torch = c.layer, c.F, c.torch
    if len(c.tops) > 1:
        raise NotImplementedError("torch_net: Pooling layer '%s' with a mask top" % c.lp.name)
    is_max = layer.method == _PP.MAX
    kernel = None if layer.global_pooling else tuple(layer.kernel)
    (sh, sw), (ph, pw), ceil = tuple(layer.stride), tuple(layer.pad), layer.ceil_mode
    divisors = {}       # (h, w, device, dtype) -> AVE rescaling of the fallback

    def fn(m, P, xs):
        x = xs[0]
        h, w = x.shape[-2:]
        kh, kw = kernel or (h, w)
        oh, ow = pooled_size(h, kh, sh, ph, ceil), pooled_size(w, kw, sw, pw, ceil)
        if _native_pooling_matches(h, kh, sh, ph, oh, ceil) and \
                _native_pooling_matches(w, kw, sw, pw, ow, ceil):
            if is_max:
                return [F.max_pool2d(x, (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil)]
            return [F.avg_pool2d(x, (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil,
                                 count_include_pad=True)]
        # Pad explicitly so that every Caffe window fits, then pool without
        # padding; -inf padding never wins a MAX window.
        eh = max(0, (oh - 1) * sh + kh - h - 2 * ph)
        ew = max(0, (ow - 1) * sw + kw - w - 2 * pw)
        xp = F.pad(x, (pw, pw + ew, ph, ph + eh), value=-math.inf if is_max else 0.0)
        if is_max:
            return [F.max_pool2d(xp, (kh, kw), (sh, sw))[..., :oh, :ow]]
        key = (h, w, x.device, x.dtype)
        if key not in divisors:
            dv = np.outer(_ave_divisors(h, kh, sh, ph, oh), _ave_divisors(w, kw, sw, pw, ow))
            divisors[key] = torch.tensor(kh * kw / np.maximum(dv, 1), dtype=x.dtype, device=x.device)
        return [F.avg_pool2d(xp, (kh, kw), (sh, sw))[..., :oh, :ow] * divisors[key]]
    return fn


@_translates("InnerProduct")
def _inner_product(c):
    layer, F = c.layer, c.F
    axis, transpose = layer.axis, layer.transpose
    w = c.param(0)
    b = c.param(1) if layer.bias_term else None

    def fn(m, P, xs):
        weight = P[w].t() if transpose else P[w]
        return [F.linear(xs[0].flatten(axis), weight, P[b] if b is not None else None)]
    return fn


@_translates("ReLU")
def _relu(c):
    F, slope = c.F, c.layer.slope
    if slope == 0:
        return lambda m, P, xs: [F.relu(xs[0])]
    return lambda m, P, xs: [F.leaky_relu(xs[0], slope)]


@_translates("Sigmoid")
def _sigmoid(c):
    torch = c.torch
    return lambda m, P, xs: [torch.sigmoid(xs[0])]


@_translates("TanH")
def _tanh(c):
    torch = c.torch
    return lambda m, P, xs: [torch.tanh(xs[0])]


@_translates("Dropout")
def _dropout(c):
    F, ratio, train_phase = c.F, c.layer.ratio, c.layer.phase == TRAIN
    return lambda m, P, xs: [F.dropout(xs[0], ratio, training=m.training and train_phase)]


@_translates("LRN")
def _lrn(c):
    layer, F = c.layer, c.F
    size, alpha, beta, k = layer.size, layer.alpha, layer.beta, layer.k
    if layer.across:
        # torch: k + alpha / size * (sum of squares over size channels,
        # zero-padded), the same formula as Caffe's
        return lambda m, P, xs: [F.local_response_norm(xs[0], size, alpha, beta, k)]
    pad = (size - 1) // 2

    def within(m, P, xs):
        # Caffe: 1 + alpha / size^2 * (sum of squares over a size x size
        # window, zero-padded; k unused); the divisor is always size^2
        x = xs[0]
        mean_sq = F.avg_pool2d(x * x, size, 1, pad, count_include_pad=True)
        return [x * (1 + alpha * mean_sq).pow(-beta)]
    return within


@_translates("BatchNorm")
def _batch_norm(c):
    layer, F, torch, module = c.layer, c.F, c.torch, c.module
    forced = module._bn_batch_stats
    if forced is not None:
        layer.use_global_stats = not forced     # caffempi reads it at every forward
    batch_stats = not layer.use_global_stats
    eps, momentum = layer.eps, 1.0 - layer.maf
    dtype = getattr(torch, np.dtype(layer.dtype).name)
    mean = c.buffer("mean", torch.zeros(layer.channels, dtype=dtype))
    var = c.buffer("var", torch.ones(layer.channels, dtype=dtype))
    module._bn_buffers.append((c.i, mean, var))

    def fn(m, P, xs):
        x = xs[0]
        x2 = x.reshape(-1, 1) if x.dim() == 1 else x
        y = F.batch_norm(x2, getattr(m, mean), getattr(m, var), None, None,
                         training=batch_stats, momentum=momentum, eps=eps)
        return [y.reshape(x.shape)]
    return fn


def _broadcast(t, ndim, axis):
    """Operand t covering axes [axis, axis + t.dim()) of an ndim-D blob."""
    if t.dim() == 0:
        return t
    axis = _canonical(axis, ndim)
    return t.reshape((1,) * axis + tuple(t.shape) + (1,) * (ndim - axis - t.dim()))


@_translates("Scale")
def _scale(c):
    layer, torch = c.layer, c.torch
    axis = c.lp.scale_param.axis
    two = len(c.bottoms) == 2
    s = None if two else c.param(0)
    b = c.param(layer.bias_index) if layer.bias_term else None

    def fn(m, P, xs):
        x = xs[0]
        scale = _broadcast(xs[1] if two else P[s], x.dim(), axis)
        if b is None:
            return [x * scale]
        return [torch.addcmul(_broadcast(P[b], x.dim(), axis), x, scale)]
    return fn


@_translates("Eltwise")
def _eltwise(c):
    torch = c.torch
    p = c.lp.eltwise_param
    op = p.operation
    coeffs = [float(v) for v in p.coeff] or [1.0] * len(c.bottoms)

    if op == _ELTWISE.SUM:
        def fn(m, P, xs):
            y = xs[0] if coeffs[0] == 1 else xs[0] * coeffs[0]
            for x, a in zip(xs[1:], coeffs[1:]):
                y = torch.add(y, x, alpha=a)
            return [y]
    elif op == _ELTWISE.PROD:
        def fn(m, P, xs):
            y = xs[0]
            for x in xs[1:]:
                y = y * x
            return [y]
    elif op == _ELTWISE.MAX:
        def fn(m, P, xs):
            # Caffe's ties: bottom 1 beats bottom 0, later ones must be larger
            y = torch.where(xs[0] > xs[1], xs[0], xs[1])
            for x in xs[2:]:
                y = torch.where(x > y, x, y)
            return [y]
    else:
        raise NotImplementedError("torch_net: Eltwise operation %d" % op)
    return fn


@_translates("Concat")
def _concat(c):
    torch, p = c.torch, c.lp.concat_param
    axis = p.concat_dim if p.HasField("concat_dim") else p.axis

    def fn(m, P, xs):
        if len(xs) == 1:
            return [xs[0]]
        return [torch.cat(xs, dim=_canonical(axis, xs[0].dim()))]
    return fn


@_translates("Flatten")
def _flatten(c):
    p = c.lp.flatten_param
    start, end = p.axis, p.end_axis

    def fn(m, P, xs):
        x = xs[0]
        return [x.flatten(_canonical(start, x.dim()), _canonical(end, x.dim()))]
    return fn


@_translates("Softmax")
def _softmax(c):
    F, axis = c.F, c.lp.softmax_param.axis
    return lambda m, P, xs: [F.softmax(xs[0], dim=_canonical(axis, xs[0].dim()))]


@_translates("SoftmaxWithLoss")
def _softmax_with_loss(c):
    layer, F = c.layer, c.F
    axis = c.lp.softmax_param.axis
    ignore, mode = layer.ignore_label, layer.normalization
    with_prob = len(c.tops) > 1

    def fn(m, P, xs):
        x, label = xs
        a = _canonical(axis, x.dim())
        outer, channels = math.prod(x.shape[:a]), x.shape[a]
        inner = x.numel() // max(1, outer * channels)
        logits = x.reshape(outer, channels, inner)
        lab = label.reshape(outer, inner).long()     # C++ int cast of the float labels
        total = F.cross_entropy(logits, lab, reduction="sum",
                                ignore_index=ignore if ignore is not None else -100)
        if mode == _LOSS.VALID and ignore is not None:
            norm = (lab != ignore).sum().clamp(min=1).to(x.dtype)
        elif mode in (_LOSS.FULL, _LOSS.VALID):
            norm = max(1, outer * inner)
        elif mode == _LOSS.BATCH_SIZE:
            norm = max(1, outer)
        else:
            norm = 1
        tops = [total / norm]
        if with_prob:
            tops.append(F.softmax(x, dim=a))
        return tops
    return fn
