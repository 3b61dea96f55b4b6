"""What :class:`~ds_kfac.KFACPreconditioner` builds from its arguments: the checked config, each layer's
curvature block, and the refusals of what its setup cannot run."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch.distributed import ProcessGroup

from ..comm import data_parallel_world
from ..config import KFACConfig, KFACConfigError
from ..curvature import CurvatureBlock, KFACBlock, UnitWiseBlock, UnitWiseInverse, method_for
from ..layers import BatchNormAdapter, LayerAdapter
from ..placement import GradientLayout


def checked_config(
    config: Union[KFACConfig, dict[str, Any], None],
    keys: dict[str, Any],
    optimizer: Optional[torch.optim.Optimizer],
    lr: Union[float, Callable[[int], float], None],
    accumulation_steps: int,
    micro_batch: Optional[Callable[[], int]],
) -> KFACConfig:
    """The ``"kfac"`` section from ``config`` or ``keys``, checked with the arguments it needs."""
    if isinstance(config, KFACConfig):
        if keys:
            raise KFACConfigError("pass either a KFACConfig or keyword keys, not both")
    else:
        config = KFACConfig.parse({**(config or {}), **keys}, where="KFACPreconditioner")
    if config.kl_clip is not None and optimizer is None and lr is None:
        raise KFACConfigError("kl_clip needs the learning rate: pass optimizer= or lr= (or set kl_clip=None)")
    if accumulation_steps < 1:
        raise KFACConfigError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    subset = config.factor_micro_batches
    if subset is not None and subset < accumulation_steps and micro_batch is None:
        raise KFACConfigError(
            f"factor_micro_batches={subset} with accumulation_steps={accumulation_steps}: pass micro_batch= "
            f"(a callable giving the 0-based index in the step of the micro-batch being run), so the hooks "
            f"know which micro-batches are the last {subset}"
        )
    return config


def make_block(config: KFACConfig, name: str, adapter: LayerAdapter) -> CurvatureBlock:
    """The curvature block of a registered layer: unit-wise for BatchNorm, Kronecker-factored otherwise."""
    factor_dtype, inv_dtype = config.factor_torch_dtype, config.inv_torch_dtype
    if isinstance(adapter, BatchNormAdapter):
        return UnitWiseBlock(name, adapter, UnitWiseInverse(config.relative_damping), factor_dtype, inv_dtype)
    return KFACBlock(
        name, adapter, method_for(config), factor_dtype, inv_dtype, eigenvalue_correction=config.eigenvalue_correction
    )


def refuse_tensor_parallel(
    config: KFACConfig, layout: Optional[GradientLayout], process_group: Optional[ProcessGroup], exact: bool
) -> None:
    """Refuse what tensor-parallel layers cannot run with, naming it."""
    problems = []
    if layout is not None:
        problems.append(
            f"gradient layout {type(layout).__name__} (ZeRO stage 1-3): tensor-parallel layers need each "
            f"shard's whole gradient (ZeRO stage 0)"
        )
    if process_group is None and data_parallel_world() > 1:
        problems.append(
            "process_group=None: pass the data-parallel group (megatron.core.parallel_state."
            "get_data_parallel_group()), over which factors are averaged"
        )
    if exact and config.factor_reduction == "local":
        problems.append('factor_reduction="local" with tensor_parallel_factors="exact"')
    if config.eigenvalue_correction:
        problems.append("eigenvalue_correction (per-example gradients of sharded layers are not gathered)")
    if config.fisher == "sampled":
        problems.append('fisher="sampled" (the sharded layers\' rows travel in every backward pass)')
    if problems:
        raise KFACConfigError("K-FAC with tensor-parallel layers does not support: " + "; ".join(problems))
