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

:class:`~.stacked.StackedStates` turns the gradient matrices of many blocks into preconditioned ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from ..layers.base import LayerAdapter
from .correction import EigenvalueCorrection
from .decomposition import Decomposition, Shape, State
from .factors import KroneckerFactor, RunningAverage
from .moments import EigenbasisMoments


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

    def side_states(self) -> dict[str, Optional[State]]:
        """The current decomposition's tensors by side, in :attr:`sides` order (``None`` before the first)."""
        out: dict[str, Optional[State]] = {}
        at = 0
        for side, shapes in self.side_shapes().items():
            out[side] = None if self.decomposition is None else self.decomposition[at : at + len(shapes)]
            at += len(shapes)
        return out

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
        held = self.side_states()
        previous = (held["A"], held["G"])
        a_side, g_side = self.method.compute(values.get("A"), values.get("G"), damping, dtype, previous)
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
