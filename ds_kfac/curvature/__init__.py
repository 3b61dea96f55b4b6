"""Curvature: Kronecker factors, their decompositions, and per-layer blocks."""

from .block import KFACBlock
from .decomposition import METHODS, Decomposition, EigenDecomposition, InverseDecomposition, all_finite
from .factors import KroneckerFactor

__all__ = [
    "METHODS",
    "Decomposition",
    "EigenDecomposition",
    "InverseDecomposition",
    "KFACBlock",
    "KroneckerFactor",
    "all_finite",
]
