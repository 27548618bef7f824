"""Im2col: the column layout against loops written here (kernel, stride,
pad, dilation, rectangular windows), finite-difference gradient (col2im),
errors for what is not supported."""
import numpy as np
import pytest

from caffempi.common import CaffeError
from caffempi.testing.gradient_check import check_gradient, run_layer


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def im2col_text(extra):
    return 'type: "Im2col" convolution_param { %s }' % extra


def ref_im2col(x, kernel, stride, pad, dil):
    """top[n, (c*kh + i)*kw + j, y, x] = x[n, c, y*sh - ph + i*dh, x*sw - pw + j*dw], 0 outside."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, pad, dil
    n, c, h, w = x.shape
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    out = np.zeros((n, c * kh * kw, oh, ow))
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                for y in range(oh):
                    for xo in range(ow):
                        hi, wi = y * sh - ph + i * dh, xo * sw - pw + j * dw
                        if 0 <= hi < h and 0 <= wi < w:
                            out[:, (ch * kh + i) * kw + j, y, xo] = x[:, ch, hi, wi]
    return out


CASES = [
    ("kernel_size: 3", (3, 3), (1, 1), (0, 0), (1, 1)),
    ("kernel_size: 3 pad: 1 stride: 2", (3, 3), (2, 2), (1, 1), (1, 1)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 1 pad_w: 0", (2, 3), (1, 2), (1, 0), (1, 1)),
    ("kernel_size: 2 dilation: 2 pad: 1", (2, 2), (1, 1), (1, 1), (2, 2)),
    ("kernel_size: 3 kernel_size: 2 stride: 2 stride: 1 dilation: 1 dilation: 2", (3, 2), (2, 1), (0, 0), (1, 2)),
]


@pytest.mark.parametrize("text,kernel,stride,pad,dil", CASES)
def test_forward_matches_loops(text, kernel, stride, pad, dil):
    x = rand(2, 3, 6, 7)
    _, _, top = run_layer(im2col_text(text), [x])
    want = ref_im2col(x, kernel, stride, pad, dil)
    assert top[0].shape == want.shape
    np.testing.assert_array_equal(top[0].data, want)


@pytest.mark.parametrize("text,kernel,stride,pad,dil", CASES)
def test_gradient(text, kernel, stride, pad, dil):
    check_gradient(im2col_text(text), [rand(2, 2, 5, 6)])


def test_backward_sums_the_overlapping_taps():
    # 3x3 windows at stride 1 over a 3x4 image: pixel (r, c) is read by as
    # many windows as contain it; with an all-ones top diff that is its count
    layer, bottom, top = run_layer(im2col_text("kernel_size: 3"), [rand(1, 1, 3, 4)])
    top[0].diff = np.ones(top[0].shape)
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, [[[[1, 2, 2, 1]] * 3]])


@pytest.mark.parametrize("text,shape,match", [
    ("kernel_size: 3", (1, 2, 6), "only 2-D"),
    ("kernel_size: 3 axis: 2", (1, 2, 6, 6), "only 2-D"),
    ("kernel_size: 7", (1, 2, 6, 6), "too small"),
    ("stride: 2", (1, 2, 6, 6), "kernel"),
    ("kernel_size: 3 dilation: 1 dilation: 1 dilation: 1", (1, 2, 6, 6), "dilation"),
])
def test_errors(text, shape, match):
    with pytest.raises(CaffeError, match=match):
        run_layer(im2col_text(text), [np.zeros(shape)])
