"""The numerics every decomposition shares: LAPACK with a float64 retry, the curvature floor of relative
damping, and finiteness as a device tensor (see :mod:`.decomposition` for the methods built on them)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .factors import is_finite


def with_fallback(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], matrix: torch.Tensor, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, ...]]:
    """``fn(matrix)`` in ``dtype``, retried in float64 (results cast back) if LAPACK fails; ``None`` if both fail.

    Results keep LAPACK's layout (column-major eigenvectors; a rank that receives them
    by broadcast holds them row-major): preconditioning runs on stacked copies
    (:class:`~ds_kfac.curvature.block.StackedStates`), which have one layout on every
    rank, so matmuls, and so parameters, stay bit-identical across ranks.
    """
    for attempt in (dtype, torch.float64):
        try:
            return tuple(t.to(dtype) for t in fn(matrix.to(attempt)))
        except torch.linalg.LinAlgError:
            continue
    return None


def eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(matrix)
    return vectors, values.clamp_(min=0.0)


def inv(matrix: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.linalg.inv(matrix),)


def in_eigenbasis(
    qa: torch.Tensor, qg: torch.Tensor, grad: torch.Tensor, rescale: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``Q_G rescale(Q_G^T grad Q_A) Q_A^T``: the eigen methods differ only in how they rescale in the eigenbasis."""
    rotated = qg.mT @ grad.to(qa.dtype) @ qa
    return qg @ rescale(rotated) @ qa.mT


def floor_damping(damping: torch.Tensor) -> torch.Tensor:
    """A relative damping kept a normal number (it underflows when a tiny ``damping`` multiplies a small curvature),
    so that no ``0 / 0`` arises; blocks without usable curvature are passed through anyway (:meth:`uncurved`)."""
    return damping.clamp(min=torch.finfo(damping.dtype).tiny)


def curvature_floor(dtype: torch.dtype) -> float:
    """The smallest mean curvature ``mean(eig A) * mean(eig G)`` relative damping uses in ``dtype``:
    ``finfo.tiny / finfo.eps`` (9.9e-32 in float32, 1.0e-292 in float64).

    Below it, ``eps`` times the block's curvature (the rounding unit of the products ``v_G v_A^T`` and of the
    damping scaled by it) is a subnormal number or 0: the block's curvature has lost its precision, or is 0 (an
    all-zero factor). A constant of the dtype, so it cannot vanish with the layer."""
    info = torch.finfo(dtype)
    return info.tiny / info.eps


def below_floor(mean_a: torch.Tensor, mean_g: torch.Tensor) -> torch.Tensor:
    """Whether the mean curvature ``mean_a * mean_g`` is below :func:`curvature_floor` (a device tensor)."""
    return mean_a * mean_g < curvature_floor(mean_a.dtype)


def all_finite(state: Optional[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Whether a decomposition exists and is finite, as a device tensor (no host sync)."""
    if state is None:
        return torch.tensor(False)
    return torch.stack([is_finite(t) for t in state]).all()
