"""Curvature: Kronecker factors, their decompositions, and per-layer blocks."""

from .block import KFACBlock, blocks_device
from .decomposition import METHODS, Decomposition, EigenDecomposition, InverseDecomposition, all_finite
from .factors import KroneckerFactor
from .refresh import AdaptiveRefresh

__all__ = [
    "METHODS",
    "AdaptiveRefresh",
    "Decomposition",
    "EigenDecomposition",
    "InverseDecomposition",
    "KFACBlock",
    "KroneckerFactor",
    "all_finite",
    "blocks_device",
]
