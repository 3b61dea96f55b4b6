"""Layers: K-FAC's view of each supported module type, and which modules to register."""

from .base import LayerAdapter, UnsupportedLayerError, param_shape
from .batchnorm import BatchNormAdapter
from .conv2d import Conv2dAdapter
from .linear import LinearAdapter
from .registry import SkippedLayer, adapter_for, find_layers, kept_sides, register_adapter
from .tensor_parallel import TensorParallelAdapter, TensorParallelFactors

__all__ = [
    "BatchNormAdapter",
    "Conv2dAdapter",
    "LayerAdapter",
    "LinearAdapter",
    "SkippedLayer",
    "TensorParallelAdapter",
    "TensorParallelFactors",
    "UnsupportedLayerError",
    "adapter_for",
    "find_layers",
    "kept_sides",
    "param_shape",
    "register_adapter",
]
