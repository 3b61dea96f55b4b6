"""The parts of :class:`~ds_kfac.KFACPreconditioner` around its step: building it, scheduling
decompositions, the sampled Fisher's pass, and reporting."""

from .build import (
    Registered,
    checked_config,
    make_block,
    preconditioned_parameters,
    refuse_tensor_parallel,
    register_layers,
)
from .fisher import SampledFisher
from .metrics import Reporting
from .schedule import DecompositionSchedule

__all__ = [
    "DecompositionSchedule",
    "Registered",
    "Reporting",
    "SampledFisher",
    "checked_config",
    "make_block",
    "preconditioned_parameters",
    "refuse_tensor_parallel",
    "register_layers",
]
