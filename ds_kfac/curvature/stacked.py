"""This rank's decompositions stacked by layer shape, and preconditioning with them (:class:`StackedStates`).

Equal-shaped layers are preconditioned by one batched matmul per product instead of several GEMMs per layer; the
blocks' states are views into the stacks (no second copy).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .block import CurvatureBlock
from .decomposition import Decomposition, State
from .moments import MomentRule, eigenbasis_directions, step_moments
from .numerics import compute_dtype


def _graft(result: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``result`` rescaled in place to the L2 norm of ``grads``, per matrix of the stacks (layer-wise grafting).

    Each norm is taken of the matrix divided by its largest magnitude, and multiplied back: a plain
    ``sqrt(sum x^2)`` underflows to 0 in float32 for entries below about 1e-23 (a layer with a tiny but non-zero
    gradient would never be updated) and overflows for entries above about 1e19."""
    dims = (-2, -1)
    tiny = torch.finfo(result.dtype).tiny
    grad_max = grads.abs().amax(dim=dims, keepdim=True)
    grad_norm = (grads / grad_max.clamp(min=tiny)).norm(dim=dims, keepdim=True) * grad_max
    result.div_(result.abs().amax(dim=dims, keepdim=True).clamp(min=tiny))  # now of largest magnitude 1 (or 0)
    return result.mul_(grad_norm / result.norm(dim=dims, keepdim=True).clamp(min=1.0))


def _scaling(blocks: Sequence[CurvatureBlock], positions: list[int]) -> Optional[torch.Tensor]:
    """The stacked eigenvalue corrections ``S`` of the blocks at ``positions``, a block without one yet (before the
    first factor-update step in an eigenbasis) taking its Kronecker eigenvalues ``v_G v_A^T``; ``None`` when no block
    has one (plain K-FAC)."""
    if not any(blocks[i].correction is not None and blocks[i].correction.value is not None for i in positions):
        return None
    dtype = blocks[positions[0]].decomposition[0].dtype
    return torch.stack(
        [
            b.method.eigenvalues(b.decomposition) if b.correction.value is None else b.correction.value.to(dtype)
            for b in (blocks[i] for i in positions)
        ]
    )


@dataclass
class _Group:
    """Blocks of one state layout: their positions in the block list, their states stacked (and which states: the
    members' positions, names and decomposition versions once stacked), which of them
    have no usable curvature (the method's :meth:`~Decomposition.uncurved`, ``None``: none can), and the
    method's precomputation for them (with the damping it was made for)."""

    positions: list[int]
    state: State
    members: tuple
    uncurved: Optional[torch.Tensor] = None
    cached: Optional[torch.Tensor] = None
    cached_for: Optional[float] = None


class StackedStates:
    """This rank's decompositions stacked by layer shape, so that preconditioning runs one batched
    matmul per product for all layers of a shape instead of several GEMMs per layer.

    The blocks' states become views into the stacks (no second copy). The stacks are rebuilt
    when the blocks asked for or any of their states change (a refresh, a restore, a load);
    a method's precomputation (``eigen-outer``'s ``D``) is kept with them until then, or
    until the damping changes."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._groups: list[_Group] = []

    def cache_bytes(self) -> int:
        """Bytes of the kept precomputations."""
        return sum(g.cached.numel() * g.cached.element_size() for g in self._groups if g.cached is not None)

    def precondition(
        self,
        blocks: Sequence[CurvatureBlock],
        grads: Sequence[torch.Tensor],
        damping: float,
        graft: bool = False,
        moments: Optional[MomentRule] = None,
    ) -> list[torch.Tensor]:
        """``P(grad)`` of each block, in its decomposition's dtype; the gradient itself before its first, and
        while its decomposition has no usable curvature (relative damping of a dead layer).

        With ``graft``, each ``P(grad)`` is rescaled to the L2 norm of its ``grad`` (layer-wise norm
        grafting): K-FAC chooses the direction, the gradient keeps its magnitude. With ``moments`` (the base
        optimizer's rule, ``eigenbasis_moments``), each block's gradient instead updates its moments in its
        eigenbasis (the identity before its first decomposition) and the result is their normalised direction
        (:mod:`.moments`)."""
        self.prepare(blocks)
        out: list[Optional[torch.Tensor]] = []
        for b, g in zip(blocks, grads):
            if b.decomposition is not None:
                out.append(None)
            elif moments is not None:
                out.append(step_moments([b.moments], g[None].to(b.inv_dtype), moments)[0])
            else:
                out.append(g.to(b.inv_dtype))
        for group in self._groups:
            positions, state, method = group.positions, group.state, blocks[group.positions[0]].method
            stacked = torch.stack([grads[i] for i in positions]).to(state[0].dtype)
            if moments is not None:
                held = [blocks[i].moments for i in positions]
                rounding = method.basis_rounding  # the "exact" mode flushes rounding in the eigenbasis
                if rounding is not None:
                    rounding = max(rounding, torch.finfo(compute_dtype(grads[positions[0]].dtype)).eps)
                result = eigenbasis_directions(
                    *method.basis(state), stacked, held, moments, rounding, method.spectra(state)
                )
            else:
                result = self._precondition_group(group, method, stacked, damping, _scaling(blocks, positions), graft)
            for j, i in enumerate(positions):
                out[i] = result[j]
        return out

    @staticmethod
    def _precondition_group(
        group: _Group,
        method: Decomposition,
        stacked: torch.Tensor,
        damping: float,
        scaling: Optional[torch.Tensor],
        graft: bool,
    ) -> torch.Tensor:
        """``P`` of one group's stacked gradients by its method (grafted, the uncurved blocks passed through)."""
        if group.cached_for != damping:
            group.cached, group.cached_for = method.precompute(group.state, damping), damping
        result = method.precondition(group.state, stacked, damping, group.cached, scaling)
        if graft:
            result = _graft(result, stacked)
        if group.uncurved is not None:
            result = torch.where(group.uncurved[:, None, None], stacked, result)
        return result

    def stale(self, blocks: Sequence[CurvatureBlock]) -> bool:
        """Whether the stacks are not those of ``blocks`` and their current states."""
        return self._key != self._versions(blocks)

    def prepare(self, blocks: Sequence[CurvatureBlock]) -> None:
        """Stack the states of ``blocks`` unless that is already done: only the groups with a changed member
        are copied (one copy of a group per refresh of any of its layers; with ``refresh_spread`` a step
        refreshes a few layers, not all)."""
        if self.stale(blocks):
            self._groups = self._stack(blocks, {g.members: g for g in self._groups})
            self._key = self._versions(blocks)

    @staticmethod
    def _versions(blocks: Sequence[CurvatureBlock]) -> tuple:
        return tuple((b.name, b.decomposition_version) for b in blocks)

    @staticmethod
    def _stack(blocks: Sequence[CurvatureBlock], kept: dict[tuple, _Group]) -> list[_Group]:
        """The groups of ``blocks``' states, those in ``kept`` (by :attr:`_Group.members`) reused as they are."""
        # The gradient's shape is part of the key: one-sided blocks of equal kept sides hold equal states for
        # gradients of different shapes (BERT's 2048 x 513 intermediate and 8192 x 513 decoder, both A-only).
        by_shapes: dict[tuple, list[int]] = defaultdict(list)
        for i, b in enumerate(blocks):
            if b.decomposition is not None:
                shape = (b.adapter.g_dim, b.adapter.a_dim)
                by_shapes[(b.method.name, shape, *((t.shape, t.dtype) for t in b.decomposition))].append(i)
        groups = []
        for positions in by_shapes.values():
            members = _members(blocks, positions)
            if members in kept:
                groups.append(kept[members])
                continue
            state = tuple(torch.stack(parts) for parts in zip(*(blocks[i].decomposition for i in positions)))
            for j, i in enumerate(positions):
                blocks[i].decomposition = tuple(t[j] for t in state)
            uncurved = blocks[positions[0]].method.uncurved(state)
            groups.append(_Group(positions, state, _members(blocks, positions), uncurved))
        return groups


def _members(blocks: Sequence[CurvatureBlock], positions: list[int]) -> tuple:
    """Which states a group stacks: each member's position, name and decomposition version."""
    return tuple((i, blocks[i].name, blocks[i].decomposition_version) for i in positions)
