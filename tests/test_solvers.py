"""Solvers against independent NumPy re-computations of Caffe's update rules
(sgd_solver.cpp and friends) and learning-rate policies, on a tiny net:
x -> InnerProduct -> EuclideanLoss, data from a deterministic test layer."""
import math

import numpy as np
import pytest
from google.protobuf import text_format

from caffempi.common import CaffeError
from caffempi.layer_types.base import LAYER_REGISTRY, Layer, register
from caffempi.proto import caffe_pb2
from caffempi import solvers
from caffempi.solvers import get_solver, lr_policy

N, D, K = 4, 3, 2
_rs = np.random.RandomState(0)
BATCHES = {"x": _rs.randn(16, N, D).astype(np.float32),
           "y": _rs.randn(16, N, K).astype(np.float32)}


if "TestSeqData" not in LAYER_REGISTRY:
    @register("TestSeqData")
    class SeqDataLayer(Layer):
        """Tops x, y: batch i of BATCHES (cycling); state = next index."""
        exact_num_bottom = 0
        exact_num_top = 2

        def setup(self, bottom, top):
            self.i = 0

        def reshape(self, bottom, top):
            top[0].reshape((N, D))
            top[1].reshape((N, K))

        def forward(self, bottom, top):
            k = self.i % len(BATCHES["x"])
            top[0].data = self.xp.asarray(BATCHES["x"][k])
            top[1].data = self.xp.asarray(BATCHES["y"][k])
            self.i += 1

        def backward(self, top, propagate_down, bottom):
            pass

        def get_state(self):
            return {"i": self.i}

        def set_state(self, state):
            self.i = state["i"]


def ip_layer(name, bottom, top, params=(), filler="gaussian"):
    ps = "".join("param { %s }\n" % p for p in params)
    return """layer { name: "%s" type: "InnerProduct" bottom: "%s" top: "%s" %s
  inner_product_param { num_output: %d weight_filler { type: "%s" std: 0.5 }
    bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
""" % (name, bottom, top, ps, K, filler)


def tiny_net(params=(), shared=False):
    text = 'name: "tiny"\nlayer { name: "data" type: "TestSeqData" top: "x" top: "y" }\n'
    if shared:
        text += ip_layer("ipa", "x", "pa", ['name: "w" ' + (params[0] if params else ""),
                                             'name: "b" ' + (params[1] if len(params) > 1 else "")])
        text += ip_layer("ipb", "x", "pb", ['name: "w"', 'name: "b"'])
        text += ('layer { name: "la" type: "EuclideanLoss" bottom: "pa" bottom: "y" top: "la" }\n'
                 'layer { name: "lb" type: "EuclideanLoss" bottom: "pb" bottom: "y" top: "lb" }\n')
    else:
        text += ip_layer("ip", "x", "p", params)
        text += 'layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }\n'
    return text_format.Parse(text, caffe_pb2.NetParameter())


def make_solver(solver_text, **net_kw):
    sp = text_format.Merge(solver_text, caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(tiny_net(**net_kw))
    sp.random_seed = 3
    sp.solver_mode = sp.CPU
    return get_solver(sp)


# ------------------------------------------------------------------ reference
def ref_grads(W, b, batch, n_heads=1):
    x = BATCHES["x"][batch].astype(np.float64)
    y = BATCHES["y"][batch].astype(np.float64)
    p = x @ W.T + b
    dp = (p - y) / N
    return n_heads * (dp.T @ x), n_heads * dp.sum(0)


def ref_lr(sp, it, state):
    pol, base, g, pw = sp.lr_policy, sp.base_lr, sp.gamma, sp.power
    if pol == "fixed":
        return base
    if pol == "step":
        return base * g ** (it // sp.stepsize)
    if pol == "exp":
        return base * g ** it
    if pol == "inv":
        return base * (1 + g * it) ** (-pw)
    if pol == "multistep":
        if state["step"] < len(sp.stepvalue) and it >= sp.stepvalue[state["step"]]:
            state["step"] += 1
        return base * g ** state["step"]
    if pol == "poly":
        return base * (1 - it / sp.max_iter) ** pw
    if pol == "sigmoid":
        return base / (1 + math.exp(-g * (it - sp.stepsize)))
    raise AssertionError(pol)


def ref_train(sp, W, b, iters, lr_mults=(1, 1), decay_mults=(1, 1), n_heads=1):
    """Caffe's Step/ApplyUpdate in float64, parameter by parameter."""
    params = [W.astype(np.float64), b.astype(np.float64)]
    h1 = [np.zeros_like(p) for p in params]
    h2 = [np.zeros_like(p) for p in params]
    state = {"step": 0}
    batch = 0
    for it in range(iters):
        gs = [np.zeros_like(p) for p in params]
        for _ in range(sp.iter_size):
            gw, gb = ref_grads(params[0], params[1], batch, n_heads)
            batch += 1
            gs[0] += gw
            gs[1] += gb
        rate = ref_lr(sp, it, state)
        if sp.clip_gradients >= 0:
            norm = math.sqrt(sum(float((g ** 2).sum()) for g in gs))
            if norm > sp.clip_gradients:
                gs = [g * (sp.clip_gradients / norm) for g in gs]
        gs = [g / sp.iter_size for g in gs]
        for i, p in enumerate(params):
            ld = sp.weight_decay * decay_mults[i]
            if ld:
                gs[i] = gs[i] + ld * (p if sp.regularization_type == "L2" else np.sign(p))
        m, m2, delta = sp.momentum, sp.momentum2, sp.delta
        for i, p in enumerate(params):
            g, lr = gs[i], rate * lr_mults[i]
            if sp.type == "SGD":
                h1[i] = lr * g + m * h1[i]
                upd = h1[i]
            elif sp.type == "Nesterov":
                old = h1[i].copy()
                h1[i] = lr * g + m * h1[i]
                upd = (1 + m) * h1[i] - m * old
            elif sp.type == "AdaGrad":
                h1[i] = h1[i] + g * g
                upd = lr * g / (np.sqrt(h1[i]) + delta)
            elif sp.type == "RMSProp":
                h1[i] = (1 - sp.rms_decay) * g * g + sp.rms_decay * h1[i]
                upd = lr * g / (np.sqrt(h1[i]) + delta)
            elif sp.type == "AdaDelta":
                h1[i] = (1 - m) * g * g + m * h1[i]
                step = g * np.sqrt((h2[i] + delta) / (h1[i] + delta))
                h2[i] = (1 - m) * step * step + m * h2[i]
                upd = lr * step
            elif sp.type == "Adam":
                t = it + 1
                h1[i] = (1 - m) * g + m * h1[i]
                h2[i] = (1 - m2) * g * g + m2 * h2[i]
                corr = math.sqrt(1 - m2 ** t) / (1 - m ** t)
                upd = lr * corr * h1[i] / (np.sqrt(h2[i]) + delta)
            else:
                raise AssertionError(sp.type)
            params[i] = p - upd
    return params, h1, h2


def initial(solver, name="ip"):
    W, b = solver.net.params[name]
    return W.data.copy(), b.data.copy()


def check(solver_text, iters=5, name="ip", rtol=2e-5, atol=1e-6, **kw):
    s = make_solver(solver_text, **{k: v for k, v in kw.items() if k in ("params", "shared")})
    W0, b0 = initial(s, name)
    s.step(iters)
    ref, h1, h2 = ref_train(s.param, W0, b0, iters, **{k: v for k, v in kw.items()
                                                        if k in ("lr_mults", "decay_mults", "n_heads")})
    W, b = s.net.params[name]
    np.testing.assert_allclose(W.data, ref[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(b.data, ref[1], rtol=rtol, atol=atol)
    assert s.iter == iters
    return s, h1, h2


BASE = 'base_lr: 0.05 lr_policy: "fixed" max_iter: 100 weight_decay: 0.01 '
MULTS = dict(params=["lr_mult: 1 decay_mult: 1", "lr_mult: 2 decay_mult: 0"],
             lr_mults=(1, 2), decay_mults=(1, 0))


@pytest.mark.parametrize("solver_text", [
    'type: "SGD" momentum: 0.9',
    'type: "Nesterov" momentum: 0.9',
    'type: "AdaGrad" delta: 1e-6',
    'type: "RMSProp" rms_decay: 0.9 delta: 1e-6',
    'type: "AdaDelta" momentum: 0.95 delta: 1e-6 base_lr: 1.0',
    'type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 1e-8 base_lr: 0.01',
])
def test_every_solver_type_matches_reference(solver_text):
    s, h1, h2 = check(BASE + solver_text, **MULTS)
    # history layout: set 0 (and set 1 for AdaDelta/Adam) over the flat buffer
    np.testing.assert_allclose(s.history[0], np.concatenate([h.ravel() for h in h1]), rtol=2e-5, atol=1e-7)
    if len(s.history) == 2:
        np.testing.assert_allclose(s.history[1], np.concatenate([h.ravel() for h in h2]),
                                   rtol=2e-5, atol=1e-9)


@pytest.mark.parametrize("legacy,cls", [("SGD", solvers.SGDSolver), ("NESTEROV", solvers.NesterovSolver),
                                        ("ADAGRAD", solvers.AdaGradSolver), ("RMSPROP", solvers.RMSPropSolver),
                                        ("ADADELTA", solvers.AdaDeltaSolver), ("ADAM", solvers.AdamSolver)])
def test_legacy_solver_type_enum(legacy, cls):
    s = make_solver('base_lr: 0.01 lr_policy: "fixed" solver_type: %s' % legacy)
    assert type(s) is cls


@pytest.mark.parametrize("policy", [
    'lr_policy: "fixed"',
    'lr_policy: "step" gamma: 0.5 stepsize: 2',
    'lr_policy: "exp" gamma: 0.9',
    'lr_policy: "inv" gamma: 0.1 power: 0.75',
    'lr_policy: "multistep" gamma: 0.3 stepvalue: 1 stepvalue: 3 stepvalue: 4',
    'lr_policy: "poly" power: 2 max_iter: 10',
    'lr_policy: "sigmoid" gamma: 0.5 stepsize: 3',
])
def test_lr_policies(policy):
    sp = text_format.Merge("base_lr: 0.2 max_iter: 10 " + policy, caffe_pb2.SolverParameter())
    lr_policy.check_policy(sp)
    step, state = 0, {"step": 0}
    for it in range(10):
        rate, step = lr_policy.learning_rate(sp, it, step, info=lambda *a: None)
        assert rate == pytest.approx(ref_lr(sp, it, state), rel=1e-6)
    # and inside training (SGD with momentum follows the policy), with
    # multipliers that differ by param: the per-element rates follow the rate
    check(BASE + 'type: "SGD" momentum: 0.5 max_iter: 10 ' + policy, iters=6, **MULTS)


def test_iter_size_clip_gradients_and_l1():
    s, _, _ = check(BASE + 'type: "SGD" momentum: 0.9 iter_size: 3 clip_gradients: 0.1 '
                    'regularization_type: "L1" weight_decay: 0.05', iters=4)
    # the clip threshold binds: without clipping the result differs
    s.param.clip_gradients = -1
    W0, b0 = initial(make_solver(BASE + 'type: "SGD"'))
    clipped = ref_train(text_format.Merge('clip_gradients: 0.1', _copy(s.param)), W0, b0, 4)[0]
    unclipped = ref_train(s.param, W0, b0, 4)[0]
    assert not np.allclose(clipped[0], unclipped[0], rtol=1e-3)


def _copy(sp):
    out = caffe_pb2.SolverParameter()
    out.CopyFrom(sp)
    return out


@pytest.mark.parametrize("rule", ['type: "SGD" momentum: 0.9', 'type: "Nesterov" momentum: 0.9',
                                  'type: "AdaGrad" delta: 1e-6', 'type: "RMSProp" rms_decay: 0.9 delta: 1e-6',
                                  'type: "AdaDelta" momentum: 0.95 delta: 1e-6',
                                  'type: "Adam" momentum: 0.9 momentum2: 0.999 delta: 1e-8'])
def test_the_update_in_blocks_is_the_update_over_the_whole_buffers(rule, monkeypatch):
    """The update's steps run block by block over the flat buffers (in
    cache on the CPU), no block crossing a change of the params' rate or
    decay multipliers (so each has one of each): blocks of 3 values (the 6
    of the weight in two), with per-param rates and decays and iter_size 2,
    give the bits of the steps over the whole buffers."""
    from caffempi.backend.cpu import blocks
    results = []
    for block_bytes in (blocks.ELEMENT_BLOCK_BYTES, 12):
        monkeypatch.setattr(blocks, "ELEMENT_BLOCK_BYTES", block_bytes)
        s = make_solver(BASE + rule + " iter_size: 2", params=MULTS["params"])
        calls = []
        real = s._update_block
        s._update_block = lambda rate, block: (calls.append(block), real(rate, block))
        s.step(4)
        assert len(calls) == 4 * (2 if block_bytes > 12 else 3)
        results.append([s.net.param_data.copy(), s.net.param_diff.copy()] + [h.copy() for h in s.history])
    s = make_solver(BASE + rule + " iter_size: 2", params=MULTS["params"])

    def steps_over_the_whole_buffers(rate):
        s.normalize()
        s.regularize()
        s.compute_update_value(rate, slice(None))
        s.net.param_data -= s.net.param_diff
    s.update_params = steps_over_the_whole_buffers
    s.step(4)
    results.append([s.net.param_data.copy(), s.net.param_diff.copy()] + [h.copy() for h in s.history])
    for whole, in_blocks in zip(results[2], results[1]):
        np.testing.assert_array_equal(whole, in_blocks)


def test_l1_sign_of_zero_is_zero():
    s = make_solver(BASE + 'type: "SGD" regularization_type: "L1" weight_decay: 1.0 base_lr: 0.0')
    s.net.param_data[...] = 0
    s.net.param_data[0] = 2.0
    s.net.param_diff[...] = 0
    s.regularize()
    assert s.net.param_diff[0] == 1.0 and not s.net.param_diff[1:].any()


def test_shared_parameters_decayed_once():
    check(BASE + 'type: "SGD" momentum: 0.9 weight_decay: 0.1', name="ipa", shared=True, n_heads=2,
          params=["lr_mult: 1 decay_mult: 1", "lr_mult: 1 decay_mult: 1"])


def test_adam_against_hand_numbers():
    # one parameter element by hand: g=0.5, lr=0.1, t=1:
    # m=0.05, v=0.00025, corr=sqrt(0.001)/0.1, update = 0.1*corr*0.05/(sqrt(v)+1e-8)
    from caffempi.solvers import updates
    g = np.array([0.5], np.float32)
    m, v, tmp = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.float32)
    updates.adam(np, g, m, v, tmp, np.float32(0.1), 0.9, 0.999, 1e-8, updates.adam_correction(0.9, 0.999, 1))
    corr = math.sqrt(1 - 0.999) / (1 - 0.9)
    assert g[0] == pytest.approx(0.1 * corr * 0.05 / (math.sqrt(0.00025) + 1e-8), rel=1e-6)


def test_sigmoid_rejects_negative_gamma():
    with pytest.raises(CaffeError, match="gamma"):
        make_solver('base_lr: 0.1 lr_policy: "sigmoid" gamma: -1 stepsize: 2')


@pytest.mark.parametrize("text,msg", [
    ('base_lr: 0.1 lr_policy: "cosine"', "unknown lr_policy 'cosine'"),
    ('base_lr: 0.1 lr_policy: "fixed" type: "Fancy"', "unknown solver type 'Fancy'"),
    ('base_lr: 0.1 lr_policy: "fixed" type: "AdaGrad" momentum: 0.9', "Momentum cannot be used"),
    ('base_lr: 0.1 lr_policy: "step" stepsize: 0', "stepsize"),
    ('base_lr: 0.1 lr_policy: "fixed" weight_decay: 0.1 regularization_type: "L3"', "regularization_type"),
])
def test_bad_solver_parameters(text, msg):
    with pytest.raises(CaffeError, match=msg):
        make_solver(text)


def test_test_iter_without_test_net():
    sp = text_format.Parse('base_lr: 0.1 lr_policy: "fixed" test_iter: 3 test_interval: 5',
                           caffe_pb2.SolverParameter())
    sp.train_net_param.CopyFrom(tiny_net())
    with pytest.raises(CaffeError, match="no test net"):
        get_solver(sp)


def test_test_nets_from_generic_net_and_outputs():
    s = make_solver(BASE + 'type: "SGD" test_iter: 2 test_iter: 3 test_interval: 2')
    assert len(s.test_nets) == 2
    means = s.test(1)
    # mean over batches 0..2 of the loss with the current weights
    W, b = (p.data.astype(np.float64) for p in s.net.params["ip"])
    ref = np.mean([((BATCHES["x"][k] @ W.T + b - BATCHES["y"][k]) ** 2).sum() / (2 * N) for k in range(3)])
    assert means[0] == pytest.approx(ref, rel=1e-5)
    # the test net shares the train net's weights
    s.step(1)
    assert s.test_nets[0].params["ip"][0].data is s.net.params["ip"][0].data


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_divergence_names_iteration_and_layer():
    s = make_solver('type: "SGD" base_lr: 1e30 lr_policy: "fixed" max_iter: 50')
    # ip's outputs are still finite (about 1e30); their squares overflow in the loss
    with pytest.raises(CaffeError, match=r"Iteration \d+: training diverged.*layer 'loss'"):
        s.step(50)
