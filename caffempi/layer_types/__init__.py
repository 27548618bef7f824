"""Layer families; importing this package registers every layer type."""
from . import (conv, data, inner_product, input, loss, lrn, neuron, normalization,  # noqa: F401
               pooling, python, recurrent, scale, softmax, structure, window_data)
from .base import LAYER_REGISTRY, Layer, create_layer, register

__all__ = ["LAYER_REGISTRY", "Layer", "create_layer", "register"]
