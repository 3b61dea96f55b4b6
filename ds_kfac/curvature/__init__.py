"""Curvature: Kronecker factors, their decompositions, and per-layer blocks."""

from .background import Background
from .basis import REFRESH_KINDS, BasisSolver, solver_for
from .block import CurvatureBlock, KFACBlock, blocks_device
from .correction import EigenvalueCorrection
from .decomposition import (
    METHODS,
    Decomposition,
    EigenDecomposition,
    EigenOuterDecomposition,
    InverseDecomposition,
    method_for,
)
from .factors import KroneckerFactor, RunningAverage
from .fisher import FisherLoss, sampled_loss
from .numerics import all_finite, curvature_floor
from .onesided import OneSidedBlock, OneSidedEigen
from .refresh import AdaptiveRefresh
from .stacked import StackedStates
from .unitwise import UnitFisher, UnitWiseBlock, UnitWiseInverse

__all__ = [
    "METHODS",
    "AdaptiveRefresh",
    "Background",
    "BasisSolver",
    "REFRESH_KINDS",
    "CurvatureBlock",
    "Decomposition",
    "EigenDecomposition",
    "EigenvalueCorrection",
    "FisherLoss",
    "EigenOuterDecomposition",
    "InverseDecomposition",
    "KFACBlock",
    "KroneckerFactor",
    "OneSidedBlock",
    "OneSidedEigen",
    "RunningAverage",
    "StackedStates",
    "UnitFisher",
    "UnitWiseBlock",
    "UnitWiseInverse",
    "all_finite",
    "blocks_device",
    "curvature_floor",
    "method_for",
    "solver_for",
    "sampled_loss",
]
