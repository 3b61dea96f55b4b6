"""ds_kfac: distributed K-FAC gradient preconditioning for DeepSpeed and PyTorch.

* :func:`initialize` (DeepSpeed): ``deepspeed.initialize`` plus the ``"kfac"`` and ``"easgd"`` config sections;
  :func:`init_distributed`: ``deepspeed.init_distributed`` that refuses a stale build lock instead of hanging.
* :class:`KFACPreconditioner` (plain PyTorch / DDP): ``kfac.step()`` between backward and ``optimizer.step()``.
* :func:`shutdown` (both): the last call of a training script, on every rank.
* :class:`ds_kfac.hf.KFACTrainer` (Hugging Face ``Trainer`` with DeepSpeed): imports transformers and accelerate,
  which ``import ds_kfac`` does not.

The conventions are in docs/conventions.md, the config keys in docs/config.md.
"""

import importlib
from typing import Any

from .config import KFACConfig, KFACConfigError, PiecewiseSchedule
from .easgd import EASGDConfig
from .integration import release_deepspeed_shm, shutdown
from .layers import UnsupportedLayerError, register_adapter
from .optimizers import Lamb, build_optimizer, resolve_lamb
from .preconditioner import KFACPreconditioner
from .preconditioning import preconditioned_parameters

__version__ = "0.1.0"

_DEEPSPEED_API = {
    "initialize": "initialize",
    "init_distributed": "extensions",
    "add_config_arguments": "initialize",
    "KFACEngine": "engine",
    "KFACPipelineEngine": "pipeline",
    "EASGDEngine": "easgd",
    "KFACEASGDEngine": "easgd",
}
"""Names that import DeepSpeed, and their module in ``ds_kfac.integration``."""


def __getattr__(name: str) -> Any:
    # DeepSpeed is imported only when its integration is used, so the standalone
    # preconditioner works (and imports quickly) with torch alone.
    if name in _DEEPSPEED_API:
        return getattr(importlib.import_module(f".integration.{_DEEPSPEED_API[name]}", __name__), name)
    raise AttributeError(f"module 'ds_kfac' has no attribute {name!r}")


__all__ = [
    "EASGDConfig",
    "EASGDEngine",
    "KFACConfig",
    "KFACConfigError",
    "KFACEASGDEngine",
    "KFACEngine",
    "KFACPipelineEngine",
    "KFACPreconditioner",
    "Lamb",
    "PiecewiseSchedule",
    "UnsupportedLayerError",
    "add_config_arguments",
    "build_optimizer",
    "init_distributed",
    "initialize",
    "preconditioned_parameters",
    "register_adapter",
    "release_deepspeed_shm",
    "resolve_lamb",
    "shutdown",
]
