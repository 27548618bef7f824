"""Backend dispatch for the kernels that need a per-backend implementation
(convolution, pooling, LRN).  Each function takes the array module ``xp`` first
and forwards to the NumPy kernels in :mod:`caffempi.backend.cpu`; the CuPy
versions are not written yet."""
import numpy as np

from . import cpu


def _impl(xp, name):
    if xp is np:
        return getattr(cpu, name)
    raise NotImplementedError(
        "kernel '%s' has only a NumPy implementation so far; array module %s is not supported"
        % (name, getattr(xp, "__name__", xp)))


conv_out_size = cpu.conv_out_size


def conv2d_forward(xp, x, w, geom, group, bias=None):
    return _impl(xp, "conv2d_forward")(x, w, geom, group, bias)


def conv2d_backward(xp, x, w, dy, geom, group, need_dx=True, need_dw=True, x_shape=None):
    return _impl(xp, "conv2d_backward")(x, w, dy, geom, group, need_dx, need_dw, x_shape)


def bias_grad(xp, dy):
    return _impl(xp, "bias_grad")(dy)


def max_pool_forward(xp, x, geom, oh, ow):
    return _impl(xp, "max_pool_forward")(x, geom, oh, ow)


def max_pool_backward(xp, dy, idx, x_shape, overlapping=True):
    return _impl(xp, "max_pool_backward")(dy, idx, x_shape, overlapping)


def ave_pool_forward(xp, x, geom, oh, ow):
    return _impl(xp, "ave_pool_forward")(x, geom, oh, ow)


def ave_pool_backward(xp, dy, geom, x_shape):
    return _impl(xp, "ave_pool_backward")(dy, geom, x_shape)


def lrn_forward(xp, x, size, alpha, beta, k, across_channels):
    return _impl(xp, "lrn_forward")(x, size, alpha, beta, k, across_channels)


def lrn_backward(xp, x, y, scale, dy, size, alpha, beta, across_channels):
    return _impl(xp, "lrn_backward")(x, y, scale, dy, size, alpha, beta, across_channels)
