"""cuDNN convolution (ctypes) against the im2col + GEMM CuPy kernels."""
import numpy as np
import pytest

from caffempi.backend import cudnn

pytestmark = pytest.mark.gpu

# (name, x shape, out channels, geom (kh, kw, sh, sw, ph, pw, dh, dw), group)
CASES = [
    ("3x3_pad1", (2, 4, 9, 8), 6, (3, 3, 1, 1, 1, 1, 1, 1), 1),
    ("5x5_nopad", (2, 3, 12, 12), 5, (5, 5, 1, 1, 0, 0, 1, 1), 1),
    ("alexnet_conv1", (2, 3, 227, 227), 96, (11, 11, 4, 4, 0, 0, 1, 1), 1),
    ("alexnet_conv2", (4, 96, 27, 27), 256, (5, 5, 1, 1, 2, 2, 1, 1), 2),
    ("group2", (2, 4, 9, 7), 6, (3, 2, 2, 1, 1, 0, 1, 1), 2),
    ("dilation2", (2, 3, 10, 10), 4, (3, 3, 1, 1, 2, 2, 2, 2), 1),
    ("1x1", (2, 6, 5, 5), 8, (1, 1, 1, 1, 0, 0, 1, 1), 1),
    ("1x1_stride2", (2, 6, 7, 7), 8, (1, 1, 2, 2, 0, 0, 1, 1), 2),
    ("7x7_stride2_pad3", (2, 3, 32, 32), 16, (7, 7, 2, 2, 3, 3, 1, 1), 1),
]


@pytest.fixture(scope="module")
def cp(cupy):
    if not cudnn.available():
        pytest.skip("cuDNN does not load")
    return cupy


def reference():
    """The im2col + GEMM kernels (gpu.conv2d_* dispatch to cuDNN)."""
    from caffempi.backend import gpu
    return gpu.im2col_conv2d_forward, gpu.im2col_conv2d_backward


def close(cp, got, want, tol=1e-4):
    got, want = cp.asnumpy(got), cp.asnumpy(want)
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, "max abs error %g vs max abs %g" % (err, scale)


def inputs(cp, x_shape, o, geom, group, seed=0):
    from caffempi.backend.cpu import conv_out_size
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    rs = np.random.RandomState(seed)
    n, c, h, wd = x_shape
    x = cp.asarray(rs.randn(*x_shape).astype(np.float32))
    w = cp.asarray((rs.randn(o, c // group, kh, kw) * 0.1).astype(np.float32))
    b = cp.asarray(rs.randn(o).astype(np.float32))
    y_shape = (n, o, conv_out_size(h, kh, sh, ph, dh), conv_out_size(wd, kw, sw, pw, dw))
    dy = cp.asarray(rs.randn(*y_shape).astype(np.float32))
    return x, w, b, dy


@pytest.mark.parametrize("name,x_shape,o,geom,group", CASES, ids=[c[0] for c in CASES])
def test_matches_im2col(cp, name, x_shape, o, geom, group):
    ref_fwd, ref_bwd = reference()
    x, w, b, dy = inputs(cp, x_shape, o, geom, group)
    close(cp, cudnn.conv2d_forward(x, w, geom, group, bias=b), ref_fwd(x, w, geom, group, bias=b))
    close(cp, cudnn.conv2d_forward(x, w, geom, group), ref_fwd(x, w, geom, group))
    dx, dw = cudnn.conv2d_backward(x, w, dy, geom, group)
    rx, rw = ref_bwd(x, w, dy, geom, group)
    close(cp, dx, rx)
    close(cp, dw, rw)
    # dx alone, without x (a transposed convolution), and dw alone
    dx2, none = cudnn.conv2d_backward(None, w, dy, geom, group, need_dw=False, x_shape=x.shape)
    assert none is None
    close(cp, dx2, rx)
    none, dw2 = cudnn.conv2d_backward(x, w, dy, geom, group, need_dx=False)
    assert none is None
    close(cp, dw2, rw)


ALGO_CASES = [c for c in CASES if c[0] in ("3x3_pad1", "5x5_nopad", "alexnet_conv2", "7x7_stride2_pad3")]


@pytest.mark.parametrize("name,x_shape,o,geom,group", ALGO_CASES, ids=[c[0] for c in ALGO_CASES])
def test_every_allowed_algorithm(cp, name, x_shape, o, geom, group):
    """Whichever algorithm the timing picks (it varies by GPU and load), each
    one not in EXCLUDED_ALGOS must meet the tolerance, in each direction,
    run as one grouped call and (grouped cases) one call per group."""
    ref_fwd, ref_bwd = reference()
    x, w, b, dy = inputs(cp, x_shape, o, geom, group, seed=1)
    ry = ref_fwd(x, w, geom, group)
    rx, rw = ref_bwd(x, w, dy, geom, group)
    cudnn.conv2d_forward(x, w, geom, group)
    cudnn.conv2d_backward(x, w, dy, geom, group)        # plan with all three directions
    plan = cudnn._plan(cp, x.shape, w.shape, geom, group, x.dtype)
    h = cudnn._handle(cp)
    runs = {"fwd": (lambda: cudnn.conv2d_forward(x, w, geom, group), ry),
            "bwd_data": (lambda: cudnn.conv2d_backward(
                None, w, dy, geom, group, need_dw=False, x_shape=x.shape)[0], rx),
            "bwd_filter": (lambda: cudnn.conv2d_backward(x, w, dy, geom, group, need_dx=False)[1], rw)}
    assert sorted(plan.desc) == sorted({1, group})
    chosen = dict(plan.algo)
    try:
        for d, (run, want) in runs.items():
            for calls in plan.desc:
                tried = 0
                for algo in range(8):
                    nbytes = plan._ws_size(h, d, calls, algo)
                    if nbytes is None or algo in cudnn.EXCLUDED_ALGOS[d] or nbytes > cudnn.WORKSPACE_CAP:
                        continue
                    plan.algo[d] = (calls, algo, nbytes)
                    try:
                        got = run()
                    except RuntimeError:        # supported in principle, not for this case
                        continue
                    close(cp, got, want)
                    tried += 1
                assert tried >= 1, (d, calls)
    finally:
        plan.algo.update(chosen)


def test_empty_batch(cp):
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    x = cp.zeros((0, 3, 8, 8), cp.float32)
    w = cp.ones((4, 3, 3, 3), cp.float32)
    assert cudnn.conv2d_forward(x, w, geom, 1).shape == (0, 4, 8, 8)
    dx, dw = cudnn.conv2d_backward(x, w, cp.zeros((0, 4, 8, 8), cp.float32), geom, 1)
    assert dx.shape == x.shape and dw.shape == w.shape and not dw.any()


def test_float64(cp):
    ref_fwd, ref_bwd = reference()
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    x, w, b, dy = (a.astype(cp.float64) for a in inputs(cp, (2, 4, 9, 8), 6, geom, 2))
    close(cp, cudnn.conv2d_forward(x, w, geom, 2, bias=b), ref_fwd(x, w, geom, 2, bias=b), 1e-10)
    for got, want in zip(cudnn.conv2d_backward(x, w, dy, geom, 2), ref_bwd(x, w, dy, geom, 2)):
        close(cp, got, want, 1e-10)


def test_plan_is_reused(cp):
    geom = (3, 3, 1, 1, 1, 1, 1, 1)
    x, w, b, dy = inputs(cp, (3, 5, 11, 13), 7, geom, 1, seed=3)
    cudnn.clear_cache()
    start = cudnn.find_calls
    y1 = cudnn.conv2d_forward(x, w, geom, 1)
    assert cudnn.find_calls == start + 1
    y2 = cudnn.conv2d_forward(x + 0, w, geom, 1)        # new arrays, same shapes
    assert cudnn.find_calls == start + 1
    cp.testing.assert_array_equal(y1, y2)
    cudnn.conv2d_backward(x, w, dy, geom, 1)             # one search per direction
    assert cudnn.find_calls == start + 3
    cudnn.conv2d_backward(x, w, dy, geom, 1)
    assert cudnn.find_calls == start + 3
    cudnn.conv2d_forward(x[:2], w, geom, 1)              # another batch size: a new plan
    assert cudnn.find_calls == start + 4
    assert len(cudnn._plans) == 2


def test_runs_on_current_stream(cp):
    ref_fwd, ref_bwd = reference()
    geom = (5, 5, 1, 1, 2, 2, 1, 1)
    x, w, b, dy = inputs(cp, (4, 8, 16, 16), 8, geom, 1, seed=5)
    want = ref_fwd(x, w, geom, 1, bias=b)
    cp.cuda.Device().synchronize()      # the inputs were made on the default stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        got = cudnn.conv2d_forward(x, w, geom, 1, bias=b)
    s.synchronize()
    close(cp, got, want)


def test_version(cp):
    assert cudnn.version() >= 8000
