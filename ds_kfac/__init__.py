"""ds_kfac: distributed K-FAC gradient preconditioning for DeepSpeed and PyTorch.

* :func:`initialize` (DeepSpeed): ``deepspeed.initialize`` plus the ``"kfac"`` config section.
* :class:`KFACPreconditioner` (plain PyTorch / DDP): ``kfac.step()`` between backward and ``optimizer.step()``.

The conventions are in docs/conventions.md, the config keys in docs/config.md.
"""

from typing import Any

from .config import KFACConfig, KFACConfigError, PiecewiseSchedule
from .layers import UnsupportedLayerError, register_adapter
from .optimizers import Lamb, build_optimizer, resolve_lamb
from .preconditioner import KFACPreconditioner

__version__ = "0.1.0"

_DEEPSPEED_API = ("initialize", "add_config_arguments", "KFACEngine", "release_deepspeed_shm")


def __getattr__(name: str) -> Any:
    # DeepSpeed is imported only when its integration is used, so the standalone
    # preconditioner works (and imports quickly) with torch alone.
    if name in _DEEPSPEED_API:
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module 'ds_kfac' has no attribute {name!r}")


__all__ = [
    "KFACConfig",
    "KFACConfigError",
    "KFACEngine",
    "KFACPreconditioner",
    "Lamb",
    "PiecewiseSchedule",
    "UnsupportedLayerError",
    "add_config_arguments",
    "build_optimizer",
    "initialize",
    "register_adapter",
    "release_deepspeed_shm",
    "resolve_lamb",
]
