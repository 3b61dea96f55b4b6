"""``"grad_worker_fraction": "auto"`` resolved in ``ds_kfac.initialize``, once for every rank.

Rank 0 chooses (:func:`ds_kfac.planning.auto.choose_fraction`: the calibration's predicted fastest preset) and
broadcasts the choice, or the error that stopped it, so every rank builds the same placement or raises the same
:class:`~ds_kfac.KFACConfigError`; nobody waits on a rank that failed. The choice is logged on rank 0, and the
config the engine gets carries it with its ``calibration`` (which only a chosen config does), so that the
checkpoint records it (:mod:`ds_kfac.checkpoint`) and a resume that chooses otherwise is refused.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import log_dist

from ..config import KFACConfig, KFACConfigError
from ..planning.auto import choose_fraction


def resolve_auto(
    kfac_config: KFACConfig,
    config: dict[str, Any],
    model: torch.nn.Module,
    mpu: Any,
    param_groups: Optional[Sequence[Any]],
) -> KFACConfig:
    """``kfac_config`` with ``"auto"`` replaced by the chosen preset (unchanged without ``"auto"``). ``config``: the
    DeepSpeed config with its ``"kfac"`` section; ``param_groups``: the optimizer's parameters as ZeRO will
    partition them. Collective: every rank calls it after the process group is up."""
    if not kfac_config.enabled or kfac_config.grad_worker_fraction != "auto":
        return kfac_config
    if mpu is not None or isinstance(model, PipelineModule):
        raise KFACConfigError(
            "kfac.grad_worker_fraction='auto' with tensor or pipeline parallelism: the placement is predicted for "
            "data parallelism only (name a fraction or a preset)"
        )
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = choose_fraction(config, model, dist.get_world_size(), param_groups)
        except Exception as err:  # every rank raises it: none waits for a choice that never comes
            answer[0] = (isinstance(err, ValueError), f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(answer, src=0)
    choice = answer[0]
    if isinstance(choice, tuple):
        is_config, message = choice
        if is_config:  # KFACConfigError is a ValueError
            raise KFACConfigError(message.split(": ", 1)[1])
        raise RuntimeError(f"choosing kfac.grad_worker_fraction 'auto' failed on rank 0: {message}")
    log_dist(choice.describe(), ranks=[0])
    return kfac_config.model_copy(update={"grad_worker_fraction": choice.fraction})
