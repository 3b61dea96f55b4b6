"""Curvature blocks: one layer's curvature each, behind one interface.

A block owns its layer's running statistics (gathered by the hooks through
:meth:`CurvatureBlock.forward_statistic` and :meth:`CurvatureBlock.backward_statistic`),
their decomposition (its *sides*, each decomposed on one rank) and the method
that preconditions with it. It knows nothing about hooks, ranks or optimizers:
the collector feeds it inputs and output gradients, and the placement,
communication and checkpoint code move its tensors by name and shape only.

* :class:`KFACBlock`: the Kronecker factors ``A`` and ``G`` of a Linear or
  Conv2d layer (sides ``A`` and ``G``) and, with ``eigenvalue_correction``, the
  second moment ``S`` of its per-example gradients in the eigenbasis;
* :class:`~ds_kfac.curvature.unitwise.UnitWiseBlock`: a BatchNorm layer's
  per-channel Fisher over ``(gamma, beta)`` (one side, ``F``).

:class:`StackedStates` turns the gradient matrices of many blocks into preconditioned ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ..layers.base import LayerAdapter
from .correction import EigenvalueCorrection
from .decomposition import Decomposition, Shape, State
from .factors import KroneckerFactor, RunningAverage
from .moments import EigenbasisMoments, MomentRule, eigenbasis_directions, step_moments
from .numerics import compute_dtype


class CurvatureBlock(ABC):
    """One layer's curvature: running statistics, their decomposition (:attr:`decomposition`), and its method.

    Args:
        name: the layer's name in the model.
        adapter: the layer's view of its module (parameters, gradient matrix ``g_dim x a_dim``).
        method: how the decomposition preconditions (:class:`~ds_kfac.curvature.decomposition.Decomposition`).
        inv_dtype: dtype of the decomposition and of preconditioning.
    """

    sides: tuple[str, ...]
    """The statistics decomposed on their own rank, in the order their tensors make up :attr:`decomposition` (a block
    with one side has it decomposed on one rank)."""

    def __init__(self, name: str, adapter: LayerAdapter, method: Decomposition, inv_dtype: torch.dtype) -> None:
        self.name = name
        self.adapter = adapter
        self.method = method
        self.inv_dtype = inv_dtype
        self.correction: Optional[EigenvalueCorrection] = None
        """The eigenvalue correction ``S`` (Kronecker blocks with ``eigenvalue_correction`` only)."""
        self.moments: Optional[EigenbasisMoments] = None
        """The base optimizer's moments in the eigenbasis (Kronecker blocks with ``eigenbasis_moments``; held by the
        ranks that precondition the layer)."""
        self._decomposition: Optional[State] = None
        self.decomposition_version = 0
        """Bumped whenever :attr:`decomposition` is assigned, so caches built from it know when to rebuild."""

    @abstractmethod
    def statistics(self) -> dict[str, RunningAverage]:
        """The running statistics by name, in the order they travel (the :attr:`sides`, then any others)."""

    @abstractmethod
    def forward_statistic(self, x: torch.Tensor) -> Any:
        """What a forward call with input ``x`` keeps until its output's gradient arrives."""

    @abstractmethod
    def backward_statistic(self, pending: Any, grad: torch.Tensor, examples: int, scale: Any) -> None:
        """Add one call's statistics: ``pending`` from :meth:`forward_statistic`, ``grad`` the gradient of its
        output, ``examples`` its batch size and ``scale`` the factor ``c`` that makes the output gradients
        per-example gradients of the unscaled loss."""

    @abstractmethod
    def side_shapes(self) -> dict[str, list[Shape]]:
        """The shapes of the tensors of each side's decomposition."""

    @abstractmethod
    def compute_sides(
        self, values: dict[str, Optional[torch.Tensor]], damping: float, dtype: torch.dtype
    ) -> dict[str, Optional[State]]:
        """The decomposition of each side in ``values`` (its statistic; ``None`` where LAPACK failed)."""

    @abstractmethod
    def costs(self, power: int) -> tuple[float, ...]:
        """The decomposition cost of each side (``power`` 3: compute, 2: memory), for the placement."""

    @property
    def colocated(self) -> bool:
        """Whether all sides must be decomposed together, on one rank."""
        return self.method.colocated or len(self.sides) == 1

    def install(self, state: State) -> None:
        """Adopt a new decomposition."""
        self.decomposition = state

    @property
    def decomposition(self) -> Optional[State]:
        """The current decomposition (``None`` before the first); replaced, never modified in place."""
        return self._decomposition

    @decomposition.setter
    def decomposition(self, value: Optional[State]) -> None:
        self._decomposition = value
        self.decomposition_version += 1


@dataclass(frozen=True)
class _Input:
    """A layer call's input, kept from the forward to the backward hook (eigenvalue correction)."""

    x: torch.Tensor


class KFACBlock(CurvatureBlock):
    """Factors ``A`` (``a_dim``) and ``G`` (``g_dim``) of one layer, their decomposition and, with
    ``eigenvalue_correction``, the correction ``S`` (``g_dim x a_dim``)."""

    sides = ("A", "G")

    def __init__(
        self,
        name: str,
        adapter: LayerAdapter,
        method: Decomposition,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        eigenvalue_correction: bool = False,
        eigenbasis_moments: bool = False,
    ) -> None:
        super().__init__(name, adapter, method, inv_dtype)
        self.a = KroneckerFactor(adapter.a_dim, factor_dtype, bias_column=adapter.has_bias)
        self.g = KroneckerFactor(adapter.g_dim, factor_dtype)
        if eigenvalue_correction:
            self.correction = EigenvalueCorrection(adapter.a_dim, adapter.g_dim, factor_dtype)
        if eigenbasis_moments:
            self.moments = EigenbasisMoments()

    def statistics(self) -> dict[str, RunningAverage]:
        """``A``, ``G`` and, with the correction, ``S``."""
        stats: dict[str, RunningAverage] = {"A": self.a, "G": self.g}
        if self.correction is not None:
            stats["S"] = self.correction
        return stats

    def forward_statistic(self, x: torch.Tensor) -> Union[torch.Tensor, _Input]:
        """The call's ``A`` statistic; with the correction and an eigenbasis, the input itself (which autograd
        keeps anyway for the weight gradient): the backward computes its rows once for ``A`` and for ``S``, whose
        per-example gradients need each example's input and output-gradient rows together."""
        if self.correction is not None and self.decomposition is not None:
            return _Input(x.detach())
        return self.a.statistic(self.adapter.input_rows(x), bias_column=self.adapter.has_bias)

    def backward_statistic(
        self, pending: Union[torch.Tensor, _Input], grad: torch.Tensor, examples: int, scale: Any
    ) -> None:
        g_rows = self.adapter.output_grad_rows(grad)
        if isinstance(pending, _Input):
            a_rows = self.adapter.input_rows(pending.x)
            self.a.add(self.a.statistic(a_rows, bias_column=self.adapter.has_bias))
            basis = self.method.basis(self.decomposition)
            self.correction.accumulate(a_rows, g_rows, examples, scale, basis, self.adapter.has_bias)
        else:
            self.a.add(pending)
        self.g.accumulate(g_rows, scale)

    def side_shapes(self) -> dict[str, list[Shape]]:
        return dict(zip(self.sides, self.method.side_shapes(self.adapter.a_dim, self.adapter.g_dim)))

    def compute_sides(
        self, values: dict[str, Optional[torch.Tensor]], damping: float, dtype: torch.dtype
    ) -> dict[str, Optional[State]]:
        if self.method.relative_damping:  # a side without curvature of its own is decomposed as zero
            factors = {"A": self.a, "G": self.g}
            values = {s: None if v is None else factors[s].decomposed(v, dtype) for s, v in values.items()}
        a_side, g_side = self.method.compute(values.get("A"), values.get("G"), damping, dtype)
        return {side: state for side, state in (("A", a_side), ("G", g_side)) if side in values}

    def costs(self, power: int) -> tuple[float, ...]:
        return float(self.adapter.a_dim) ** power, float(self.adapter.g_dim) ** power

    def install(self, state: State) -> None:
        """Adopt a new decomposition. The correction and the moments follow a new eigenbasis: ``S`` is
        re-projected onto it, the moments moved (from the identity before the first decomposition)."""
        if self.correction is not None or self.moments is not None:  # only the eigen methods have either
            old = None if self.decomposition is None else self.method.basis(self.decomposition)
            if self.correction is not None and old is not None:
                self.correction.rebase(old, self.method.basis(state))
            if self.moments is not None:
                self.moments.rebase(old, self.method.basis(state))
        self.decomposition = state


def blocks_device(blocks: Iterable[CurvatureBlock]) -> torch.device:
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
                rounding = max(method.basis_rounding, torch.finfo(compute_dtype(grads[positions[0]].dtype)).eps)
                result = eigenbasis_directions(*method.basis(state), stacked, held, moments, rounding)
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
        """Stack the states of ``blocks`` unless that is already done (one copy of them per refresh)."""
        if self.stale(blocks):
            self._groups = self._stack(blocks)
            self._key = self._versions(blocks)

    @staticmethod
    def _versions(blocks: Sequence[CurvatureBlock]) -> tuple:
        return tuple((b.name, b.decomposition_version) for b in blocks)

    @staticmethod
    def _stack(blocks: Sequence[CurvatureBlock]) -> list[_Group]:
        # The gradient's shape is part of the key: one-sided blocks of equal kept sides hold equal states for
        # gradients of different shapes (BERT's 2048 x 513 intermediate and 8192 x 513 decoder, both A-only).
        by_shapes: dict[tuple, list[int]] = defaultdict(list)
        for i, b in enumerate(blocks):
            if b.decomposition is not None:
                shape = (b.adapter.g_dim, b.adapter.a_dim)
                by_shapes[(b.method.name, shape, *((t.shape, t.dtype) for t in b.decomposition))].append(i)
        groups = []
        for positions in by_shapes.values():
            state = tuple(torch.stack(parts) for parts in zip(*(blocks[i].decomposition for i in positions)))
            for j, i in enumerate(positions):
                blocks[i].decomposition = tuple(t[j] for t in state)
            groups.append(_Group(positions, state, blocks[positions[0]].method.uncurved(state)))
        return groups
