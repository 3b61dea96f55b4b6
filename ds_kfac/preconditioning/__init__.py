"""The parts of :class:`~ds_kfac.KFACPreconditioner` around its step: building it, scheduling
decompositions, and reporting."""

from .build import checked_config, make_block, refuse_tensor_parallel
from .metrics import memory_usage, option_metrics, step_metrics
from .schedule import DecompositionSchedule

__all__ = [
    "DecompositionSchedule",
    "checked_config",
    "make_block",
    "memory_usage",
    "option_metrics",
    "refuse_tensor_parallel",
    "step_metrics",
]
