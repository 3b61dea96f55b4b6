"""Carry out a placement plan: move factors, decompositions and preconditioned gradients.

The :class:`Distributor` is the only part of K-FAC that knows who does what.
Per factor-update step it reduces the factors to the ranks that keep them
(``allreduce``: the layer's gradient workers; ``reduce``: the decomposing rank;
``local``: nothing moves, the owner computed them alone). Per decomposition
step each rank decomposes the factors assigned to it and broadcasts the result
within the layer's column of gradient workers. Per step, gradient workers
precondition and, when not every rank is a gradient worker, broadcast the
result along rows to the others. Under ZeRO ownership (``mem-opt`` with
partitioned gradients) a layer's gradient workers are its partition's owners,
who write their own partitions: no preconditioned gradient moves.

With ``eigenvalue_correction`` every rank that collects factors projects its own
examples' gradients onto the layer's eigenbasis, so the decompositions go to all
of them (with fewer gradient workers than ranks: to every rank, not only the
column), and the step's ``S`` travels with ``A`` and ``G`` (all-reduced, also
when the factors are reduced to one rank) to the gradient workers, who keep it.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import (
    OrderedBuckets,
    RankGroups,
    all_reduce_sum_,
    broadcast_,
    data_parallel_world,
    pack_symmetric,
    unpack_symmetric,
)
from ..config import KFACConfig, KFACConfigError
from ..curvature import CurvatureBlock, KroneckerFactor, RunningAverage, blocks_device
from ..curvature.decomposition import State
from ..curvature.factors import finite_flags
from ..curvature.refresh import Key
from .plan import PlacementPlan

class Distributor:
    """One rank's share of the K-FAC work under a :class:`PlacementPlan`."""

    def __init__(
        self,
        blocks: Sequence[CurvatureBlock],
        config: KFACConfig,
        group: Optional[dist.ProcessGroup],
        bucket_bytes: int,
        holders: Optional[dict[str, tuple[int, ...]]] = None,
    ) -> None:
        self.config = config
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.world = data_parallel_world(group)
        # Blocks are their own placement shapes (a name and each side's cost); blocks with one side are colocated.
        colocate = config.factor_reduction == "local" or any(b.colocated for b in blocks if len(b.sides) > 1)
        self.plan = PlacementPlan(blocks, self.world, config.grad_worker_fraction, config.assignment, colocate, holders)
        reduces = self.world > 1 and config.factor_reduction != "local"
        overlap = reduces and config.overlap_factor_comm
        self.bases_everywhere = config.eigenvalue_correction and reduces and not self.plan.replicated
        """Whether every rank holds every decomposition: it projects its examples' gradients on the eigenbases."""
        self._refuse_local_correction()
        sets = self.plan.broadcast_sets() + ([tuple(range(self.world))] if self.bases_everywhere else [])
        self.groups = RankGroups(sets, group, overlap) if self.world > 1 else None
        self.rank = self.groups.rank if self.groups else 0
        self._blocks = {b.name: b for b in blocks}
        # Backward reaches the last layers first: buckets fill in reverse registration order.
        self._unit_blocks = list(reversed(blocks))
        self._unit = {b.name: u for u, b in enumerate(self._unit_blocks)}
        self.factor_buckets = self._make_factor_buckets(overlap) if reduces else None
        """The static buckets factors are reduced in (``None`` when nothing is reduced)."""

    def _refuse_local_correction(self) -> None:
        """With ``factor_reduction: "local"`` a layer's owner computes ``S`` from its own examples and sends it
        nowhere, so the layer must have no other gradient worker."""
        if not (self.config.eigenvalue_correction and self.config.factor_reduction == "local"):
            return
        shared = sorted(name for name, p in self.plan.layers.items() if len(p.grad_workers) > 1)
        if shared:
            raise KFACConfigError(
                f'kfac.eigenvalue_correction with kfac.factor_reduction="local" needs one gradient worker per layer '
                f'(grad_worker_fraction="mem-opt", no layer split between ZeRO partitions): the owner computes S '
                f"from its own examples and does not send it, yet layers {shared} have several gradient workers"
            )

    # ----------------------------------------------------------------- roles
    def collects(self, block: CurvatureBlock) -> bool:
        """Whether this rank's hooks compute the layer's factors (``local``: its owner only)."""
        return self.config.factor_reduction != "local" or self.rank == self.plan.layers[block.name].a_worker

    def is_grad_worker(self, block: CurvatureBlock) -> bool:
        return self.plan.is_grad_worker(block.name, self.rank)

    def grad_workers(self, block: CurvatureBlock) -> tuple[int, ...]:
        """The data-parallel ranks that precondition the layer."""
        return self.plan.layers[block.name].grad_workers

    def state_holders(self, block: CurvatureBlock) -> tuple[int, ...]:
        """The data-parallel ranks that hold the layer's decomposition: its gradient workers, or every rank
        (:attr:`bases_everywhere`)."""
        return tuple(range(self.world)) if self.bases_everywhere else self.grad_workers(block)

    def holds_state(self, block: CurvatureBlock) -> bool:
        return self.rank in self.state_holders(block)

    def worker(self, name: str, side: str) -> int:
        """The rank that decomposes statistic ``side`` of layer ``name``: the placement's ``a_worker`` for the
        block's first side, its ``g_worker`` for a second."""
        placement = self.plan.layers[name]
        return placement.a_worker if side == self._blocks[name].sides[0] else placement.g_worker

    def holds(self, name: str, side: str) -> bool:
        """Whether this rank decomposes factor ``side`` of layer ``name`` (and so tracks its refresh)."""
        return self.rank == self.worker(name, side)

    def keeps(self, block: CurvatureBlock, side: str) -> bool:
        """Whether this rank holds the running statistic ``side`` ("A", "G", "S") of the layer."""
        return self.rank in self._keepers(block.name, side)

    def _keepers(self, name: str, side: str) -> tuple[int, ...]:
        """The ranks holding the running statistic ``side`` of layer ``name`` (``S``: the gradient workers)."""
        if self.config.factor_reduction == "allreduce" or side not in self._blocks[name].sides:
            return self.plan.layers[name].grad_workers
        return (self.worker(name, side),)

    def counts_in_kl_sum(self, block: CurvatureBlock) -> bool:
        """Exactly one rank adds each layer to the KL-clip sum (all of them when all hold all)."""
        return self.plan.replicated or self.rank == self.plan.layers[block.name].a_worker

    # ---------------------------------------------------------------- factors
    def _make_factor_buckets(self, overlap: bool) -> OrderedBuckets:
        """The static buckets every rank reduces factors in: one unit (A, G[, S]) per layer. With ``reduce``,
        ``A`` and ``G`` go to their decomposing ranks and ``S`` is all-reduced (every gradient worker keeps it)."""
        sizes = [[self._wire_numel(stat) for stat in b.statistics().values()] for b in self._unit_blocks]
        dsts = None
        if self.config.factor_reduction == "reduce":
            dsts = [
                [self._worker_global(b, side) if side in b.sides else None for side in b.statistics()]
                for b in self._unit_blocks
            ]
        group = self.groups.overlap if overlap else self.group
        device = blocks_device(self._unit_blocks)
        return OrderedBuckets(sizes, self.config.factor_torch_dtype, device, group, self.bucket_bytes, dsts)

    def _symmetric(self, stat: RunningAverage) -> bool:
        """Whether ``stat`` travels as its upper triangle (``symmetric_comm``: the Kronecker factors)."""
        return self.config.symmetric_comm and isinstance(stat, KroneckerFactor)

    def _wire_numel(self, stat: RunningAverage) -> int:
        rows = stat.shape[0]
        return rows * (rows + 1) // 2 if self._symmetric(stat) else math.prod(stat.shape)

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
                out.append(torch.zeros(self._wire_numel(stat), dtype=self.config.factor_torch_dtype, device=device))
            else:
                out.append(self._to_wire(value, stat))
        return out

    def reduce_factors(
        self, blocks: Sequence[CurvatureBlock]
    ) -> list[tuple[CurvatureBlock, str, Optional[torch.Tensor]]]:
        """This step's statistics of ``blocks``, averaged over ranks where they are kept: per layer and
        side ("A", "G", "S") the mean, or ``None`` where this rank does not keep it. Values may be
        views into the reduction's buffers (fold them in before the next step's reduction).

        ``S`` is left out for a layer without a decomposition: no rank had an eigenbasis to project on
        (every rank that collects holds the decomposition, and none changes between the hooks and here)."""
        sides = [(b, side, stat) for b in blocks for side, stat in b.statistics().items()]
        if self.factor_buckets is None:
            reduced = [(b, side, stat.take_step()) for b, side, stat in sides]
        else:
            wire = self.factor_buckets.finish(self._step_wire)
            reduced = [
                (b, side, self._from_wire(wire[self._unit[b.name]][i], stat) if self.keeps(b, side) else None)
                for b in blocks
                for i, (side, stat) in enumerate(b.statistics().items())
            ]
        return [(b, side, value) for b, side, value in reduced if side != "S" or b.state is not None]

    @staticmethod
    def fold_factors(reduced: Sequence[tuple[CurvatureBlock, str, Optional[torch.Tensor]]], decay: float) -> list[str]:
        """Fold reduced statistics into the running averages (dropping those this rank does not keep).
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

    def _worker_global(self, block: CurvatureBlock, side: str) -> int:
        return self.groups.to_global(self.worker(block.name, side))

    def _to_wire(self, value: torch.Tensor, stat: RunningAverage) -> torch.Tensor:
        """Statistics travel in ``factor_dtype``, factors as upper triangles only with ``symmetric_comm``."""
        value = value.to(self.config.factor_torch_dtype)
        return pack_symmetric(value) if self._symmetric(stat) else value

    def _from_wire(self, wire: torch.Tensor, stat: RunningAverage) -> torch.Tensor:
        """The statistic's matrix of its wire form (a view when it travelled whole and in its arithmetic dtype)."""
        if self._symmetric(stat):
            return unpack_symmetric(wire, stat.shape[0])
        return wire.view(stat.shape)

    # --------------------------------------------------------- decompositions
    def decompose(
        self, blocks: Sequence[CurvatureBlock], damping: float, due: Optional[set[Key]] = None
    ) -> tuple[list[CurvatureBlock], list[State]]:
        """Decompose the factors assigned to this rank and share them within each layer's column:
        :meth:`compute_sides` then :meth:`share_sides`."""
        return self.share_sides(blocks, *self.compute_sides(blocks, damping, due))

    def compute_sides(
        self,
        blocks: Sequence[CurvatureBlock],
        damping: float,
        due: Optional[set[Key]] = None,
        factors: Optional[dict[str, dict[str, Optional[torch.Tensor]]]] = None,
    ) -> tuple[dict[Key, State], dict[str, set[str]]]:
        """This rank's decompositions: the sides of ``blocks`` assigned to it, and which sides each
        layer refreshes. Local work only (no communication), so it can run in the background, decomposing
        ``factors`` (per layer, each side's statistic, taken when it started; default: the running ones now).

        ``due`` limits the work to those (layer, side) pairs (adaptive refresh);
        a layer without a decomposition yet, or whose method decomposes both sides
        together, refreshes both. A side that could not be computed (no factors
        yet, LAPACK failure) is NaNs, so every gradient worker rejects the same candidates.
        """
        dtype = self.config.inv_torch_dtype
        needed = {b.name: self._sides_to_refresh(b, due) for b in blocks}
        sides: dict[Key, State] = {}
        for b in blocks:
            mine = [side for side in b.sides if side in needed[b.name] and self.rank == self.worker(b.name, side)]
            if not mine:
                continue
            held = factors[b.name] if factors is not None else {side: b.statistics()[side].value for side in b.sides}
            values = {side: held[side] for side in mine}
            computed = {} if any(v is None for v in values.values()) else b.compute_sides(values, damping, dtype)
            for side in mine:
                state = computed.get(side)
                sides[(b.name, side)] = state if state is not None else self._nan_side(b, side)
        return sides, needed

    def share_sides(
        self, blocks: Sequence[CurvatureBlock], sides: dict[Key, State], needed: dict[str, set[str]]
    ) -> tuple[list[CurvatureBlock], list[State]]:
        """Share :meth:`compute_sides`'s results with each layer's :meth:`state_holders`; return the candidate
        states of the layers this rank holds, the sides not refreshed taken from
        the current state (the caller adopts them after a finiteness check)."""
        if self.world > 1:
            self._share_decompositions(blocks, sides, needed)
        chosen, states = [], []
        for b in blocks:
            if not (needed[b.name] and self.holds_state(b)):
                continue
            old, at = {}, 0
            for side, shapes in b.side_shapes().items():
                old[side] = b.state[at : at + len(shapes)] if b.state is not None else None
                at += len(shapes)
            chosen.append(b)
            states.append(sum((sides.get((b.name, side), old[side]) for side in b.sides), ()))
        return chosen, states

    def _sides_to_refresh(self, block: CurvatureBlock, due: Optional[set[Key]]) -> set[str]:
        """Which sides of a layer to decompose now. ``block.state is None`` is the same on all
        of the layer's state holders (they adopt identical candidates), so they agree."""
        if due is None:
            return set(block.sides)
        wanted = {side for side in block.sides if (block.name, side) in due}
        if wanted and (block.colocated or (self.holds_state(block) and block.state is None)):
            return set(block.sides)
        return wanted

    def agree_intervals(self, due: Sequence[Key], decide: Callable[[Key, torch.Tensor], int]) -> list[int]:
        """Adaptive refresh: the rank holding each due factor decides its next interval; one
        all-reduce gives every rank the same decisions."""
        mine = []
        for name, side in due:
            factor = self._blocks[name].statistics()[side]
            mine.append(
                decide((name, side), factor.value) if self.holds(name, side) and factor.value is not None else 0
            )
        agreed = torch.tensor(mine, dtype=torch.int64, device=blocks_device(self._blocks.values()))
        if self.world > 1 and due:
            all_reduce_sum_([agreed], self.group, self.bucket_bytes)
        return [max(1, int(v)) for v in agreed.tolist()]

    def _nan_side(self, block: CurvatureBlock, side: str) -> State:
        device = block.adapter.module.weight.device
        dtype = self.config.inv_torch_dtype
        return tuple(torch.full(s, float("nan"), dtype=dtype, device=device) for s in block.side_shapes()[side])

    def _share_decompositions(
        self, blocks: Sequence[CurvatureBlock], sides: dict[Key, State], needed: dict[str, set[str]]
    ) -> None:
        """Broadcast each side from its decomposing rank to the layer's other state holders."""
        tensors, srcs, groups = [], [], []
        for b in blocks:
            workers = self.state_holders(b)
            if self.rank not in workers or len(workers) == 1:
                continue
            for side in b.sides:
                if side not in needed[b.name]:
                    continue
                key = (b.name, side)
                if key not in sides:
                    device = b.adapter.module.weight.device
                    sides[key] = tuple(
                        torch.empty(s, dtype=self.config.inv_torch_dtype, device=device) for s in b.side_shapes()[side]
                    )
                tensors.extend(sides[key])
                srcs.extend([self._worker_global(b, side)] * len(sides[key]))
                groups.extend([self.groups.of(workers)] * len(sides[key]))
        broadcast_(tensors, srcs, groups, self.bucket_bytes)

    # --------------------------------------------------- preconditioned grads
    def share_preconditioned(
        self, blocks: Sequence[CurvatureBlock], results: list[Optional[torch.Tensor]], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Give every rank every layer's result when every rank holds every gradient: gradient workers
        broadcast theirs along rows (in the gradient's dtype). Nothing moves when every rank is a
        gradient worker. (Under ZeRO nothing is shared: each rank writes the partition it holds.)"""
        if self.plan.replicated or self.world == 1:
            return [r.to(g.dtype) for r, g in zip(results, grads)]
        row_group = self.groups.of(tuple(self.plan.row_members(self.plan.row(self.rank))))
        tensors, srcs = [], []
        for b, r, g in zip(blocks, results, grads):
            tensors.append(r.to(g.dtype) if r is not None else torch.empty_like(g))
            srcs.append(self.groups.to_global(self.plan.sender_to(b.name, self.rank)))
        broadcast_(tensors, srcs, [row_group] * len(tensors), self.bucket_bytes)
        return tensors
