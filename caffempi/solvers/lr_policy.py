"""Learning-rate policies of Caffe's SGDSolver::GetLearningRate.

    fixed:     base_lr
    step:      base_lr * gamma ^ floor(iter / stepsize)
    exp:       base_lr * gamma ^ iter
    inv:       base_lr * (1 + gamma * iter) ^ (-power)
    multistep: base_lr * gamma ^ current_step, current_step advancing by one
               (at most one per call, as in Caffe) when iter >= stepvalue[step]
    poly:      base_lr * (1 - iter / max_iter) ^ power
    sigmoid:   base_lr * 1 / (1 + exp(-gamma * (iter - stepsize)))

NVCaffe's SolverParameter fields, as its SGDSolver::GetLearningRate: during
the first ``rampup_interval`` iterations the rate is rampup_lr + (base_lr -
rampup_lr) * (iter / rampup_interval)^2 whatever the policy; ``min_lr`` is a
floor under every policy, and poly decays to it: (base_lr - min_lr) *
(1 - iter / max_iter) ^ power + min_lr.

The result is rounded to float32 (Caffe's ``Dtype rate``).
"""
import math

import numpy as np

from ..common import CaffeError, log

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def _pow(a, b):
    try:
        return math.pow(a, b)
    except OverflowError:
        return math.inf
    except ValueError:  # negative base with a fractional exponent
        return math.nan


def check_policy(param):
    """Reject an unknown policy or parameters Caffe's CHECKs reject, once at
    solver construction (Caffe fails at the first GetLearningRate)."""
    policy = param.lr_policy
    if policy not in POLICIES:
        raise CaffeError("unknown lr_policy '%s' (known: %s)" % (policy, ", ".join(POLICIES)))
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        raise CaffeError("lr_policy '%s' needs gamma >= 0, got %g" % (policy, param.gamma))
    if policy == "step" and param.stepsize <= 0:
        raise CaffeError("lr_policy 'step' needs stepsize > 0, got %d" % param.stepsize)
    if policy == "poly" and param.max_iter <= 0:
        raise CaffeError("lr_policy 'poly' needs max_iter > 0")
    if param.min_lr < 0 or (policy == "poly" and param.base_lr < param.min_lr):
        raise CaffeError("min_lr must be >= 0 (and <= base_lr for lr_policy 'poly'), got %g"
                         % param.min_lr)


def learning_rate(param, it, current_step, info=None):
    """(rate, current_step) for iteration ``it``; ``current_step`` is the
    solver's step counter (updated for step/multistep).  ``info(fmt, *args)``
    logs multistep changes (default: caffempi's log at INFO)."""
    info = info or log.info
    policy = param.lr_policy
    base = float(np.float32(param.base_lr))
    gamma = float(np.float32(param.gamma))
    power = float(np.float32(param.power))
    min_lr = float(np.float32(param.min_lr))
    if it < param.rampup_interval:
        rampup = float(np.float32(param.rampup_lr))
        alpha = it / param.rampup_interval
        rate = rampup + (base - rampup) * alpha * alpha
    elif policy == "fixed":
        rate = base
    elif policy == "step":
        current_step = it // param.stepsize
        rate = base * _pow(gamma, current_step)
    elif policy == "exp":
        rate = base * _pow(gamma, it)
    elif policy == "inv":
        rate = base * _pow(float(np.float32(1.0 + np.float32(gamma) * np.float32(it))), -power)
    elif policy == "multistep":
        if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
            current_step += 1
            info("MultiStep Status: Iteration %d, step = %d", it, current_step)
        rate = base * _pow(gamma, current_step)
    elif policy == "poly":
        frac = float(np.float32(np.float32(it) / np.float32(param.max_iter)))
        rate = (base - min_lr) * _pow(1.0 - frac, power) + min_lr
    elif policy == "sigmoid":
        x = -gamma * (float(it) - float(param.stepsize))
        rate = base * (1.0 / (1.0 + (math.exp(x) if x < 700 else math.inf)))
    else:  # pragma: no cover - check_policy ran first
        raise CaffeError("unknown lr_policy '%s'" % policy)
    return float(np.float32(max(rate, min_lr))), current_step
