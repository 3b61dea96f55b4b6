"""Decompose the factors assigned to this rank and share them with the ranks that hold the decomposition.

Per decomposition step each rank decomposes the sides assigned to it (:meth:`~DecompositionSharing.compute_sides`,
local work that can run in the background) and broadcasts them within the layer's column of gradient
workers (:meth:`~DecompositionSharing.share_sides`). With ``eigenvalue_correction`` every rank that collects
factors projects its own examples' gradients onto the layer's eigenbasis, so the decompositions go to all of
them (with fewer gradient workers than ranks: to every rank, not only the column). Adaptive refresh's
intervals are decided where each factor is decomposed and agreed on in one all-reduce.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..comm import all_reduce_sum_, broadcast_
from ..curvature import CurvatureBlock, blocks_device
from ..curvature.decomposition import State
from ..curvature.refresh import Key
from .roles import RankRoles, Roles

Sides = dict[Key, State]
"""Decomposed sides by (layer, side)."""

INTERVAL_DTYPE = torch.int64
"""The dtype of adaptive refresh's intervals, agreed on in one all-reduce per refresh
(:meth:`~DecompositionSharing.agree_intervals`)."""


def shared_sides(
    roles: RankRoles, blocks: Sequence[CurvatureBlock], needed: dict[str, set[str]]
) -> list[tuple[CurvatureBlock, str, tuple[int, ...]]]:
    """The sides a decomposition step broadcasts that ``roles``' rank takes part in: each side in ``needed`` of a
    layer that it and other ranks hold the decomposition of, with those holders; the side's decomposer sends it."""
    out = []
    for b in blocks:
        holders = roles.decomposition_holders(b)
        if roles.rank in holders and len(holders) > 1:
            out += [(b, side, holders) for side in b.sides if side in needed[b.name]]
    return out


class DecompositionSharing(Roles):
    """This rank's part of computing and sharing decompositions."""

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
    ) -> tuple[Sides, dict[str, set[str]]]:
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
        sides: Sides = {}
        for b in blocks:
            mine = [side for side in b.sides if side in needed[b.name] and self.decomposes(b.name, side)]
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
        self, blocks: Sequence[CurvatureBlock], sides: Sides, needed: dict[str, set[str]]
    ) -> tuple[list[CurvatureBlock], list[State]]:
        """Share :meth:`compute_sides`'s results with each layer's :meth:`decomposition_holders`; return the
        candidate states of the layers this rank holds, the sides not refreshed taken from
        the current state (the caller adopts them after a finiteness check)."""
        if self.world > 1:
            self._share_decompositions(blocks, sides, needed)
        chosen, states = [], []
        for b in blocks:
            if not (needed[b.name] and self.holds_decomposition(b)):
                continue
            old = b.side_states()
            chosen.append(b)
            states.append(sum((sides.get((b.name, side), old[side]) for side in b.sides), ()))
        return chosen, states

    def _sides_to_refresh(self, block: CurvatureBlock, due: Optional[set[Key]]) -> set[str]:
        """Which sides of a layer to decompose now. ``block.decomposition is None`` is the same on all
        of the layer's decomposition holders (they adopt identical candidates), so they agree."""
        if due is None:
            return set(block.sides)
        wanted = {side for side in block.sides if (block.name, side) in due}
        if wanted and (block.colocated or (self.holds_decomposition(block) and block.decomposition is None)):
            return set(block.sides)
        return wanted

    def agree_intervals(self, due: Sequence[Key], decide: Callable[[Key, torch.Tensor], int]) -> list[int]:
        """Adaptive refresh: the rank decomposing each due factor decides its next interval; one
        all-reduce gives every rank the same decisions."""
        mine = []
        for name, side in due:
            factor = self._blocks[name].statistics()[side]
            mine.append(
                decide((name, side), factor.value) if self.decomposes(name, side) and factor.value is not None else 0
            )
        agreed = torch.tensor(mine, dtype=INTERVAL_DTYPE, device=blocks_device(self._blocks.values()))
        if self.world > 1 and due:
            all_reduce_sum_([agreed], self.group, self.bucket_bytes)
        return [max(1, int(v)) for v in agreed.tolist()]

    def _nan_side(self, block: CurvatureBlock, side: str) -> State:
        device = block.adapter.module.weight.device
        dtype = self.config.inv_torch_dtype
        return tuple(torch.full(s, float("nan"), dtype=dtype, device=device) for s in block.side_shapes()[side])

    def _share_decompositions(
        self, blocks: Sequence[CurvatureBlock], sides: Sides, needed: dict[str, set[str]]
    ) -> None:
        """Broadcast each side from its decomposing rank to the layer's other decomposition holders."""
        tensors, srcs, groups = [], [], []
        for b, side, holders in shared_sides(self, blocks, needed):
            key = (b.name, side)
            if key not in sides:
                device = b.adapter.module.weight.device
                sides[key] = tuple(
                    torch.empty(s, dtype=self.config.inv_torch_dtype, device=device) for s in b.side_shapes()[side]
                )
            tensors.extend(sides[key])
            srcs.extend([self._decomposer_global(b, side)] * len(sides[key]))
            groups.extend([self.groups.of(holders)] * len(sides[key]))
        broadcast_(tensors, srcs, groups, self.bucket_bytes)
