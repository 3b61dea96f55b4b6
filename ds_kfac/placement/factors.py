"""Reduce each factor-update step's statistics to the ranks that store them, and fold them in.

Per factor-update step the factors go to the ranks that store them (``allreduce``: the layer's gradient
workers; ``reduce``: the decomposing rank; ``local``: nothing moves, the owner computed them alone), in
static buckets whose reduction starts during backward (:class:`~ds_kfac.comm.OrderedBuckets`). With
``eigenvalue_correction`` the step's ``S`` travels with ``A`` and ``G`` (all-reduced, also when the factors
are reduced to one rank) to the gradient workers, who store it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from ..comm import OrderedBuckets, all_reduce_sum_, pack_symmetric, unpack_symmetric
from ..config import KFACConfig
from ..curvature import CurvatureBlock, KroneckerFactor, RunningAverage, blocks_device
from ..curvature.numerics import finite_flags
from .roles import RankRoles, Roles

Reduced = list[tuple[CurvatureBlock, str, Optional[torch.Tensor]]]
"""Per layer and statistic ("A", "G", "S"), the step's mean where this rank stores it, else ``None``."""

PRESENCE_DTYPE = torch.int32
"""The dtype of :meth:`FactorReduction.agree_present`'s per-layer counts (one all-reduce per factor-update step)."""


def symmetric_on_wire(config: KFACConfig, stat: RunningAverage) -> bool:
    """Whether ``stat`` travels as its upper triangle (``symmetric_comm``: the Kronecker factors)."""
    return config.symmetric_comm and isinstance(stat, KroneckerFactor)


def wire_numel(config: KFACConfig, stat: RunningAverage) -> int:
    """The elements of ``stat`` in the factor reduction (in ``factor_dtype``)."""
    rows = stat.shape[0]
    return rows * (rows + 1) // 2 if symmetric_on_wire(config, stat) else math.prod(stat.shape)


def wire_destinations(roles: RankRoles, block: CurvatureBlock) -> list[Optional[int]]:
    """Per statistic of ``block``, in the order they travel: the data-parallel rank it is reduced to (``reduce``: a
    side to its decomposing rank), or ``None`` where it is all-reduced (``allreduce``; ``S`` always)."""
    reduce = roles.config.factor_reduction == "reduce"
    return [
        roles.decomposer(block.name, side) if reduce and side in block.sides else None for side in block.statistics()
    ]


class FactorReduction(Roles):
    """This rank's part of the factor reduction: buckets, presence agreement, reduce and fold."""

    def __init__(self, blocks: Sequence[CurvatureBlock], *args: Any, **kwargs: Any) -> None:
        """:class:`Roles`' arguments; then the buckets of ``blocks``' factors."""
        super().__init__(blocks, *args, **kwargs)
        # Backward reaches the last layers first: buckets fill in reverse registration order.
        self._unit_blocks = list(reversed(blocks))
        self._unit = {b.name: u for u, b in enumerate(self._unit_blocks)}
        self.factor_buckets = self._make_factor_buckets(self.overlap) if self.reduces else None
        """The static buckets factors are reduced in (``None`` when nothing is reduced)."""

    def _make_factor_buckets(self, overlap: bool) -> OrderedBuckets:
        """The static buckets every rank reduces factors in: one unit (A, G[, S]) per layer. With ``reduce``,
        ``A`` and ``G`` go to their decomposing ranks and ``S`` is all-reduced (every gradient worker stores it)."""
        sizes = [[wire_numel(self.config, stat) for stat in b.statistics().values()] for b in self._unit_blocks]
        dsts = None
        if self.config.factor_reduction == "reduce":
            dsts = [
                [None if d is None else self.groups.to_global(d) for d in wire_destinations(self, b)]
                for b in self._unit_blocks
            ]
        group = self.groups.overlap if overlap else self.group
        device = blocks_device(self._unit_blocks)
        return OrderedBuckets(sizes, self.config.factor_torch_dtype, device, group, self.bucket_bytes, dsts)

    def statistics_ready(self, block: CurvatureBlock) -> None:
        """The layer's factors for this step are final (its last backward of the step ran):
        hand them to the reduction, which starts as soon as their bucket and those before it are full."""
        if self.factor_buckets is not None:
            self.factor_buckets.put(self._unit[block.name], self._step_wire(self._unit[block.name]))

    def handed_over(self, block: CurvatureBlock) -> bool:
        """Whether the layer's factors for this step have already been handed to the reduction."""
        return self.factor_buckets is not None and self.factor_buckets.is_filled(self._unit[block.name])

    def has_statistics(self, block: CurvatureBlock) -> bool:
        """Whether this rank gathered factors for the layer this step (held, or handed over)."""
        stats = block.statistics()
        return all(stats[side].pending > 0 for side in block.sides) or self.handed_over(block)

    def agree_present(self, blocks: Sequence[CurvatureBlock]) -> tuple[list[CurvatureBlock], list[str]]:
        """The blocks whose hooks fired this step on every rank that collects them (in ``local`` mode only
        their owner), agreed on in one all-reduce so that all ranks reduce the same layers, and the names of
        the others, whose step statistics are dropped. Raises when hooks fired on some ranks only."""
        present = [self.has_statistics(b) for b in blocks]
        if self.world > 1:
            counts = torch.tensor(present, dtype=PRESENCE_DTYPE, device=blocks_device(blocks))
            all_reduce_sum_([counts], self.group)
            expected = 1 if self.config.factor_reduction == "local" else self.world
            counts = counts.tolist()
            partial_names = [b.name for b, c in zip(blocks, counts) if 0 < c < expected]
            if partial_names:
                raise RuntimeError(f"K-FAC hooks fired on some data-parallel ranks but not others for {partial_names}")
            present = [c == expected for c in counts]
        for b, ok in zip(blocks, present):
            if not ok:
                for stat in b.statistics().values():
                    stat.discard_step()
        return [b for b, ok in zip(blocks, present) if ok], [b.name for b, ok in zip(blocks, present) if not ok]

    def discard_statistics(self) -> None:
        """Drop this step's factors, including any already handed to the reduction."""
        if self.factor_buckets is not None:
            self.factor_buckets.cancel()
        for block in self._blocks.values():
            for stat in block.statistics().values():
                stat.discard_step()

    def _step_wire(self, unit: int) -> list[torch.Tensor]:
        """A layer's step statistics (A, G[, S]) as they travel; zeros where it gathered none this step
        (such a layer is dropped on every rank after the presence check; an ``S`` before the layer's first
        eigenbasis is dropped by :meth:`reduce_factors`)."""
        block = self._unit_blocks[unit]
        out = []
        for stat in block.statistics().values():
            value = stat.take_step()
            if value is None:
                device = block.adapter.module.weight.device
                out.append(
                    torch.zeros(wire_numel(self.config, stat), dtype=self.config.factor_torch_dtype, device=device)
                )
            else:
                out.append(self._to_wire(value, stat))
        return out

    def reduce_factors(self, blocks: Sequence[CurvatureBlock]) -> Reduced:
        """This step's statistics of ``blocks``, averaged over ranks where they are stored: per layer and
        side ("A", "G", "S") the mean, or ``None`` where this rank does not store it. Values may be
        views into the reduction's buffers (fold them in before the next step's reduction).

        ``S`` is left out for a layer without a decomposition: no rank had an eigenbasis to project on
        (every rank that collects holds the decomposition, and none changes between the hooks and here)."""
        sides = [(b, side, stat) for b in blocks for side, stat in b.statistics().items()]
        if self.factor_buckets is None:
            reduced = [(b, side, stat.take_step()) for b, side, stat in sides]
        else:
            wire = self.factor_buckets.finish(self._step_wire)
            reduced = [
                (b, side, self._from_wire(wire[self._unit[b.name]][i], stat) if self.stores_factor(b, side) else None)
                for b in blocks
                for i, (side, stat) in enumerate(b.statistics().items())
            ]
        return [(b, side, value) for b, side, value in reduced if side != "S" or b.decomposition is not None]

    @staticmethod
    def fold_factors(reduced: Reduced, decay: float) -> list[str]:
        """Fold reduced statistics into the running averages (dropping those this rank does not store).
        A statistic whose result is not finite in its storage dtype keeps its previous value. Returns
        those statistics, as ``"layer/A"``, ``"layer/G"`` or ``"layer/S"`` (one host sync for all)."""
        blended = []
        for block, side, value in reduced:
            factor = block.statistics()[side]
            if value is None:
                factor.value = None
            else:
                blended.append((f"{block.name}/{side}", factor, factor.blend(value, decay)))
        ok = finite_flags([b for _, _, b in blended])
        for (_, factor, value), good in zip(blended, ok):
            if good:
                factor.value = value
        return [name for (name, _, _), good in zip(blended, ok) if not good]

    def _to_wire(self, value: torch.Tensor, stat: RunningAverage) -> torch.Tensor:
        """Statistics travel in ``factor_dtype``, factors as upper triangles only with ``symmetric_comm``."""
        value = value.to(self.config.factor_torch_dtype)
        return pack_symmetric(value) if symmetric_on_wire(self.config, stat) else value

    def _from_wire(self, wire: torch.Tensor, stat: RunningAverage) -> torch.Tensor:
        """The statistic's matrix of its wire form (a view when it travelled whole and in its arithmetic dtype)."""
        if symmetric_on_wire(self.config, stat):
            return unpack_symmetric(wire, stat.shape[0])
        return wire.view(stat.shape)
