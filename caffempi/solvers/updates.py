"""Caffe's update rules on flat float32 buffers.

Every function works in place on whole flat buffers (the net's ``param_diff``
and the solver's history buffers of the same length) with array module ``xp``
(NumPy or CuPy).  ``local_rate`` is either a float32 scalar (all parameters
share one lr_mult) or a flat float32 vector (``rate * lr_mult`` expanded per
element).  On return ``diff`` holds the update value; the caller then does
``data -= diff`` (Caffe's Net::Update).  ``tmp`` is scratch of the same length.

The arithmetic follows src/caffe/solvers/*_solver.cpp term for term:

* SGD       h = lr*g + m*h;                  g = h
* Nesterov  u = h; h = lr*g + m*h;            g = (1+m)*h - m*u
* AdaGrad   h += g^2;                        g = lr * g / (sqrt(h) + delta)
* RMSProp   h = (1-d)*g^2 + d*h;             g = lr * g / (sqrt(h) + delta)
* AdaDelta  hg = (1-m)*g^2 + m*hg;
            g = g * sqrt((hu + delta) / (hg + delta));
            hu = (1-m)*g^2 + m*hu;           g = lr * g
* Adam      m1 = (1-b1)*g + b1*m1; v = (1-b2)*g^2 + b2*v;
            g = lr * corr * m1 / (sqrt(v) + delta),
            corr = sqrt(1 - b2^t) / (1 - b1^t), t = iter + 1
"""
import numpy as np

f32 = np.float32


def axpby(xp, alpha, x, beta, y, tmp):
    """y = alpha*x + beta*y (caffe_cpu_axpby); alpha may be a vector."""
    xp.multiply(x, alpha, out=tmp)
    y *= beta
    y += tmp


def sgd(xp, diff, hist, tmp, local_rate, momentum):
    axpby(xp, local_rate, diff, f32(momentum), hist, tmp)
    diff[...] = hist


def nesterov(xp, diff, hist, tmp, local_rate, momentum, update):
    """``update``: scratch of the length of ``diff`` (Caffe's update_)."""
    m = f32(momentum)
    update[...] = hist                         # history saved for stepping back
    axpby(xp, local_rate, diff, m, hist, tmp)  # update history
    # diff = (1 + m) * h - m * update
    xp.multiply(hist, f32(1) + m, out=diff)
    update *= -m
    diff += update


def mean_square(xp, g, decay, h, tmp):
    """h = (1-decay)*g^2 + decay*h (decay a float32)."""
    xp.multiply(g, g, out=tmp)
    axpby(xp, f32(1) - decay, tmp, decay, h, tmp)


def rms_step(xp, num, hist, delta, rate, tmp, out):
    """out = rate * num / (sqrt(hist) + delta)."""
    xp.sqrt(hist, out=tmp)
    tmp += f32(delta)
    xp.divide(num, tmp, out=tmp)
    xp.multiply(tmp, rate, out=out)


def adagrad(xp, diff, hist, tmp, local_rate, delta):
    xp.multiply(diff, diff, out=tmp)
    hist += tmp
    rms_step(xp, diff, hist, delta, local_rate, tmp, diff)


def rmsprop(xp, diff, hist, tmp, local_rate, rms_decay, delta):
    mean_square(xp, diff, f32(rms_decay), hist, tmp)
    rms_step(xp, diff, hist, delta, local_rate, tmp, diff)


def adadelta(xp, diff, hist_g, hist_u, tmp, local_rate, momentum, delta, upd):
    """``upd``: scratch of the length of ``diff`` (Caffe's update_)."""
    m = f32(momentum)
    dl = f32(delta)
    mean_square(xp, diff, m, hist_g, tmp)          # history of gradients
    # sqrt((hu + delta) / (hg + delta))
    xp.add(hist_u, dl, out=upd)
    xp.add(hist_g, dl, out=tmp)
    xp.divide(upd, tmp, out=upd)
    xp.sqrt(upd, out=upd)
    diff *= upd
    mean_square(xp, diff, m, hist_u, tmp)          # history of updates
    # learning rate last
    xp.multiply(diff, local_rate, out=diff)


def adam_correction(beta1, beta2, t):
    """sqrt(1 - b2^t) / (1 - b1^t) as Caffe computes it (double, then float)."""
    b1, b2 = float(f32(beta1)), float(f32(beta2))
    return f32(np.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t))


def adam(xp, diff, m1, v, tmp, local_rate, beta1, beta2, delta, corr):
    """``corr``: :func:`adam_correction` of this step (a float32, or a 0-d
    array holding it)."""
    b1, b2 = f32(beta1), f32(beta2)
    axpby(xp, f32(1) - b1, diff, b1, m1, tmp)      # m = (1-b1) g + b1 m
    mean_square(xp, diff, b2, v, tmp)               # v = (1-b2) g^2 + b2 v
    if np.ndim(local_rate):                         # g is free now: the rates go there
        local_rate = xp.multiply(local_rate, corr, out=diff)
    else:
        local_rate = local_rate * corr
    rms_step(xp, m1, v, delta, local_rate, tmp, diff)
