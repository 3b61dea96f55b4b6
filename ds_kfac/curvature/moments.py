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
that choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .numerics import Basis, basis_changes, change_basis

FLUSH = 10.0
"""Rotated gradient entries within ``FLUSH`` unit roundoffs of their rounding bound are taken as 0
(:func:`eigenbasis_directions`)."""


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


def step_moments(moments: Sequence[EigenbasisMoments], rotated: torch.Tensor, rule: MomentRule) -> torch.Tensor:
    """Fold the rotated gradients ``rotated`` (a stack, one per layer of ``moments``) into the layers' moments
    and return their directions in the eigenbasis. Each layer's moments become views of the new stacks."""
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
) -> torch.Tensor:
    """``Q_G d' Q_A^T`` for stacked gradients ``grads`` rotated into their layers' bases ``(Q_A, Q_G)``, ``d'`` the
    direction of :func:`step_moments`. A basis ``None`` is the identity (a one-sided block's other side). Two
    rotations (four batched matmuls) and the per-element rule: the rotations are the floor.

    With ``rounding`` (``basis_update: "exact"``), a rotated entry ``r_ij`` with
    ``|r_ij| <= FLUSH rounding (|Q_G|^T |g| |Q_A|)_ij`` is taken as 0 (``rounding``: the unit roundoff of the
    gradient, the factors and the rotation, the coarsest): it is within the rounding error of ``g``'s sums and of
    the rotation, as the entries of a gradient along a factor's null space are (0 in exact arithmetic), and Adam's
    division would scale that noise up to about ``noise / eps``, differently for every reduction order (2 ranks
    against one process)."""
    g = grads.to((qa if qa is not None else qg).dtype)
    rotated = _rotate(g, qa, qg, lambda q: q.mT)
    if rounding is not None:  # a third rotation, of magnitudes: the bound
        bound = _rotate(g.abs(), qa, qg, lambda q: q.abs().mT)
        rotated = rotated.masked_fill(rotated.abs() <= FLUSH * rounding * bound, 0.0)
    return _rotate(step_moments(moments, rotated, rule), qa, qg, lambda q: q)


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
