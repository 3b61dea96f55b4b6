"""Factor decompositions and the preconditioning they define.

``eigen``::

    P(g) = Q_G [ (Q_G^T g Q_A) / (v_G v_A^T + damping) ] Q_A^T

``eigen`` with ``eigenvalue_correction`` (George et al. 2018; ``S`` from :mod:`.correction`)::

    P(g) = Q_G [ (Q_G^T g Q_A) / (S + damping) ] Q_A^T

``eigen`` with ``eigenvalue_outer_product`` (KAISA's precompute)::

    D = 1 / (v_G v_A^T + damping)        (cached by each gradient worker)
    P(g) = Q_G [ (Q_G^T g Q_A) * D ] Q_A^T

  the same ``P(g)`` as ``eigen`` and the same state, sent the same way; each
  gradient worker computes ``D`` when it installs a decomposition (and again
  when the damping changes), so a step does one elementwise multiply instead of
  an outer product, an add and a divide, for ``d_G x d_A`` floats of memory.

``inverse`` (factored Tikhonov damping with ``pi = sqrt((tr A / dim A) / (tr G / dim G))``)::

    P(g) = (G + sqrt(damping)/pi I)^-1  g  (A + pi sqrt(damping) I)^-1

With ``relative_damping`` the damping is relative to the block's mean
curvature: ``damping * mean(eig A) * mean(eig G)`` replaces ``damping``
(``mean(eig F) = tr F / dim F``; the eigenvalues clamped at 0 for the eigen
methods; ``damping * mean(S)`` with the eigenvalue correction, the same
for ``S = v_G v_A^T``), so ``P(g)``'s direction does not depend on the scale of a layer's
factors, which differs by orders of magnitude between layers. For ``inverse``
this makes the factor dampings ``sqrt(damping) tr A / dim A`` and
``sqrt(damping) tr G / dim G``. A block whose mean curvature
``mean(eig A) * mean(eig G)`` is below :func:`~.numerics.curvature_floor` (an all-zero or
nearly zero factor: a dead layer) has no usable curvature: :meth:`Decomposition.uncurved`
flags it, and its gradient passes through unpreconditioned (``inverse`` stores
zero matrices for it). A side whose own mean curvature is below that floor (``A``'s
over its input rows) is decomposed as zero (:meth:`~.factors.KroneckerFactor.decomposed`).

Preconditioning accepts leading batch dimensions (a stack of layers of one
shape, each with its own state and damping), so equal-shaped layers are
preconditioned by one batched matmul per product.

Decompositions run in ``inv_dtype`` (float32 at least) and are retried in
float64 when LAPACK fails; eigenvalues are clamped at 0. How the eigen methods
compute a basis at a refresh (``basis_update``: one step of subspace iteration
from the previous basis, a full ``eigh``, or the exact canonical one) is
:class:`~.basis.BasisSolver`'s. Whether a result is
finite is returned as a device tensor, so a caller can check many layers with
one host sync.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

import torch

from .basis import BasisSolver, Previous, State, solver_for  # State: the decomposition's tensors, re-exported
from .numerics import below_floor, floor_damping, in_eigenbasis, inv, with_fallback

if TYPE_CHECKING:
    from ..config import KFACConfig

Shape = tuple[int, ...]


class Decomposition(ABC):
    """A compute method: what is stored per factor and how it preconditions.

    A layer's state is ``a_side + g_side``: the tensors of its ``A`` side
    followed by those of its ``G`` side, so the two sides can be computed on
    different ranks and sent separately.
    """

    name: str
    colocated: bool
    """Whether both sides must be computed together (on one rank)."""

    def __init__(self, relative_damping: bool = False) -> None:
        self.relative_damping = relative_damping

    def uncurved(self, state: State) -> Optional[torch.Tensor]:
        """With ``relative_damping``, which layers of ``state`` (a bool per leading index, on the device) have no
        usable curvature (their gradient passes through); ``None`` without it (absolute damping is defined for
        any curvature)."""
        return None

    def block_damping(self, damping: float, va: torch.Tensor, vg: torch.Tensor) -> torch.Tensor | float:
        """The damping of ``A (x) G`` given both eigenvalue sets: ``damping``, or with
        ``relative_damping`` ``damping * mean(v_A) * mean(v_G)`` (a device tensor, no host sync),
        shaped to broadcast over each layer's ``d_G x d_A`` matrix."""
        if not self.relative_damping:
            return damping
        return floor_damping(va.mean(-1) * vg.mean(-1) * damping)[..., None, None]

    @abstractmethod
    def side_shapes(self, a_dim: int, g_dim: int) -> tuple[list[Shape], list[Shape]]:
        """Shapes of the ``A`` side's and the ``G`` side's tensors for a layer with these factor sizes."""

    @abstractmethod
    def compute(
        self,
        a: Optional[torch.Tensor],
        g: Optional[torch.Tensor],
        damping: float,
        dtype: torch.dtype,
        previous: Previous = (None, None),
    ) -> tuple[Optional[State], Optional[State]]:
        """The ``A`` and ``G`` sides from the factors given (``None`` where not given or LAPACK failed);
        ``previous``, the layer's current sides, where a method updates from them."""

    def precompute(self, state: State, damping: float) -> Optional[torch.Tensor]:
        """What :meth:`precondition` can reuse while the state and the damping stay the same (``None``: nothing)."""
        return None

    @abstractmethod
    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``P(grad)`` for a ``d_G x d_A`` gradient matrix (or a stack of them, with stacked
        states), in the state's dtype; ``cached`` is :meth:`precompute`'s result, when kept. ``scaling``
        (``d_G x d_A`` per layer) replaces the Kronecker eigenvalues ``v_G v_A^T`` in the eigenbasis (the
        eigenvalue correction ``S``); only ``eigen`` takes it (the config refuses the correction with the others)."""


class EigenDecomposition(Decomposition):
    """Sides ``(Q_A, v_A)`` and ``(Q_G, v_G)``, independent; damping is applied when preconditioning."""

    name = "eigen"
    colocated = False

    def side_shapes(self, a_dim: int, g_dim: int) -> tuple[list[Shape], list[Shape]]:
        return [(a_dim, a_dim), (a_dim,)], [(g_dim, g_dim), (g_dim,)]

    def uncurved(self, state: State) -> Optional[torch.Tensor]:
        if not self.relative_damping:
            return None
        _, va, _, vg = state
        return below_floor(va.mean(-1), vg.mean(-1))

    def __init__(self, relative_damping: bool = False) -> None:
        super().__init__(relative_damping)
        self.solver = BasisSolver()
        """How a refresh computes each side (``basis_update``; :func:`method_for` sets the config's); one per
        instance, as it counts the refreshes it made."""

    @property
    def basis_rounding(self) -> Optional[float]:
        """In the ``"exact"`` mode, the unit roundoff of the factors (bases canonical inside clusters, rounding
        flushed in the eigenbasis); ``None`` otherwise."""
        return self.solver.exact_rounding

    def compute(
        self,
        a: Optional[torch.Tensor],
        g: Optional[torch.Tensor],
        damping: float,
        dtype: torch.dtype,
        previous: Previous = (None, None),
    ) -> tuple[Optional[State], Optional[State]]:
        return tuple(None if f is None else self.solver(f, dtype, p) for f, p in zip((a, g), previous))

    @staticmethod
    def basis(state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """The eigenvectors ``(Q_A, Q_G)`` of a state."""
        return state[0], state[2]

    @staticmethod
    def spectra(state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """The eigenvalues ``(v_A, v_G)`` of a state."""
        return state[1], state[3]

    @staticmethod
    def eigenvalues(state: State) -> torch.Tensor:
        """The Kronecker eigenvalues ``v_G v_A^T`` (``d_G x d_A``, or a stack) of a state, as a new tensor."""
        _, va, _, vg = state
        return vg[..., :, None] * va[..., None, :]

    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        qa, va, qg, vg = state
        if scaling is None:
            denominator = self.eigenvalues(state).add_(self.block_damping(damping, va, vg))
        else:
            denominator = scaling + self.corrected_damping(damping, scaling)
        return in_eigenbasis(qa, qg, grad, lambda rotated: rotated.div_(denominator))

    def corrected_damping(self, damping: float, scaling: torch.Tensor) -> torch.Tensor | float:
        """The damping with the eigenvalue correction ``S``: ``damping``, or with ``relative_damping``
        ``damping * mean(S)`` per layer (``damping * mean(v_A) * mean(v_G)`` for ``S = v_G v_A^T``)."""
        if not self.relative_damping:
            return damping
        return floor_damping(scaling.mean(dim=(-2, -1)) * damping)[..., None, None]


class EigenOuterDecomposition(EigenDecomposition):
    """``eigen``'s state and sides, with ``D = 1 / (v_G v_A^T + damping)`` (``g_dim x a_dim``)
    precomputed by each gradient worker: preconditioning is one elementwise multiply in the eigenbasis."""

    name = "eigen-outer"

    def precompute(self, state: State, damping: float) -> torch.Tensor:
        _, va, _, vg = state
        return self.eigenvalues(state).add_(self.block_damping(damping, va, vg)).reciprocal_()

    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        qa, _, qg, _ = state
        d = cached if cached is not None else self.precompute(state, damping)
        return in_eigenbasis(qa, qg, grad, lambda rotated: rotated.mul_(d))


class InverseDecomposition(Decomposition):
    """Sides ``(A_damped^-1,)`` and ``(G_damped^-1,)``; damping is folded in at decomposition
    time and couples the sides through ``pi``, so both are computed together. With ``relative_damping``,
    a block without usable curvature gets zero matrices (an inverse is never zero), which :meth:`uncurved` reads."""

    name = "inverse"
    colocated = True

    def side_shapes(self, a_dim: int, g_dim: int) -> tuple[list[Shape], list[Shape]]:
        return [(a_dim, a_dim)], [(g_dim, g_dim)]

    def uncurved(self, state: State) -> Optional[torch.Tensor]:
        if not self.relative_damping:
            return None
        return (state[0] == 0).all(dim=-1).all(dim=-1)

    def compute(
        self,
        a: Optional[torch.Tensor],
        g: Optional[torch.Tensor],
        damping: float,
        dtype: torch.dtype,
        previous: Previous = (None, None),
    ) -> tuple[Optional[State], Optional[State]]:
        if a is None or g is None:
            raise ValueError("the inverse method decomposes A and G together")
        a, g = a.to(dtype), g.to(dtype)
        ta, tg = torch.trace(a) / a.shape[0], torch.trace(g) / g.shape[0]
        root = math.sqrt(damping)
        uncurved = None
        if self.relative_damping:
            # pi * sqrt(damping * ta * tg) and sqrt(damping * ta * tg) / pi.
            damp_a, damp_g = floor_damping(root * ta), floor_damping(root * tg)
            uncurved = below_floor(ta, tg)
        else:
            # pi balances the damping between the factors; 1 when a trace is not positive.
            ok = (ta > 0) & (tg > 0)
            pi = torch.where(ok, torch.sqrt(ta / tg.clamp(min=torch.finfo(dtype).tiny)), torch.ones_like(ta))
            damp_a, damp_g = pi * root, root / pi
        eye_a = torch.eye(a.shape[0], dtype=dtype, device=a.device)
        eye_g = torch.eye(g.shape[0], dtype=dtype, device=g.device)
        sides = with_fallback(inv, a + damp_a * eye_a, dtype), with_fallback(inv, g + damp_g * eye_g, dtype)
        if uncurved is None:
            return sides
        return tuple(None if s is None else (torch.where(uncurved, 0.0, s[0]),) for s in sides)

    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        a_inv, g_inv = state
        return g_inv @ grad.to(a_inv.dtype) @ a_inv


METHODS: dict[str, type[Decomposition]] = {"eigen": EigenDecomposition, "inverse": InverseDecomposition}


def method_for(config: KFACConfig) -> Decomposition:
    """The decomposition ``config`` asks for: ``compute_method``, refined by ``eigenvalue_outer_product``
    (which the config only accepts with ``"eigen"``), the eigen methods with the config's :class:`BasisSolver`."""
    if config.eigenvalue_outer_product:
        method: Decomposition = EigenOuterDecomposition(config.relative_damping)
    else:
        method = METHODS[config.compute_method](config.relative_damping)
    if isinstance(method, EigenDecomposition):
        method.solver = solver_for(config)
    return method
