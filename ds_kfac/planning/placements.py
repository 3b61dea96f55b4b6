"""Every placement of one job, rank by rank: :func:`plan_job`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from ..config import KFACConfigError
from ..curvature import CurvatureBlock
from ..layers import SkippedLayer
from ..optimizers import split_groups
from ..placement import RankRoles
from ..placement.gradients import layer_holders
from ..placement.plan import zero3_problem
from ..preconditioning.build import model_blocks, preconditioned_parameters
from .costs import BlockSizes, Gradients, RankCost, block_sizes, rank_cost
from .job import Job

FRACTIONS: tuple[str, ...] = ("comm-opt", "hybrid-opt", "mem-opt")
REDUCTIONS: tuple[str, ...] = ("allreduce", "reduce", "local")


@dataclass
class PlacementCost:
    """One ``grad_worker_fraction`` and ``factor_reduction``: each rank's cost, or why K-FAC refuses it."""

    fraction: Union[str, float]
    reduction: str
    workers: int
    """Gradient workers per layer (``n``); 0 where refused."""
    ranks: list[RankCost]
    refused: Optional[str] = None
    roles: list[RankRoles] = field(default_factory=list)
    """Each rank's roles (one plan shared by all)."""


@dataclass
class Plan:
    """A job's layers and every placement asked for."""

    job: Job
    blocks: list[CurvatureBlock]
    skipped: list[SkippedLayer]
    gradients: Gradients
    """Where the reduced gradients lie (under ZeRO 1/2, each layer's holders)."""
    split: list[str]
    """The layers ZeRO 1/2 split across ranks' partitions (assembled by one all-reduce per step)."""
    placements: list[PlacementCost]
    sizes: dict[str, BlockSizes]
    """Each layer's tensors' bytes (the same under every placement)."""


def plan_job(
    model: nn.Module,
    job: Job,
    fractions: Sequence[Union[str, float]] = FRACTIONS,
    reductions: Sequence[str] = REDUCTIONS,
    param_groups: Optional[Sequence[Any]] = None,
) -> Plan:
    """Each rank's K-FAC memory and traffic under each placement, without training or a process group.

    ``model`` may lie on the meta device. ``param_groups``: what the training script passes to ``initialize`` as
    ``model_parameters`` (tensors or group dicts; default: ``model.parameters()``), which decides where ZeRO 1/2's
    partitions cut the parameters."""
    blocks, skipped = model_blocks(model, job.kfac)
    if not blocks:
        raise ValueError(f"K-FAC registers no layer of this model (skipped: {[s.name for s in skipped]})")
    gradients, split = _gradients(model, blocks, job, param_groups)
    sizes = {b.name: block_sizes(b, job.kfac, job.param_dtype) for b in blocks}
    placements = []
    for fraction in fractions:
        for reduction in reductions:
            try:
                config = job.config_for(fraction, reduction)
                if job.zero_stage == 3 and zero3_problem(fraction, job.world):
                    raise KFACConfigError(zero3_problem(fraction, job.world))
                first = RankRoles(blocks, config, job.world, 0, gradients.holders)
                roles = [first] + [
                    RankRoles(blocks, config, job.world, r, gradients.holders, first.plan) for r in range(1, job.world)
                ]
            except KFACConfigError as err:
                placements.append(PlacementCost(fraction, reduction, 0, [], str(err)))
                continue
            ranks = [rank_cost(blocks, sizes, rank, gradients) for rank in roles]
            placements.append(PlacementCost(fraction, reduction, roles[0].plan.n, ranks, roles=roles))
    return Plan(job, blocks, skipped, gradients, split, placements, sizes)


def _gradients(
    model: nn.Module, blocks: list[CurvatureBlock], job: Job, param_groups: Optional[Sequence[Any]]
) -> tuple[Gradients, list[str]]:
    """Where the job's reduced gradients lie, and the layers ZeRO splits: under ZeRO 1/2, the partitions of the
    optimizer's param groups (``initialize`` splits them with ``eigenbasis_moments``) at ``job.world`` ranks."""
    if job.zero_stage == 0:
        return Gradients(job.param_dtype), []
    if job.zero_stage == 3:  # every parameter in slices over all ranks, gathered to its layer's one worker
        return Gradients(torch.float32, spread=True, raw_clipping=job.raw_clipping > 0), []
    from ..integration.layouts import zero12_param_holders  # imports DeepSpeed

    groups = list(param_groups if param_groups is not None else model.parameters())
    if job.kfac.eigenbasis_moments:
        groups = split_groups(groups, preconditioned_parameters(model, job.kfac))
    elif groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    trainable = [[p for p in g["params"] if p.requires_grad] for g in groups]
    held = zero12_param_holders(
        [[p.numel() for p in g] for g in trainable], job.world, job.param_dtype.itemsize, job.parameter_alignment
    )
    by_param = {id(p): ranks for g, rows in zip(trainable, held) for p, ranks in zip(g, rows)}
    holders, split = layer_holders(blocks, [by_param.get(id(p), ()) for b in blocks for p in b.adapter.params()])
    split_blocks = [b for b, s in zip(blocks, split) if s]
    elements = sum(p.numel() for b in split_blocks for p in b.adapter.params())
    return Gradients(job.param_dtype, holders, elements, job.raw_clipping > 0), [b.name for b in split_blocks]
