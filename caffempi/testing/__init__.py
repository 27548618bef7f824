"""Helpers for tests: building single layers and finite-difference checks."""
from .gradient_check import check_gradient, make_layer, run_layer

__all__ = ["check_gradient", "make_layer", "run_layer"]
