"""Inverted dropout's mask on the CPU, drawn from the process RNG
(:func:`caffempi.common.rng`), so runs stay reproducible from the seed."""
import numpy as np

from ...common import rng


def dropout_scale(ratio, dtype):
    """1/(1-ratio) rounded as the mask's dtype divides it."""
    return (np.ones(1, dtype) / (1.0 - ratio))[0]


def dropout_mask(shape, ratio, dtype):
    """1/(1-ratio) with probability 1-ratio, else 0, of ``dtype``."""
    keep = rng().random_sample(shape) > ratio
    return keep.astype(dtype) / (1.0 - ratio)
