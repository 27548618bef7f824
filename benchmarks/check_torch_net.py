"""Check that benchmarks/torch_net.py translates nets faithfully: the loss,
every top and every parameter gradient of one training pass in PyTorch
(CPU) against caffempi's (NumPy backend), from the same weights and inputs.

    python benchmarks/check_torch_net.py [--only NAME,...]

Needs torch and caffempi's dependencies in one interpreter, e.g. a throwaway
torch venv with caffempi's site-packages on PYTHONPATH.  Data layers become
Input layers with random values (labels in range); Dropout ratios are set
to 0 so both frameworks compute the identity.  Prints one line per net with
the largest relative differences (max |torch - caffempi| / max |caffempi|);
exits 1 on a mismatch.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from caffempi.common import TRAIN, set_random_seed  # noqa: E402
from caffempi.io import proto_io  # noqa: E402
from caffempi.memory import training_variant  # noqa: E402
from caffempi.net import Net  # noqa: E402
from caffempi.proto import caffe_pb2  # noqa: E402
from caffempi.timing import substitute_data_layers  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import torch_net  # noqa: E402

ZOO = REPO.parent / "shared" / "caffe-zoo"
# float32 tolerances (relative to the largest |caffempi value| of each top or
# gradient) and the float64 one, where both frameworks should agree exactly
LOSS_TOL, TOP_TOL, GRAD_TOL, F64_TOL, FLOOR, SLACK = 1e-4, 1e-3, 1e-3, 1e-9, 1e-4, 10

# Layer types and corner cases the zoo nets do not reach: grouped, dilated,
# rectangular and transposed convolutions, leaky ReLU, WITHIN_CHANNEL LRN,
# BatchNorm + Scale, Eltwise MAX/PROD/SUM with coeffs, pooling where torch
# needs the explicit-padding fallback (pad > kernel / 2), stride > kernel,
# FLOOR rounding, global pooling, a transposed InnerProduct, Softmax and two
# weighted losses with different normalizations.
CORNERS = """
name: "corners"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 4 dim: 13 dim: 11 } shape { dim: 2 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "conv_a"
        convolution_param { num_output: 6 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0 group: 2
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu_a" type: "ReLU" bottom: "conv_a" top: "conv_a" relu_param { negative_slope: 0.1 } }
layer { name: "conv_b" type: "Convolution" bottom: "conv_a" top: "conv_b"
        convolution_param { num_output: 6 kernel_size: 3 pad: 2 dilation: 2 group: 3 bias_term: false
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn_b" type: "BatchNorm" bottom: "conv_b" top: "conv_b" }
layer { name: "sc_b" type: "Scale" bottom: "conv_b" top: "conv_b"
        scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 }
                      bias_filler { type: "gaussian" std: 0.2 } } }
layer { name: "lrn_w" type: "LRN" bottom: "conv_a" top: "lrn_w"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL } }
layer { name: "lrn_a" type: "LRN" bottom: "conv_b" top: "lrn_a"
        lrn_param { local_size: 5 alpha: 0.3 beta: 0.75 k: 2 } }
layer { name: "emax" type: "Eltwise" bottom: "lrn_w" bottom: "lrn_a" bottom: "conv_b" top: "emax"
        eltwise_param { operation: MAX } }
layer { name: "eprod" type: "Eltwise" bottom: "lrn_w" bottom: "lrn_a" top: "eprod"
        eltwise_param { operation: PROD } }
layer { name: "esum" type: "Eltwise" bottom: "emax" bottom: "eprod" top: "esum"
        eltwise_param { operation: SUM coeff: 0.5 coeff: -1.5 } }
layer { name: "tanh" type: "TanH" bottom: "esum" top: "esum" }
layer { name: "p1" type: "Pooling" bottom: "esum" top: "p1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "p2" type: "Pooling" bottom: "esum" top: "p2"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "p3" type: "Pooling" bottom: "esum" top: "p3"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 } }
layer { name: "p4" type: "Pooling" bottom: "esum" top: "p4"
        pooling_param { pool: AVE kernel_size: 4 stride: 3 pad: 3 } }
layer { name: "p5" type: "Pooling" bottom: "esum" top: "p5"
        pooling_param { pool: AVE kernel_size: 1 stride: 3 } }
layer { name: "p6" type: "Pooling" bottom: "esum" top: "p6"
        pooling_param { pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 round_mode: FLOOR } }
layer { name: "p7" type: "Pooling" bottom: "esum" top: "p7"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "deconv" type: "Deconvolution" bottom: "p1" top: "deconv"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 group: 2
                            weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "sig" type: "Sigmoid" bottom: "deconv" top: "deconv" }
layer { name: "f1" type: "Flatten" bottom: "deconv" top: "f1" }
layer { name: "f2" type: "Flatten" bottom: "p2" top: "f2" }
layer { name: "f3" type: "Flatten" bottom: "p3" top: "f3" }
layer { name: "f4" type: "Flatten" bottom: "p4" top: "f4" }
layer { name: "f5" type: "Flatten" bottom: "p5" top: "f5" }
layer { name: "f6" type: "Flatten" bottom: "p6" top: "f6" }
layer { name: "f7" type: "Flatten" bottom: "p7" top: "f7" }
layer { name: "cat" type: "Concat" bottom: "f1" bottom: "f2" bottom: "f3" bottom: "f4"
        bottom: "f5" bottom: "f6" bottom: "f7" top: "cat" }
layer { name: "drop" type: "Dropout" bottom: "cat" top: "cat" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip1" type: "InnerProduct" bottom: "cat" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 }
                              bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "cat" top: "ip2"
        inner_product_param { num_output: 5 transpose: true weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }
layer { name: "ip3" type: "InnerProduct" bottom: "prob" top: "ip3"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss1" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss1" loss_weight: 0.7 }
layer { name: "loss2" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss2"
        loss_param { normalization: NONE } }
"""


def zoo_param(path, data_shape, batch):
    return substitute_data_layers(proto_io.read_net_param(str(path)), data_shape,
                                  only_unreadable=False, warn=False, batch_size=batch)


def resnet_param(batch, global_stats):
    """ResNet-50-deploy for training: its final Softmax becomes a
    SoftmaxWithLoss on a new label input (caffempi.memory.training_variant,
    which also clears use_global_stats); optionally set it back."""
    path = ZOO / "resnet" / "ResNet-50-deploy.prototxt"
    param = training_variant(proto_io.read_net_param(str(path)), batch, str(path))
    if global_stats:
        for lp in param.layer:
            if lp.type == "BatchNorm":
                lp.batch_norm_param.use_global_stats = True
    return param


def corners_param():
    return text_format.Parse(CORNERS, caffe_pb2.NetParameter())


# name, NetParameter maker, randomize params (deploy nets have no fillers),
# calibrate BatchNorm statistics, build()'s batchnorm_batch_stats
CASES = [
    ("corners", corners_param, False, False, None),
    ("LeNet", lambda: zoo_param(REPO / "models/mnist/lenet_train_test.prototxt", (1, 28, 28), 4),
     False, False, None),
    ("CIFAR10-quick", lambda: zoo_param(REPO / "models/cifar10/cifar10_quick_train_test.prototxt",
                                        (3, 32, 32), 4), False, False, None),
    ("AlexNet", lambda: zoo_param(ZOO / "bvlc/models/bvlc_alexnet/train_val.prototxt",
                                  (3, 227, 227), 2), False, False, None),
    ("GoogLeNet", lambda: zoo_param(ZOO / "bvlc/models/bvlc_googlenet/train_val.prototxt",
                                    (3, 224, 224), 2), False, False, None),
    # BatchNorm with batch statistics (training_variant clears use_global_stats) ...
    ("ResNet-50", lambda: resnet_param(2, global_stats=False), True, False, None),
    # ... with stored statistics as the deploy prototxt says (calibrated on
    # the inputs first: random ones would blow the activations up) ...
    ("ResNet-50/global", lambda: resnet_param(2, global_stats=True), True, True, None),
    # ... and the prototxt's stored statistics overridden by build() in both frameworks
    ("ResNet-50/forced", lambda: resnet_param(2, global_stats=True), True, False, True),
]


def make_inputs(net, seed):
    """Gaussian data in the first top of every Input layer, labels below the
    smallest class count of the losses in the others."""
    classes = min(net.bottom_vecs[i][0].shape[1] for i, l in enumerate(net.layers)
                  if l.type == "SoftmaxWithLoss")
    rs = np.random.RandomState(seed)
    inputs = {}
    for i, layer in enumerate(net.layers):
        if layer.type == "Input":
            for j, (top, blob) in enumerate(zip(net.top_names[i], net.top_vecs[i])):
                value = rs.standard_normal(blob.shape) if j == 0 else rs.randint(0, classes, blob.shape)
                inputs[top] = value.astype(np.float64)
    return inputs


def set_inputs(net, inputs):
    for name, value in inputs.items():
        net.blobs[name].data = value.astype(net.dtype)


def calibrate_batchnorm(net, inputs):
    """Stored BatchNorm statistics = those of one forward on ``inputs``
    (caffempi accumulates them when it uses batch statistics)."""
    saved = {}
    for layer in net.layers:
        if layer.type == "BatchNorm":
            saved[id(layer)] = layer.use_global_stats
            layer.use_global_stats = False
            for b in layer.blobs:
                b.data = np.zeros(b.shape, net.dtype)
    set_inputs(net, inputs)
    net.forward_range()
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.use_global_stats = saved[id(layer)]


def train_pass(torch, net, bn_batch_stats, inputs):
    """One caffempi and one torch forward-backward on ``net`` (whose dtype
    both use): (loss, tops, grads) of each, as float64 NumPy."""
    tnet = torch_net.build(net, torch, batchnorm_batch_stats=bn_batch_stats)
    set_inputs(net, inputs)
    net.clear_param_diffs()
    loss = net.forward_backward()
    tnet.zero_grad(set_to_none=True)
    tloss, tblobs = tnet.run({k: torch.tensor(v.astype(net.dtype)) for k, v in inputs.items()})
    tloss.backward()
    f64 = lambda a: np.asarray(a, np.float64)        # noqa: E731
    tops = {n: f64(net.blobs[n].data) for n in tblobs}
    ttops = {n: f64(y.detach().numpy()) for n, y in tblobs.items()}
    grads, tgrads = {}, {}
    for name, i, k, p in tnet.param_slots:
        g = tnet.params[p].grad
        if g is None:
            if tnet.params[p].requires_grad:
                raise AssertionError("no torch gradient for %s" % name)
            continue
        grads[name], tgrads[name] = f64(net.layers[i].blobs[k].diff), f64(g.numpy())
    return (loss, tops, grads), (float(tloss.detach()), ttops, tgrads)


def rel_errors(values, refs):
    """{name: max |value - ref| / max |ref|}, the scale floored at FLOOR times
    the largest |ref| of all (a gradient that is zero in exact arithmetic,
    e.g. of a bias before a BatchNorm, is compared with the others' scale)."""
    top = max((float(np.abs(r).max()) for r in refs.values() if r.size), default=0.0)
    out = {}
    for name, ref in refs.items():
        scale = max(float(np.abs(ref).max()) if ref.size else 0.0, FLOOR * top) or 1.0
        out[name] = float(np.abs(values[name] - ref).max()) / scale if ref.size else 0.0
    return out


def worst(errors, tol, t_vs_64=None, c_vs_64=None):
    """(passed, (error, name, torch's and caffempi's distance to float64) of
    the worst entry).  An entry passes within ``tol``; in float32 it also
    passes when torch is no further from the float64 result than SLACK times
    caffempi is: deep nets' gradients are ill-conditioned (a ReLU or max-pool
    decision flipped by rounding moves a weight gradient summed over a few
    hundred positions by up to a few percent, in either framework)."""
    rows = []
    for name, e in errors.items():
        d_t = t_vs_64[name] if t_vs_64 else e
        d_c = c_vs_64[name] if c_vs_64 else 0.0
        passed = e <= tol or (c_vs_64 is not None and d_t <= SLACK * max(d_c, tol))
        rows.append((not passed, e, name, d_t, d_c))
    w = max(rows) if rows else (False, 0.0, "-", 0.0, 0.0)
    return not w[0], w[1:]


def check(torch, name, make_param, randomize, calibrate, bn_batch_stats, seed=0):
    param = make_param()
    for lp in param.layer:
        if lp.type == "Dropout":
            lp.dropout_param.dropout_ratio = 0.0
    set_random_seed(seed)                    # caffempi's fillers
    t = time.perf_counter()
    net32 = Net(param, phase=TRAIN, xp=np, dtype=np.float32)
    inputs = make_inputs(net32, seed + 1)
    if randomize:
        torch_net.randomize_params(net32, seed)
    if calibrate:
        calibrate_batchnorm(net32, inputs)
    # the same net in float64, to tell translation errors from float32 rounding
    net64 = Net(param, phase=TRAIN, xp=np, dtype=np.float64)
    for l32, l64 in zip(net32.layers, net64.layers):
        for b32, b64 in zip(l32.blobs, l64.blobs):
            b64.data = np.asarray(b32.data, np.float64)
    (c32, t32), (c64, t64) = [train_pass(torch, n, bn_batch_stats, inputs) for n in (net32, net64)]

    loss_err = abs(t32[0] - c32[0]) / max(abs(c32[0]), 1e-12)
    loss64_err = abs(t64[0] - c64[0]) / max(abs(c64[0]), 1e-12)
    ok32_tops, w32_tops = worst(rel_errors(t32[1], c32[1]), TOP_TOL)
    ok32_grads, w32_grads = worst(rel_errors(t32[2], c32[2]), GRAD_TOL,
                                  rel_errors(t32[2], c64[2]), rel_errors(c32[2], c64[2]))
    ok64_tops, w64_tops = worst(rel_errors(t64[1], c64[1]), F64_TOL)
    ok64_grads, w64_grads = worst(rel_errors(t64[2], c64[2]), F64_TOL)
    ok = (loss_err <= LOSS_TOL and loss64_err <= F64_TOL and ok32_tops and ok32_grads
          and ok64_tops and ok64_grads)
    rounding = ""
    if w32_grads[0] > GRAD_TOL:
        rounding = "; to float64: torch %.0e, caffempi %.0e" % w32_grads[2:]
    print("%-16s %s loss %.6g/%.6g (%.0e)  float32: %3d tops %.0e (%s), %3d grads %.0e (%s%s)  "
          "float64: loss %.0e, tops %.0e, grads %.0e  [%.0fs]"
          % (name, "ok  " if ok else "FAIL", c32[0], t32[0], loss_err, len(t32[1]), w32_tops[0],
             w32_tops[1], len(t32[2]), w32_grads[0], w32_grads[1], rounding, loss64_err,
             w64_tops[0], w64_grads[0], time.perf_counter() - t), flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated case names")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("torch is not installed in this environment (%s)" % sys.executable)
    torch.manual_seed(0)
    print("torch %s, numpy %s; max relative differences torch vs caffempi (tolerances: float32 loss %g, "
          "tops %g, gradients %g; float64 %g)" % (torch.__version__, np.__version__, LOSS_TOL, TOP_TOL,
                                                  GRAD_TOL, F64_TOL))
    only = set(a.only.split(",")) if a.only else None
    failed = [case[0] for case in CASES
              if (only is None or case[0] in only) and not check(torch, *case)]
    if failed:
        print("MISMATCH: %s" % ", ".join(failed))
        return 1
    print("all nets match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
