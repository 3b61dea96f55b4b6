"""What one rank holds and sends under one placement, from the real blocks and the real plan.

Every "who" comes from :class:`~ds_kfac.placement.RankRoles` (the plan, for any rank and world size, with no process
group) and from the selections the collectives themselves make (``wire_destinations`` and ``shared_sides`` in
:mod:`ds_kfac.placement`, ``sums_over_data_parallel`` of the KL clip); every "how big" from the blocks (their
statistics' shapes and dtypes, their decompositions' shapes, their method's precomputation made on meta tensors).
Byte counts are those :data:`ds_kfac.comm.STATS` keeps (the payload a rank puts into each kind of collective), memory
that of :meth:`ds_kfac.KFACPreconditioner.memory_usage`; ``tests/test_plan.py`` checks both against real runs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..config import KFACConfig
from ..curvature import CurvatureBlock
from ..curvature.numerics import compute_dtype
from ..placement import RankRoles
from ..placement.decompositions import INTERVAL_DTYPE, shared_sides
from ..placement.factors import PRESENCE_DTYPE, wire_destinations, wire_numel
from ..placement.kl_clip import sums_over_data_parallel

FLOAT32 = torch.float32.itemsize
"""Bytes of the float32 scalars and buffers some collectives carry: the KL clip's and the gradient norm's sums, ZeRO
1/2's split layers assembled (:meth:`~ds_kfac.placement.gradients.PartitionedGradients._assemble`)."""
FLAG = torch.int32.itemsize
"""Bytes of one int32 flag: the engine's check that preconditioning reached the gradients (``_verify_preconditioning``
of :class:`~ds_kfac.integration.engine.KFACEngineMixin`, two per layer, until a first decomposition is installed)
and ZeRO 1/2's table of which rank holds which parameter (in ``initialize``)."""


@dataclass(frozen=True)
class Gradients:
    """Where the reduced gradients lie, as the planner needs it: whole on every rank (``holders`` ``None``: ZeRO 0),
    or ZeRO 1/2's partitions, with each layer's holders, which layers ZeRO split and their parameters' elements."""

    dtype: torch.dtype
    """The gradients' dtype (the model's: the dtype ``P(g)`` travels in along rows)."""
    holders: Optional[dict[str, tuple[int, ...]]] = None
    split_elements: int = 0
    """Elements of the parameters of the layers ZeRO split across ranks (assembled by one all-reduce per step)."""
    raw_clipping: bool = False
    """Whether the engine clips the raw gradients before K-FAC (``eigenbasis_moments`` with ``gradient_clipping``)."""
    spread: bool = False
    """ZeRO 3: every parameter's gradient in contiguous slices over all ranks, each layer's gathered to its one
    gradient worker and ``P(g)`` sent back (two all-to-alls a step, in float32)."""

    @property
    def sharded(self) -> bool:
        return self.holders is not None or self.spread


@dataclass
class RankCost:
    """One rank's K-FAC memory and traffic under one placement.

    ``memory``: bytes held between steps, by :meth:`~ds_kfac.KFACPreconditioner.memory_usage`'s categories (its
    ``accumulators`` are the step's and are in ``buffers``). ``buffers``: bytes held during a step only (the
    accumulators, from the first micro-batch to the hand-over of the factors; the factor reduction's flat buckets).
    Traffic, by :data:`~ds_kfac.comm.STATS` kind (``all_reduce``, ``reduce``, ``broadcast``): ``every_step``; what a
    factor-update step adds (``factor_step``) and a decomposition step (``refresh``); ``first_step``, once (the
    engine's check that preconditioning reached the gradients); ``start``, once, in ``initialize``."""

    rank: int
    memory: Counter[str] = field(default_factory=Counter)
    buffers: Counter[str] = field(default_factory=Counter)
    every_step: Counter[str] = field(default_factory=Counter)
    factor_step: Counter[str] = field(default_factory=Counter)
    refresh: Counter[str] = field(default_factory=Counter)
    first_step: Counter[str] = field(default_factory=Counter)
    start: Counter[str] = field(default_factory=Counter)

    def step_bytes(self, step: int, factor_every: int, refresh_every: int) -> Counter[str]:
        """The bytes by kind this rank sends at ``step`` (0-based) with a fixed cadence."""
        total = Counter(self.every_step)
        if step % factor_every == 0:
            total.update(self.factor_step)
        if step % refresh_every == 0:
            total.update(self.refresh)
        if step == 0:
            total.update(self.first_step)
        return total


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class BlockSizes:
    """The bytes of one block's tensors (the same under every placement), by statistic or side."""

    statistics: dict[str, int]
    """Each running statistic ("A", "G", "S", ...) in its storage dtype."""
    accumulators: dict[str, int]
    """Each statistic's accumulator (the step's sum, in float32 or better)."""
    wire: dict[str, int]
    """What each statistic puts into the factor reduction (``factor_dtype``, upper triangles with
    ``symmetric_comm``)."""
    sides: dict[str, int]
    """Each side's decomposition (``inv_dtype``)."""
    cache: int
    """What the method keeps for preconditioning between steps (``eigen-outer``'s ``D``), without moments."""
    moments: int
    """``m`` and ``v`` of ``eigenbasis_moments`` (0 without)."""
    matrix: int
    """The gradient matrix, in the gradients' dtype."""


def block_sizes(block: CurvatureBlock, config: KFACConfig, grad_dtype: torch.dtype) -> BlockSizes:
    """The sizes of ``block``'s tensors under ``config``, gradients of ``grad_dtype``."""
    inv = config.inv_torch_dtype
    stats = block.statistics()
    matrix = (block.adapter.g_dim, block.adapter.a_dim)
    moments_dtype = torch.promote_types(inv, torch.float32)  # step_moments: the rotated gradient, float32 or better
    state = tuple(  # the decomposition on the meta device, stacked as preconditioning stacks it
        torch.empty((1, *s), dtype=inv, device="meta") for shapes in block.side_shapes().values() for s in shapes
    )
    cached = block.method.precompute(state, config.at("damping", 0)) if block.moments is None else None
    return BlockSizes(
        statistics={side: _nbytes(stat.shape, stat.dtype) for side, stat in stats.items()},
        accumulators={  # S is accumulated in the eigenbasis's dtype too
            side: _nbytes(
                stat.shape, torch.promote_types(compute_dtype(stat.dtype), inv if side == "S" else stat.dtype)
            )
            for side, stat in stats.items()
        },
        wire={side: wire_numel(config, stat) * config.factor_torch_dtype.itemsize for side, stat in stats.items()},
        sides={side: sum(_nbytes(s, inv) for s in shapes) for side, shapes in block.side_shapes().items()},
        cache=0 if cached is None else cached.numel() * cached.element_size(),
        moments=0 if block.moments is None else 2 * _nbytes(matrix, moments_dtype),
        matrix=_nbytes(matrix, grad_dtype),
    )


def rank_cost(
    blocks: Sequence[CurvatureBlock], sizes: dict[str, BlockSizes], roles: RankRoles, gradients: Gradients
) -> RankCost:
    """What ``roles``' rank holds and sends (see :class:`RankCost`); ``sizes``: :func:`block_sizes` by layer."""
    r, world, config = roles.rank, roles.world, roles.config
    cost = RankCost(r)
    adaptive = config.inv_update_steps == "adaptive"
    for b in blocks:
        size = sizes[b.name]
        holds = roles.holds_decomposition(b)
        for side in b.statistics():
            if roles.stores_factor(b, side):
                cost.memory["eigenvalue_corrections" if side == "S" else "factors"] += size.statistics[side]
            if roles.collects(b) and (side != "S" or holds):  # S is projected on the eigenbasis a rank holds
                cost.buffers["accumulators"] += size.accumulators[side]
        if holds:
            cost.memory["decompositions"] += sum(size.sides.values())
        if r in roles.preconditioners(b):
            cost.memory["eigenbasis_moments" if size.moments else "preconditioning_cache"] += size.moments or size.cache
        for side in b.sides:
            if adaptive and roles.decomposes(b.name, side):  # the factor at its last two refreshes
                cost.memory["refresh_references"] += 2 * size.statistics[side]
        if roles.reduces:
            for side, dst in zip(b.statistics(), wire_destinations(roles, b)):
                cost.factor_step["all_reduce" if dst is None else "reduce"] += size.wire[side]
                cost.buffers["factor_buckets"] += size.wire[side]
        if not gradients.sharded and roles.shares_along_rows and roles.plan.sender_to(b.name, r) == r:
            cost.every_step["broadcast"] += size.matrix
    for b, side, _ in shared_sides(roles, blocks, {b.name: set(b.sides) for b in blocks}):
        if roles.decomposes(b.name, side):
            cost.refresh["broadcast"] += sizes[b.name].sides[side]
    if world > 1:
        cost.factor_step["all_reduce"] += len(blocks) * PRESENCE_DTYPE.itemsize
        cost.first_step["all_reduce"] += 2 * len(blocks) * FLAG
        if adaptive:  # the intervals of the factors due, all of them at most
            cost.refresh["all_reduce"] += sum(len(b.sides) for b in blocks) * INTERVAL_DTYPE.itemsize
        if config.kl_clip is not None and sums_over_data_parallel(gradients.sharded, roles):
            cost.every_step["all_reduce"] += FLOAT32
        if gradients.sharded:
            cost.every_step["all_reduce"] += gradients.split_elements * FLOAT32 + FLOAT32 * gradients.raw_clipping
        if gradients.holders is not None:
            cost.start["all_reduce"] += world * sum(len(b.adapter.params()) for b in blocks) * FLAG
        if gradients.spread:
            cost.every_step["all_to_all"] += FLOAT32 * sum(_spread_sent(b, roles) for b in blocks)
    return cost


def _spread_sent(block: CurvatureBlock, roles: RankRoles) -> int:
    """Elements of ``block``'s gradient ``roles``' rank sends at ZeRO 3 (``integration.layouts.Zero3Gradients``):
    its slices to the layer's gradient worker, or as the worker every other rank's slices of ``P(g)``."""
    r, world = roles.rank, roles.world
    (worker,) = roles.preconditioners(block)
    sent = 0
    for p in block.adapter.params():
        n = p.numel()
        c = -(-n // world)
        mine = max(0, min((r + 1) * c, n) - min(r * c, n))
        sent += mine if worker != r else n - mine
    return sent
