"""How a refresh computes an eigen method's basis and eigenvalues (``basis_update``): :class:`BasisSolver`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

import torch

from .numerics import basis_drift, canonical_eigh, eigh, full_precision_matmuls, subspace_step, with_fallback

if TYPE_CHECKING:
    from ..config import KFACConfig

State = tuple[torch.Tensor, ...]
REFRESH_KINDS = ("full", "subspace", "kept")
"""How a refresh computed a side (:attr:`BasisSolver.counts`' keys; the metrics ``kfac/refresh/<kind>``)."""
Previous = tuple[Optional[State], Optional[State]]
"""A layer's current ``A`` and ``G`` sides (``None`` where it has none yet): where a refresh may start from."""


@dataclass(frozen=True)
class BasisSolver:
    """How a refresh computes a factor's eigenbasis and eigenvalues ``(Q, v)`` (``basis_update``).

    * ``"subspace"``: a full :func:`~.numerics.eigh` the first time; afterwards one step of subspace iteration
      from the previous basis (``F Q_old`` orthonormalised by a QR, :func:`~.numerics.subspace_step`; eigenvalues
      from its Rayleigh quotients), or a full ``eigh`` where the previous basis has drifted,
      ``||offdiag(Q_old^T F Q_old)||_F > max_drift ||F||_F`` (:func:`~.numerics.basis_drift`: one host sync per
      factor, at refreshes only). A matmul and a QR instead of an eigendecomposition: SOAP's and Distributed
      Shampoo's warm-started update. Deterministic given the previous basis, which the layer's decomposing rank
      holds (and a checkpoint keeps), so ranks agree and a resumed run refreshes as an uninterrupted one. Where
      the drift is at most ``keep_drift``, the side keeps its basis (no QR; its eigenvalues become the Rayleigh
      quotients the drift test computed): the installed basis is then the same tensor, so the moments and ``S``
      need no move (:func:`~.numerics.basis_changes`), and a refresh costs that side one matmul.
    * ``"eigh"``: a full ``eigh`` in the decomposition's dtype every time.
    * ``"exact"``: :func:`~.numerics.canonical_eigh` every time: float64, bases canonical inside clusters of equal
      eigenvalues (``rounding``: the factors' unit roundoff), so a reduction order's rounding cannot pick the
      basis; with ``eigenbasis_moments`` the preconditioning also flushes rotated entries within rounding of 0
      (:func:`~.moments.eigenbasis_directions`). For bit-level agreement of placements and world sizes.
    """

    mode: Literal["subspace", "eigh", "exact"] = "eigh"
    rounding: float = 0.0
    max_drift: float = 0.5
    keep_drift: float = 0.0
    counts: Counter = field(default_factory=Counter, compare=False, repr=False)
    """This process's refreshes by how they were computed (``"full"``, ``"subspace"``, ``"kept"``), for the
    metrics."""
    drifts: Counter = field(default_factory=Counter, compare=False, repr=False)
    """The drifts its warm starts measured: ``"sum"``, ``"max"``, ``"count"`` (how far bases move between refreshes:
    near ``max_drift``, the cadence is too long for the subspace step), for the metrics."""

    @property
    def exact_rounding(self) -> Optional[float]:
        """``rounding`` in the ``"exact"`` mode (canonical bases; with ``eigenbasis_moments`` rounding-level entries
        flushed in the eigenbasis), ``None`` otherwise."""
        return self.rounding if self.mode == "exact" else None

    def __call__(self, factor: torch.Tensor, dtype: torch.dtype, previous: Optional[State]) -> Optional[State]:
        """``(Q, v)`` of ``factor`` in ``dtype`` (``previous``: the side's current state, or ``None``); ``None``
        if LAPACK fails in float64 too."""
        if self.mode == "subspace" and previous is not None:
            # One memory layout whatever the basis' history (LAPACK's column-major result, a broadcast's or a
            # checkpoint's row-major copy), so the matmul, and a resumed run, give the same bits.
            warm = self._warm(factor.to(dtype).contiguous(), previous[0].to(dtype).contiguous())
            if warm is not None:
                return warm
        self.counts["full"] += 1
        if self.mode == "exact":
            return with_fallback(lambda m: canonical_eigh(m, self.rounding), factor, dtype)
        return with_fallback(eigh, factor, dtype)

    def _warm(self, matrix: torch.Tensor, basis: torch.Tensor) -> Optional[State]:
        """``basis`` kept, or one subspace step from it, or ``None`` where it drifted too far (or the result is not
        finite)."""
        with full_precision_matmuls():  # whatever matmul precision the user allows the rest of the step
            y, rayleigh, drift = basis_drift(matrix, basis)
        value = float(drift)  # the refresh's one host sync per factor
        if value == value:  # not NaN
            self.drifts.update(sum=value, count=1)
            self.drifts["max"] = max(self.drifts["max"], value)
        if not value <= self.max_drift:  # a NaN drift too: the full eigh decides
            return None
        if value <= self.keep_drift:
            self.counts["kept"] += 1
            return basis, rayleigh.clamp(min=0.0)
        try:
            warm = subspace_step(y, rayleigh)
        except torch.linalg.LinAlgError:
            return None
        self.counts["subspace"] += 1
        return warm


def solver_for(config: KFACConfig) -> BasisSolver:
    """The eigen methods' :class:`BasisSolver` for ``config`` (``basis_update``, ``basis_max_drift``,
    ``basis_keep_drift``; ``"exact"`` rounds at the coarser of the factor and decomposition dtypes)."""
    rounding = max(torch.finfo(d).eps for d in (config.factor_torch_dtype, config.inv_torch_dtype))
    return BasisSolver(config.basis_update, rounding, config.basis_max_drift, config.basis_keep_drift)
