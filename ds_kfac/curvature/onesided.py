"""One-sided Kronecker blocks for ``eigenbasis_moments``: one side in its factor's eigenbasis, the other left in the
parameter basis (SOAP's treatment of a dimension above its ``max_precond_dim``).

With ``eigenbasis_max_dim``, a layer side larger than it (a vocabulary-sized output, above all) is neither
collected nor decomposed: its basis is the identity, so the base optimizer's moments are kept in
``r = g Q_A`` (``G`` side left) or ``r = Q_G^T g`` (``A`` side left). That costs one ``d x d`` factor and one
decomposition of the small side only, where a two-sided block would collect, reduce and decompose a
``vocab x vocab`` factor every refresh.

Any orthogonal basis gives Adam a valid update, whatever produced the gradient: so a one-sided (or two-sided)
block under ``eigenbasis_moments`` may also precondition a weight tied to other modules (``tied_layers``), the
sum of every use's gradient rotated by the registered layer's basis.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from ..layers.base import LayerAdapter
from .basis import BasisSolver, Previous
from .block import CurvatureBlock
from .decomposition import Decomposition, Shape, State
from .factors import KroneckerFactor, RunningAverage
from .moments import EigenbasisMoments

Side = Literal["A", "G"]


class OneSidedEigen(Decomposition):
    """The decomposition of a one-sided block: ``(Q, v)`` of its kept side; the other side's basis is the identity.

    Only ``eigenbasis_moments`` preconditions with it (the config refuses ``eigenbasis_max_dim`` without the key):
    it has a basis and no damped inverse."""

    colocated = False

    def __init__(self, side: Side, solver: BasisSolver) -> None:
        super().__init__(relative_damping=False)
        self.side = side
        self.name = f"eigen-one-sided-{side}"
        self.solver = solver
        """As :attr:`~.decomposition.EigenDecomposition.solver`: how a refresh computes the kept side."""

    @property
    def basis_rounding(self) -> Optional[float]:
        """As :attr:`~.decomposition.EigenDecomposition.basis_rounding`."""
        return self.solver.exact_rounding

    def side_shapes(self, a_dim: int, g_dim: int) -> tuple[list[Shape], list[Shape]]:
        dim = a_dim if self.side == "A" else g_dim
        kept: list[Shape] = [(dim, dim), (dim,)]
        return (kept, []) if self.side == "A" else ([], kept)

    def compute(
        self,
        a: Optional[torch.Tensor],
        g: Optional[torch.Tensor],
        damping: float,
        dtype: torch.dtype,
        previous: Previous = (None, None),
    ) -> tuple[Optional[State], Optional[State]]:
        factor, kept = (a, previous[0]) if self.side == "A" else (g, previous[1])
        state = None if factor is None else self.solver(factor, dtype, kept)
        return (state, None) if self.side == "A" else (None, state)

    def basis(self, state: State) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(Q_A, Q_G)``, ``None`` for the side left in the parameter basis (a stacked state gives stacks)."""
        return (state[0], None) if self.side == "A" else (None, state[0])

    def spectra(self, state: State) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(v_A, v_G)``, ``None`` for the side left in the parameter basis."""
        return (state[1], None) if self.side == "A" else (None, state[1])

    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        raise NotImplementedError("a one-sided block has no P(g): it preconditions through eigenbasis_moments only")


class OneSidedBlock(CurvatureBlock):
    """A layer's factor of one side (``A`` or ``G``), its eigenbasis and the base optimizer's moments in it."""

    method: OneSidedEigen

    def __init__(
        self,
        name: str,
        adapter: LayerAdapter,
        method: OneSidedEigen,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(name, adapter, method, inv_dtype)
        self.sides = (method.side,)
        self.dim = adapter.a_dim if method.side == "A" else adapter.g_dim
        self.factor = KroneckerFactor(self.dim, factor_dtype, bias_column=method.side == "A" and adapter.has_bias)
        self.moments = EigenbasisMoments()

    def statistics(self) -> dict[str, RunningAverage]:
        return {self.method.side: self.factor}

    def forward_statistic(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The call's ``A`` statistic (counted at the backward, as a two-sided block's); nothing for ``G``."""
        if self.method.side != "A":
            return None
        return self.factor.statistic(self.adapter.input_rows(x), bias_column=self.adapter.has_bias)

    def backward_statistic(self, pending: Any, grad: torch.Tensor, examples: int, scale: Any) -> None:
        if self.method.side == "A":
            self.factor.add(pending)
        else:
            self.factor.accumulate(self.adapter.output_grad_rows(grad), scale)

    def side_shapes(self) -> dict[str, list[Shape]]:
        a_side, g_side = self.method.side_shapes(self.adapter.a_dim, self.adapter.g_dim)
        return {self.method.side: a_side or g_side}

    def compute_sides(
        self, values: dict[str, Optional[torch.Tensor]], damping: float, dtype: torch.dtype
    ) -> dict[str, Optional[State]]:
        previous = self.side_states().get(self.method.side)
        a_side, g_side = self.method.compute(values.get("A"), values.get("G"), damping, dtype, (previous, previous))
        return {self.method.side: a_side if self.method.side == "A" else g_side}

    def costs(self, power: int) -> tuple[float, ...]:
        return (float(self.dim) ** power,)

    def install(self, state: State) -> None:
        """Adopt a new basis, the moments moved onto it (from the identity before the first)."""
        old = None if self.decomposition is None else self.method.basis(self.decomposition)
        self.moments.rebase(old, self.method.basis(state))
        self.decomposition = state
