"""What :class:`~ds_kfac.KFACPreconditioner` builds from its arguments: the checked config, the registered
layers and their curvature blocks, and the refusals of what its setup cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.distributed import ProcessGroup

from ..collection import LossScale
from ..comm import data_parallel_world
from ..config import KFACConfig, KFACConfigError
from ..curvature import (
    CurvatureBlock,
    KFACBlock,
    OneSidedBlock,
    OneSidedEigen,
    UnitWiseBlock,
    UnitWiseInverse,
    method_for,
    solver_for,
)
from ..curvature.moments import MomentRule
from ..layers import BatchNormAdapter, LayerAdapter, SkippedLayer, find_layers, kept_sides
from ..optimizers import GROUP_KEY, moment_settings
from ..placement import (
    GradientLayout,
    TensorParallelGradients,
    refuse_layers_differing_between_ranks,
    split_tensor_parallel,
)


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
    elif config is None or isinstance(config, dict):
        config = KFACConfig.parse({**(config or {}), **keys}, where="KFACPreconditioner")
    else:
        raise KFACConfigError(
            f'KFACPreconditioner(config=...) must be a dict of the "kfac" keys or a KFACConfig, got '
            f"{type(config).__name__}: {config!r}"[:200]
        )
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


@dataclass
class Registered:
    """The layers K-FAC preconditions on this rank, and what tensor-parallel layers change."""

    blocks: list[CurvatureBlock]
    skipped: list[SkippedLayer]
    relays: list[LayerAdapter]
    """Tensor-parallel layers whose factors another rank of their group holds."""
    layout: Optional[GradientLayout]
    """The given layout, or the tensor-parallel layers' own."""
    model_parallel_group: Optional[ProcessGroup]
    """The given group, or, where ``None``, the tensor-parallel layers' group."""


def _find_layers(
    model: nn.Module, config: KFACConfig, warn: bool
) -> tuple[list[tuple[str, LayerAdapter]], list[SkippedLayer]]:
    """The layers ``config`` registers in ``model`` (:func:`~ds_kfac.layers.find_layers`) and those it skips."""
    return find_layers(
        model,
        config.skip_layers,
        config.max_factor_dim,
        conv_factors=config.conv_factors,
        warn=warn,
        tensor_parallel_factors=config.tensor_parallel_factors,
        batchnorm=config.batchnorm == "unit-wise",
        tied=config.tied_layers == "precondition",
        one_sided_dim=config.eigenbasis_max_dim,
    )


def model_blocks(model: nn.Module, config: KFACConfig) -> tuple[list[CurvatureBlock], list[SkippedLayer]]:
    """The blocks ``config`` registers in ``model`` as each data-parallel rank builds them, and the layers it skips,
    with no communication (no check across ranks) and no tensor-parallel layers: what :mod:`ds_kfac.planning` plans
    for, on a model that may lie on the meta device."""
    layers, skipped = _find_layers(model, config, warn=False)
    return [make_block(config, name, adapter) for name, adapter in layers], skipped


def preconditioned_parameters(model: nn.Module, config: KFACConfig) -> list[nn.Parameter]:
    """The parameters of the layers ``config`` registers in ``model`` (weights and biases), in registration order,
    known before any preconditioner is built: those whose optimizer groups ``eigenbasis_moments`` flags."""
    return [p for _, adapter in _find_layers(model, config, warn=False)[0] for p in adapter.params()]


def carried_scale(loss_scale: LossScale, optimizer: Optional[torch.optim.Optimizer]) -> Callable[[], float]:
    """The scale a standalone loop's gradients carry at ``kfac.step()``, which the moments of ``eigenbasis_moments``
    and the KL clip take out: ``loss_scale``'s value, except for a ``torch.amp.GradScaler``'s ``get_scale`` whose
    ``unscale_(optimizer)`` already ran this step (1 then; the scaler would otherwise unscale K-FAC's directions in
    its ``step``). Reads the scaler's per-optimizer stage, a private attribute (docs/maintainers.md)."""
    scaler = getattr(loss_scale, "__self__", None)
    if not isinstance(scaler, torch.amp.GradScaler) or optimizer is None:
        return lambda: float(loss_scale())

    def scale() -> float:
        state = scaler._per_optimizer_states.get(id(optimizer))
        unscaled = state is not None and state["stage"] is not OptState.READY
        return 1.0 if unscaled else float(loss_scale())

    return scale


def moment_rule(
    config: KFACConfig, moments: Optional[MomentRule], optimizer: Optional[torch.optim.Optimizer]
) -> Optional[MomentRule]:
    """The per-element rule ``eigenbasis_moments`` applies in the eigenbasis: ``moments`` as given, else the base
    ``optimizer``'s (its flagged groups); ``None`` without the key."""
    if not config.eigenbasis_moments:
        if moments is not None:
            raise KFACConfigError("moments= is the rule of eigenbasis_moments, which this config leaves off")
        return None
    if moments is not None:
        return moments
    if optimizer is None:
        raise KFACConfigError(
            "eigenbasis_moments needs the base optimizer: pass optimizer= (ds_kfac.optimizers.Lamb or Adam, "
            "its K-FAC layers' parameters in groups made by ds_kfac.optimizers.split_groups) or moments="
        )
    try:
        return MomentRule(**moment_settings(optimizer))
    except ValueError as err:
        raise KFACConfigError(str(err)) from None


def refuse_unflagged(blocks: list[CurvatureBlock], optimizer: Optional[torch.optim.Optimizer]) -> None:
    """With ``eigenbasis_moments`` and the base optimizer's own parameters: the flagged groups must hold exactly
    the registered layers' parameters (else a layer would be normalised twice, or a flagged parameter would
    take its raw gradient as a direction)."""
    if optimizer is None:
        return
    flagged = {id(p) for g in optimizer.param_groups if g.get(GROUP_KEY) for p in g["params"]}
    names = {id(p): f"{b.name}.{n}" for b in blocks for n, p in zip(("weight", "bias"), b.adapter.params())}
    missing = sorted(name for key, name in names.items() if key not in flagged)
    extra = len(flagged - set(names))
    if missing or extra:
        raise KFACConfigError(
            f"eigenbasis_moments: the optimizer's groups flagged {GROUP_KEY!r} must hold exactly the K-FAC layers' "
            f"parameters (ds_kfac.optimizers.split_groups); not flagged: {missing}; flagged but not K-FAC's: {extra}"
        )


def register_layers(
    model: nn.Module,
    config: KFACConfig,
    process_group: Optional[ProcessGroup],
    layout: Optional[GradientLayout],
    model_parallel_group: Optional[ProcessGroup],
    warn: bool,
) -> Registered:
    """Find the model's layers (``warn``: say what was not registered), check that every data-parallel rank
    registers the same ones (collective), and build their blocks; tensor-parallel layers bring their own layout
    and group."""
    layers, skipped = _find_layers(model, config, warn)
    refuse_layers_differing_between_ranks(layers, skipped, process_group, model)
    relays = []
    tensor_parallel = split_tensor_parallel(layers)
    if tensor_parallel is not None:
        refuse_tensor_parallel(config, layout, process_group, exact=bool(tensor_parallel.exact))
        layers, relays = tensor_parallel.kept, tensor_parallel.relays
        layout = TensorParallelGradients(tensor_parallel.exact, tensor_parallel.group)
        if model_parallel_group is None:
            model_parallel_group = tensor_parallel.group
    blocks = [make_block(config, name, adapter) for name, adapter in layers]
    return Registered(blocks, skipped, relays, layout, model_parallel_group)


def make_block(config: KFACConfig, name: str, adapter: LayerAdapter) -> CurvatureBlock:
    """The curvature block of a registered layer: unit-wise for BatchNorm, Kronecker-factored otherwise."""
    factor_dtype, inv_dtype = config.factor_torch_dtype, config.inv_torch_dtype
    if isinstance(adapter, BatchNormAdapter):
        return UnitWiseBlock(name, adapter, UnitWiseInverse(config.relative_damping), factor_dtype, inv_dtype)
    kept = kept_sides(adapter, config.eigenbasis_max_dim)  # find_layers skipped a layer with none
    if len(kept) == 1:
        method = OneSidedEigen(next(iter(kept)), solver_for(config))
        return OneSidedBlock(name, adapter, method, factor_dtype, inv_dtype)
    return KFACBlock(
        name,
        adapter,
        method_for(config),
        factor_dtype,
        inv_dtype,
        eigenvalue_correction=config.eigenvalue_correction,
        eigenbasis_moments=config.eigenbasis_moments,
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
    if config.eigenbasis_moments:
        problems.append("eigenbasis_moments (a shard's moments would need the whole layer's eigenbasis)")
    if problems:
        raise KFACConfigError("K-FAC with tensor-parallel layers does not support: " + "; ".join(problems))
