"""CPU/GPU parity of single layers: the same layer, inputs, parameters and
top gradients on NumPy and on CuPy, float32, forward tops and backward
gradients compared (the GPU issue's "every layer agrees within float32
tolerance")."""
import numpy as np

from ..backend import to_numpy
from ..common import TRAIN, set_random_seed
from .gradient_check import make_layer, run_layer


def _close(name, got, want, rtol, atol):
    got, want = to_numpy(got).astype(np.float64), to_numpy(want).astype(np.float64)
    if got.shape != want.shape:
        raise AssertionError("%s: GPU shape %s, CPU shape %s" % (name, got.shape, want.shape))
    if not got.size:
        return 0.0
    err = float(np.abs(got - want).max())
    bound = rtol * float(np.abs(want).max()) + atol
    if not err <= bound:
        i = np.unravel_index(np.argmax(np.abs(got - want)), want.shape)
        raise AssertionError("%s: max |GPU - CPU| = %.3g > %.3g (at %s: GPU %r, CPU %r)"
                             % (name, err, bound, i, got[i], want[i]))
    return err


def _backward(layer, bottoms, tops, top_diffs, check_bottoms, seed):
    xp = layer.xp
    for t, d in zip(tops, top_diffs):
        t.diff = xp.asarray(d, layer.dtype)
    for p in layer.blobs:
        p.diff = xp.zeros(p.shape, layer.dtype)
    set_random_seed(seed)
    layer.backward(tops, [i in check_bottoms for i in range(len(bottoms))], bottoms)


def check_backend_parity(text, bottom_arrays, gpu_xp, check_bottoms=None, num_top=None,
                         phase=TRAIN, rtol=1e-4, atol=1e-6, seed=1701):
    """Run the layer of ``text`` on NumPy and on ``gpu_xp`` (CuPy) in float32
    with the same seeded parameters and draws; compare every top, every
    checked bottom's diff and every parameter's diff as max|GPU - CPU| <=
    rtol * max|CPU| + atol.  Returns the largest error seen."""
    f32 = np.float32
    runs = []
    for xp in (np, gpu_xp):
        layer = make_layer(text, phase, xp=xp, dtype=f32)
        runs.append(run_layer(layer, [np.asarray(a, f32) for a in bottom_arrays], num_top, phase, f32, seed))
    (cl, cb, ct), (gl, gb, gt) = runs
    worst = 0.0
    for k, (g, c) in enumerate(zip(gt, ct)):
        worst = max(worst, _close("top %d" % k, g.data, c.data, rtol, atol))
    if check_bottoms is None:
        check_bottoms = range(len(cb))
    check_bottoms = set(check_bottoms)
    rs = np.random.RandomState(seed + 1)
    top_diffs = [rs.uniform(-1, 1, t.shape).astype(f32) for t in ct]
    for layer, bottoms, tops in ((cl, cb, ct), (gl, gb, gt)):
        _backward(layer, bottoms, tops, top_diffs, check_bottoms, seed)
    for i in sorted(check_bottoms):
        worst = max(worst, _close("bottom %d diff" % i, gb[i].diff, cb[i].diff, rtol, atol))
    for k, (g, c) in enumerate(zip(gl.blobs, cl.blobs)):
        worst = max(worst, _close("param %d diff" % k, g.diff, c.diff, rtol, atol))
    return worst
