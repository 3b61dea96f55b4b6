"""The numerics every decomposition shares: LAPACK with a float64 retry, the curvature floor of relative
damping, the compute dtype and finiteness as a device tensor, a change of eigenbasis (see :mod:`.decomposition` for the methods built on them)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch


def compute_dtype(storage_dtype: torch.dtype) -> torch.dtype:
    """K-FAC arithmetic runs in float32 or better, whatever the storage dtype."""
    return torch.float64 if storage_dtype == torch.float64 else torch.float32


def is_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` is finite, as a device tensor (no host sync): one summing pass, no temporary of
    its size. A NaN or infinity makes the sum non-finite (summed in float32 or better, so a finite
    float16 tensor does not overflow its own sum)."""
    return torch.isfinite(t.sum(dtype=compute_dtype(t.dtype)))


def finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """:func:`is_finite` of each tensor, with one host sync for all of them."""
    if not tensors:
        return []
    return torch.stack([is_finite(t) for t in tensors]).tolist()


def with_fallback(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], matrix: torch.Tensor, dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, ...]]:
    """``fn(matrix)`` in ``dtype``, retried in float64 (results cast back) if LAPACK fails; ``None`` if both fail.

    Results keep LAPACK's layout (column-major eigenvectors; a rank that receives them
    by broadcast holds them row-major): preconditioning runs on stacked copies
    (:class:`~ds_kfac.curvature.stacked.StackedStates`), which have one layout on every
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


def canonical_eigh(matrix: torch.Tensor, rounding: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`eigh` in float64 with a basis fixed inside every cluster of equal eigenvalues, for bases whose every
    vector matters (``eigenbasis_moments``: Adam's per-element rule is not invariant to rotations inside an
    eigenspace, and LAPACK picks those from rounding, so two reduction orders of one factor, e.g. 2 ranks and one
    process, got different updates).

    Eigenvalues whose gaps to their neighbours are within the factor's rounding, ``sqrt(n) rounding max|v|``
    (``rounding``: the unit roundoff the factor was summed in), form a cluster: the null space of a factor of fewer
    rows than its size, above all. Its basis becomes the eigenvectors of the compression of
    ``diag(1, 2, ..., n)`` onto the cluster's span, which depend on the span only: the vectors of the span nearest
    the coordinate axes, in their order. A second ``eigh``, only when some cluster has two eigenvalues or more
    (one host sync per factor, at decompositions)."""
    m = matrix.to(torch.float64)
    values, vectors = torch.linalg.eigh(m)
    n = values.shape[-1]
    tol = n**0.5 * rounding * values.abs().amax(-1, keepdim=True)
    splits = values.diff(dim=-1) > tol
    if bool(splits.all()):
        return vectors, values.clamp_(min=0.0)
    cluster = torch.cat([torch.zeros_like(splits[..., :1]), splits], -1).cumsum(-1).to(m.dtype)
    axes = torch.arange(1, n + 1, dtype=m.dtype, device=m.device) / n
    compressed = vectors.mT @ (axes[:, None] * vectors)
    compressed = torch.where(cluster[..., :, None] == cluster[..., None, :], compressed, 0.0)
    # 2 k on the diagonal of cluster k keeps the clusters' spectra (in [2k, 2k + 1]) apart and in order.
    _, within = torch.linalg.eigh(compressed + torch.diag_embed(2.0 * cluster))
    return vectors @ within, values.clamp_(min=0.0)


@contextmanager
def full_precision_matmuls() -> Iterator[None]:
    """float32 matmuls at full precision inside, whatever ``torch.set_float32_matmul_precision`` the user chose (TF32
    on CUDA, bf16 on CPUs with AVX512-BF16: 8 to 10 bits of mantissa), restored after. For a refresh's ``F Q``, whose
    Rayleigh quotients become eigenvalues: reduced precision would blur every eigenvalue below about 1e-3 of the
    largest. The switch is process-wide, so a matmul of another thread meanwhile (``async_decompositions``' worker
    runs beside the step) runs at full precision too: slower, never less exact."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def basis_drift(matrix: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How far ``basis`` (orthonormal columns) is from diagonalising the symmetric ``matrix``: ``(F Q, r, drift)``
    with ``r_i = q_i^T F q_i`` (the Rayleigh quotients) and ``drift = ||offdiag(Q^T F Q)||_F / ||F||_F``
    (``||F Q - Q diag(r)||_F``, as ``Q`` is orthogonal), a device tensor; 0 for a zero ``matrix``. One matmul, the
    rest ``O(n^2)``."""
    y = matrix @ basis
    rayleigh = (basis * y).sum(-2)
    off = (y - basis * rayleigh[..., None, :]).norm(dim=(-2, -1))
    return y, rayleigh, off / matrix.norm(dim=(-2, -1)).clamp(min=torch.finfo(matrix.dtype).tiny)


def subspace_step(y: torch.Tensor, rayleigh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of subspace (orthogonal) iteration from a basis ``Q``: ``y = F Q`` orthonormalised by a QR, its
    columns first put in descending order of their Rayleigh quotients ``rayleigh`` (so the dominant directions
    are kept and the small ones orthogonalised against them) and signed so that ``R`` has a non-negative diagonal
    (a converged basis maps onto itself). Returns ``(Q_new, rayleigh)`` in that order, the Rayleigh quotients
    clamped at 0 as the eigenvalues: they are accurate to second order in the basis' error."""
    order = rayleigh.argsort(dim=-1, descending=True)
    y = y.gather(-1, order[..., None, :].expand_as(y))
    q, r = torch.linalg.qr(y)
    sign = torch.where(r.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    return q * sign[..., None, :], rayleigh.gather(-1, order).clamp_(min=0.0)


def inv(matrix: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.linalg.inv(matrix),)


def in_eigenbasis(
    qa: torch.Tensor, qg: torch.Tensor, grad: torch.Tensor, rescale: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``Q_G rescale(Q_G^T grad Q_A) Q_A^T``: the eigen methods differ only in how they rescale in the eigenbasis."""
    rotated = qg.mT @ grad.to(qa.dtype) @ qa
    return qg @ rescale(rotated) @ qa.mT


Basis = Optional[tuple[torch.Tensor, torch.Tensor]]
"""A layer's eigenbasis ``(Q_A, Q_G)``; ``None`` is the identity (no decomposition yet)."""


Changes = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
"""Per side ``(A, G)``, ``C = Q_new^T Q_old``, or ``None`` for a side whose basis did not change."""


def basis_changes(old: Basis, new: Basis) -> Changes:
    """``C = Q_new^T Q_old`` of each side whose basis changed (one ``d^3`` matmul each; ``None`` for a side whose
    basis is the same tensor in both: adaptive and spread refreshes renew one side at a time). Computed once for
    everything a refresh moves (the moments' ``m`` and ``v``)."""
    (old_a, old_g), (new_a, new_g) = old or (None, None), new or (None, None)
    return (
        None if new_a is old_a else _change(new_a, old_a),
        None if new_g is old_g else _change(new_g, old_g),
    )


def change_basis(x: torch.Tensor, changes: Changes, squared: bool = False) -> torch.Tensor:
    """``x`` (``d_G x d_A``) given in the old basis of :func:`basis_changes`, in the new one: ``C_G x C_A^T``.
    ``squared``: with ``C`` squared elementwise, ``(q_new_i . q_old_k)^2``, which carries a diagonal second moment
    described in the old basis to its diagonal in the new."""
    change_a, change_g = (c if c is None or not squared else c.square() for c in changes)
    if change_g is not None:
        x = change_g.to(x.dtype) @ x
    if change_a is not None:
        x = x @ change_a.to(x.dtype).mT
    return x


def _change(new: Optional[torch.Tensor], old: Optional[torch.Tensor]) -> torch.Tensor:
    """``Q_new^T Q_old``, either basis ``None`` for the identity."""
    if old is None:
        return new.mT
    if new is None:
        return old
    return new.mT @ old.to(new.dtype)


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
