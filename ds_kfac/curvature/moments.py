"""The base optimizer's moments in K-FAC's eigenbasis (``eigenbasis_moments``; SOAP's idea, with K-FAC's bases).

A layer's gradient matrix ``g`` is rotated into the eigenbasis of its factors, ``r = Q_G^T g Q_A``; Adam's
first and second moments are kept there, ``m = b1 m + (1 - b1) r`` and ``v = b2 v + (1 - b2) r^2``; the
per-element normalised direction is taken there and rotated back::

    d = Q_G [ m / (sqrt(v) + eps) ] Q_A^T            (with the base optimizer's own bias correction)

The base optimizer then applies ``d`` as its update direction (weight decay, LAMB's trust ratio and the
learning rate act in the parameter basis) without a second per-element normalisation
(:mod:`ds_kfac.optimizers`). Before a layer's first decomposition its basis is the identity: the direction is
the base optimizer's own. When the basis changes, ``m`` is rotated exactly into the new one and ``v``, a
diagonal second moment, is re-projected the way the eigenvalue correction's ``S`` is (``v' = R_G v R_A^T``,
``R = (Q_new^T Q_old)^2`` elementwise; :func:`~.numerics.change_basis`); docs/conventions.md has the definitions and the measurement behind
that choice. Along a factor's null space, rotated entries within rounding of 0 are 0 and so are ``m`` and ``v``
there (:func:`eigenbasis_directions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .numerics import Basis, basis_changes, change_basis

FLUSH = 10.0
"""Rotated gradient entries within ``FLUSH`` unit roundoffs of their rounding bound are taken as 0
(:func:`eigenbasis_directions`)."""
NULL_UNIT = torch.finfo(torch.float32).eps
"""The unit roundoff of a factor's null space and of the rounding found there (:func:`null_directions`,
:func:`eigenbasis_directions`): float32's in every dtype, so a float64 run drops what a float32 one drops (with
float64's, the two runs of ``tests/workers/problem.py``'s 8-wide LayerNorm model part by 1.1e-2)."""
NULL_FLUSH = 1000.0
"""Along a null space, rotated gradient entries below ``NULL_FLUSH`` float32 roundoffs of the gradient's norm are
rounding (:func:`eigenbasis_directions`): 100 to 10,000 all keep 2 ranks within 3e-6 of one process on the LayerNorm
models of ``tests/workers/problem.py`` (8 and 16 wide), whose rounding there was below 1e-6 of the norm and whose
rows new to a factor gave about 1e-2."""
Spectra = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
"""A layer's (or a stack's) eigenvalues ``(v_A, v_G)``, ``None`` for a side left in the parameter basis."""


@dataclass(frozen=True)
class MomentRule:
    """The base optimizer's per-element rule, applied in the eigenbasis.

    ``bias_correction``: whether the direction divides ``m`` by ``1 - b1^t`` and ``v`` by ``1 - b2^t`` (torch's
    and DeepSpeed's Adam); LAMB with DeepSpeed's semantics leaves that to its step size, so its rule has
    ``False`` and the base optimizer multiplies by ``sqrt(1 - b2^t) / (1 - b1^t)`` as it does for every other
    parameter. ``eps_inside_sqrt``: ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``."""

    beta1: float
    beta2: float
    eps: float
    bias_correction: bool
    eps_inside_sqrt: bool = False

    def direction(self, m: torch.Tensor, v: torch.Tensor, steps: Sequence[int]) -> torch.Tensor:
        """The normalised direction of stacked moments ``m``, ``v`` (``n x d_G x d_A``) whose layers have taken
        ``steps`` updates each (from 1)."""
        if self.eps_inside_sqrt:
            return m / (v + self.eps).sqrt()
        if not self.bias_correction:
            return m / (v.sqrt() + self.eps)
        # As torch.optim.Adam: m / bc1 / (sqrt(v) / sqrt(bc2) + eps).
        bc1 = torch.tensor([1.0 - self.beta1**t for t in steps], dtype=m.dtype, device=m.device)[:, None, None]
        bc2 = torch.tensor([(1.0 - self.beta2**t) ** 0.5 for t in steps], dtype=m.dtype, device=m.device)
        return m / (v.sqrt() / bc2[:, None, None] + self.eps) / bc1


class EigenbasisMoments:
    """One layer's moments ``(m, v)`` (``d_G x d_A`` each, in its current eigenbasis) and their update count.

    Replaced, never modified in place, so a snapshot of :attr:`value` and :attr:`steps` is a pair of references
    (:mod:`ds_kfac.state`)."""

    def __init__(self) -> None:
        self.value: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.steps = 0

    def rebase(self, old: Basis, new: Basis) -> None:
        """Move the moments from basis ``old`` onto ``new``: ``m`` rotated exactly, ``v`` re-projected as a
        diagonal second moment."""
        if self.value is None:
            return
        m, v = self.value
        changes = basis_changes(old, new)
        self.value = (change_basis(m, changes), change_basis(v, changes, squared=True))


def step_moments(
    moments: Sequence[EigenbasisMoments],
    rotated: torch.Tensor,
    rule: MomentRule,
    null: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fold the rotated gradients ``rotated`` (a stack, one per layer of ``moments``) into the layers' moments
    and return their directions in the eigenbasis; ``m`` and ``v`` (so the direction) are 0 where ``null``
    (:func:`null_directions`). Each layer's moments become views of the new stacks."""
    beta1, beta2 = rule.beta1, rule.beta2
    grad = rotated.to(torch.promote_types(rotated.dtype, torch.float32))
    if all(x.value is None for x in moments):
        m = grad * (1.0 - beta1)
        v = grad.square() * (1.0 - beta2)
    else:
        zeros = torch.zeros_like(grad[0])
        m = torch.stack([zeros if x.value is None else x.value[0] for x in moments]).mul_(beta1)
        v = torch.stack([zeros if x.value is None else x.value[1] for x in moments]).mul_(beta2)
        m.add_(grad, alpha=1.0 - beta1)
        v.addcmul_(grad, grad, value=1.0 - beta2)
    if null is not None:
        m.masked_fill_(null, 0.0)
        v.masked_fill_(null, 0.0)
    steps = []
    for j, x in enumerate(moments):
        x.value = (m[j], v[j])
        x.steps += 1
        steps.append(x.steps)
    return rule.direction(m, v, steps).to(rotated.dtype)


def eigenbasis_directions(
    qa: Optional[torch.Tensor],
    qg: Optional[torch.Tensor],
    grads: torch.Tensor,
    moments: Sequence[EigenbasisMoments],
    rule: MomentRule,
    rounding: Optional[float] = None,
    spectra: Spectra = (None, None),
) -> torch.Tensor:
    """``Q_G d' Q_A^T`` for stacked gradients ``grads`` rotated into their layers' bases ``(Q_A, Q_G)``, ``d'`` the
    direction of :func:`step_moments`. A basis ``None`` is the identity (a one-sided block's other side). Two
    rotations (four batched matmuls) and the per-element rule: the rotations are the floor.

    Along a factor's null space (:func:`null_directions` of the eigenvalues ``spectra``), a rotated entry within
    ``NULL_FLUSH`` float32 roundoffs of the gradient's norm, ``|r_ij| <= NULL_FLUSH u ||g||_F``, is rounding (0 in
    exact arithmetic: the gradient's rows lie in the factor's range) and is taken as 0, with ``m`` and ``v`` there
    (the basis changes' rounding they carry): Adam's division would otherwise make it a step of the learning
    rate's order in a direction the curvature has not seen, different for every
    reduction order. Larger entries there are rows the factor has not seen yet (between refreshes), kept.

    With ``rounding`` (``basis_update: "exact"``), a rotated entry with
    ``|r_ij| <= FLUSH rounding (|Q_G|^T |g| |Q_A|)_ij`` is taken as 0 too, the moments keeping their decayed past
    (``rounding``: the unit roundoff of the gradient, the factors and the rotation, the coarsest): it is within the
    rounding error of ``g``'s sums and of the rotation, and Adam would normalise it differently for every reduction
    order (2 ranks against one process)."""
    g = grads.to((qa if qa is not None else qg).dtype)
    rotated = _rotate(g, qa, qg, lambda q: q.mT)
    null = null_directions(spectra)
    if null is not None:
        scale = g.flatten(-2).norm(dim=-1)[..., None, None]
        null = null & (rotated.abs() <= NULL_FLUSH * NULL_UNIT * scale)
        rotated = rotated.masked_fill(null, 0.0)
    if rounding is not None:  # a third rotation, of magnitudes: the bound
        bound = _rotate(g.abs(), qa, qg, lambda q: q.abs().mT)
        rotated = rotated.masked_fill(rotated.abs() <= FLUSH * rounding * bound, 0.0)
    return _rotate(step_moments(moments, rotated, rule, null), qa, qg, lambda q: q)


def null_directions(spectra: Spectra) -> Optional[torch.Tensor]:
    """Which entries of the rotated gradients (``d_G x d_A`` per layer) lie along a factor's null space: a row of
    ``Q_G`` or a column of ``Q_A`` whose eigenvalue is within float32's rounding of 0 relative to the factor's scale,
    ``v <= sqrt(n) u max(v)`` (``u`` float32's unit roundoff; :func:`~.numerics.canonical_eigh`'s tolerance for
    equal eigenvalues), in every dtype, so that a float64 run takes the same directions as null as a float32 one.
    ``None`` where neither side has eigenvalues (the identity)."""
    null: Optional[torch.Tensor] = None
    for values, at in zip(spectra, (-2, -1)):
        if values is not None:
            tol = values.shape[-1] ** 0.5 * NULL_UNIT * values.abs().amax(-1, keepdim=True)
            side = (values <= tol).unsqueeze(at)
            null = side if null is None else null | side
    return null


def _rotate(
    x: torch.Tensor, qa: Optional[torch.Tensor], qg: Optional[torch.Tensor], f: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``f(Q_G) x f(Q_A)^T``, a ``None`` basis skipped as the identity (``f`` transposes to rotate into the basis,
    takes magnitudes for the rounding bound, is the identity to rotate back)."""
    if qg is not None:
        x = f(qg) @ x
    if qa is not None:
        x = x @ f(qa).mT
    return x
