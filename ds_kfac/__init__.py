"""ds_kfac: distributed K-FAC gradient preconditioning for DeepSpeed and PyTorch.

Standalone: :class:`KFACPreconditioner`. The conventions are in docs/conventions.md.
"""

from .config import KFACConfig, KFACConfigError, PiecewiseSchedule
from .layers import UnsupportedLayerError, register_adapter
from .preconditioner import KFACPreconditioner

__version__ = "0.1.0"

__all__ = [
    "KFACConfig",
    "KFACConfigError",
    "KFACPreconditioner",
    "PiecewiseSchedule",
    "UnsupportedLayerError",
    "register_adapter",
]
