"""A curvature block: the Kronecker-factored curvature of one layer.

The block owns the layer's two factors, its current decomposition and, with
``eigenvalue_correction``, the second moment ``S`` of its per-example gradients
in the decomposition's eigenbasis. It knows nothing about hooks, ranks or
optimizers: the preconditioner feeds it rows and the communication layer moves
its tensors. :class:`StackedStates` turns the gradient matrices of many blocks
into preconditioned ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from ..layers.base import LayerAdapter
from .correction import EigenvalueCorrection
from .decomposition import Decomposition, State
from .factors import KroneckerFactor, RunningAverage


class KFACBlock:
    """Factors ``A`` (``a_dim``) and ``G`` (``g_dim``) of one layer, their decomposition and, with
    ``eigenvalue_correction``, the correction ``S`` (``g_dim x a_dim``)."""

    def __init__(
        self,
        name: str,
        adapter: LayerAdapter,
        method: Decomposition,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        eigenvalue_correction: bool = False,
    ) -> None:
        self.name = name
        self.adapter = adapter
        self.method = method
        self.inv_dtype = inv_dtype
        self.a = KroneckerFactor(adapter.a_dim, factor_dtype)
        self.g = KroneckerFactor(adapter.g_dim, factor_dtype)
        self.correction = (
            EigenvalueCorrection(adapter.a_dim, adapter.g_dim, factor_dtype) if eigenvalue_correction else None
        )
        self._state: Optional[State] = None
        self.state_version = 0
        """Bumped whenever :attr:`state` is assigned, so caches built from it know when to rebuild."""

    def statistics(self) -> dict[str, RunningAverage]:
        """The running statistics by name, in the order they travel: ``A``, ``G`` and, with the correction, ``S``."""
        stats: dict[str, RunningAverage] = {"A": self.a, "G": self.g}
        if self.correction is not None:
            stats["S"] = self.correction
        return stats

    def install(self, state: State) -> None:
        """Adopt a new decomposition. The correction follows a new eigenbasis: ``S`` is re-projected onto it."""
        if self.correction is not None and self._state is not None:
            self.correction.rebase(self.method.basis(self._state), self.method.basis(state))
        self.state = state

    @property
    def state(self) -> Optional[State]:
        """The current decomposition (``None`` before the first); replaced, never modified in place."""
        return self._state

    @state.setter
    def state(self, value: Optional[State]) -> None:
        self._state = value
        self.state_version += 1


def blocks_device(blocks: Iterable[KFACBlock]) -> torch.device:
    """The device of the first block's layer (CPU with no blocks): where per-layer flags live."""
    first = next(iter(blocks), None)
    return first.adapter.module.weight.device if first is not None else torch.device("cpu")


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


def _scaling(blocks: Sequence[KFACBlock], positions: list[int]) -> Optional[torch.Tensor]:
    """The stacked eigenvalue corrections ``S`` of the blocks at ``positions``, a block without one yet (before the
    first factor-update step in an eigenbasis) taking its Kronecker eigenvalues ``v_G v_A^T``; ``None`` when no block
    has one (plain K-FAC)."""
    if not any(blocks[i].correction is not None and blocks[i].correction.value is not None for i in positions):
        return None
    dtype = blocks[positions[0]].state[0].dtype
    return torch.stack(
        [
            b.method.eigenvalues(b.state) if b.correction.value is None else b.correction.value.to(dtype)
            for b in (blocks[i] for i in positions)
        ]
    )


@dataclass
class _Group:
    """Blocks of one state layout: their positions in the block list, their states stacked, which of them
    have no usable curvature (the method's :meth:`~Decomposition.uncurved`, ``None``: none can), and the
    method's precomputation for them (with the damping it was made for)."""

    positions: list[int]
    state: State
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
        self, blocks: Sequence[KFACBlock], grads: Sequence[torch.Tensor], damping: float, graft: bool = False
    ) -> list[torch.Tensor]:
        """``P(grad)`` of each block, in its decomposition's dtype; the gradient itself before its first, and
        while its decomposition has no usable curvature (relative damping of a dead layer).

        With ``graft``, each ``P(grad)`` is rescaled to the L2 norm of its ``grad`` (layer-wise norm
        grafting): K-FAC chooses the direction, the gradient keeps its magnitude."""
        self.prepare(blocks)
        out = [g.to(b.inv_dtype) if b.state is None else None for b, g in zip(blocks, grads)]
        for group in self._groups:
            positions, state, method = group.positions, group.state, blocks[group.positions[0]].method
            if group.cached_for != damping:
                group.cached, group.cached_for = method.precompute(state, damping), damping
            stacked = torch.stack([grads[i] for i in positions]).to(state[0].dtype)
            result = method.precondition(state, stacked, damping, group.cached, _scaling(blocks, positions))
            if graft:
                result = _graft(result, stacked)
            if group.uncurved is not None:
                result = torch.where(group.uncurved[:, None, None], stacked, result)
            for j, i in enumerate(positions):
                out[i] = result[j]
        return out

    def stale(self, blocks: Sequence[KFACBlock]) -> bool:
        """Whether the stacks are not those of ``blocks`` and their current states."""
        return self._key != self._versions(blocks)

    def prepare(self, blocks: Sequence[KFACBlock]) -> None:
        """Stack the states of ``blocks`` unless that is already done (one copy of them per refresh)."""
        if self.stale(blocks):
            self._groups = self._stack(blocks)
            self._key = self._versions(blocks)

    @staticmethod
    def _versions(blocks: Sequence[KFACBlock]) -> tuple:
        return tuple((b.name, b.state_version) for b in blocks)

    @staticmethod
    def _stack(blocks: Sequence[KFACBlock]) -> list[_Group]:
        by_layout: dict[tuple, list[int]] = defaultdict(list)
        for i, b in enumerate(blocks):
            if b.state is not None:
                by_layout[tuple((t.shape, t.dtype) for t in b.state)].append(i)
        groups = []
        for positions in by_layout.values():
            state = tuple(torch.stack(parts) for parts in zip(*(blocks[i].state for i in positions)))
            for j, i in enumerate(positions):
                blocks[i].state = tuple(t[j] for t in state)
            groups.append(_Group(positions, state, blocks[positions[0]].method.uncurved(state)))
        return groups
