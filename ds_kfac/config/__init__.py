"""Configuration: the validated ``"kfac"`` section and hyperparameter schedules."""

from .schedules import PiecewiseSchedule, resolve
from .schema import KFACConfig, KFACConfigError

__all__ = ["KFACConfig", "KFACConfigError", "PiecewiseSchedule", "resolve"]
