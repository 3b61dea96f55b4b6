"""What ds_kfac's optimizers (:class:`~.lamb.Lamb`, :class:`~.adam.Adam`) share: argument checks, the
``closure`` protocol of ``torch.optim`` and the dtype of their moments."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

ParamsT = Union[Iterable[Tensor], Iterable[dict[str, Any]]]


def check_hyperparameters(name: str, lr: float, eps: float, betas: tuple[float, float], weight_decay: float) -> None:
    """Raise ``ValueError`` naming the optimizer and the value for a negative ``lr``, ``eps`` or ``weight_decay``, or
    ``betas`` that are not two values in [0, 1)."""
    if lr < 0.0:
        raise ValueError(f"{name}: invalid lr {lr}, must be >= 0")
    if eps < 0.0:
        raise ValueError(f"{name}: invalid eps {eps}, must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: invalid betas {betas}, need two values in [0, 1)")
    if weight_decay < 0.0:
        raise ValueError(f"{name}: invalid weight_decay {weight_decay}, must be >= 0")


def evaluate_closure(closure: Optional[Callable[[], float]]) -> Optional[float]:
    """The loss ``closure`` returns, evaluated with gradients enabled (``torch.optim``'s protocol), or ``None``."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def state_dtype(param: Tensor) -> torch.dtype:
    """Moment estimates are float32 for half-precision parameters, else the parameter's dtype."""
    return torch.promote_types(param.dtype, torch.float32)
