"""Eigenvalue-corrected K-FAC (George et al., NeurIPS 2018): per-example gradients' second moment in the eigenbasis.

K-FAC's eigen method divides a gradient, rotated into the eigenbasis ``Q_G, Q_A`` of its factors, by the Kronecker
eigenvalues ``v_G v_A^T``. The eigenvalue correction divides by ``S = E_i[(Q_G^T g_i Q_A)^2]`` instead, the second
moment of the per-example gradients ``g_i`` in that basis: the best diagonal scaling in the basis, where ``v_G v_A^T``
is exact only when the examples' gradients are Kronecker products whose sides are independent. ``g_i`` sums example
``i``'s rows, ``g_i = sum_r (c g_r) a_r^T`` (rows and ``c`` as for the factors), so for one example with one row
``S = v_G v_A^T`` exactly. The definitions (when ``S`` is updated, how it follows a new basis) are in
docs/conventions.md.
"""

from __future__ import annotations

from typing import Union

import torch

from .factors import RunningAverage
from .numerics import basis_changes, change_basis, compute_dtype

PER_EXAMPLE_ELEMENTS = 2**24
"""At most this many elements of per-example gradients (``examples x g_dim x a_dim``) exist at once: examples with
several rows are projected in chunks of ``PER_EXAMPLE_ELEMENTS // (g_dim * a_dim)`` (at least one)."""


class EigenvalueCorrection(RunningAverage):
    """Running average of ``S`` (``g_dim x a_dim``) for one layer, in the layer's current eigenbasis."""

    def __init__(self, a_dim: int, g_dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__((g_dim, a_dim), dtype)

    def accumulate(
        self,
        a_rows: torch.Tensor,
        g_rows: torch.Tensor,
        examples: int,
        scale: Union[float, torch.Tensor],
        basis: tuple[torch.Tensor, torch.Tensor],
        bias_column: bool,
    ) -> None:
        """Add one micro-batch: ``(scale^2 / B) sum_i (Q_G^T g_i Q_A)^2`` over its ``B = examples`` examples, with
        ``g_i = sum_r g_r a_r^T`` over example ``i``'s rows (the rows are example-major, the same number per
        example; ``a_rows`` without the bias column, which ``bias_column`` appends).

        ``(Q_G^T g_i Q_A) = (G_i Q_G)^T (A_i Q_A)`` for the example's row matrices ``A_i``, ``G_i``: the rows are
        rotated once, then each example's product is formed (one GEMM of squares for one row per example)."""
        qa, qg = basis
        dtype = torch.promote_types(compute_dtype(self.dtype), qa.dtype)
        qa, qg = qa.to(dtype), qg.to(dtype)
        a = a_rows.detach().to(dtype)
        a = torch.addmm(qa[-1], a, qa[:-1]) if bias_column else a @ qa  # [a, 1] Q_A
        g = g_rows.detach().to(dtype) @ qg
        a, g = a.reshape(examples, -1, a.shape[-1]), g.reshape(examples, -1, g.shape[-1])
        if a.shape[1] == 1:
            statistic = g[:, 0].square().t() @ a[:, 0].square()
        else:
            chunk = max(1, PER_EXAMPLE_ELEMENTS // (a.shape[-1] * g.shape[-1]))
            statistic = torch.zeros(self.shape, dtype=dtype, device=a.device)
            for start in range(0, examples, chunk):
                per_example = g[start : start + chunk].mT @ a[start : start + chunk]
                statistic.add_(per_example.square_().sum(dim=0))
        self.add(statistic.mul_(scale * scale / examples))

    def rebase(self, old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Re-project ``S`` from eigenbasis ``old`` (``Q_A, Q_G``) onto ``new`` (:func:`~.numerics.change_basis`, squared: ``S' = R_G S R_A^T`` with
        ``R[i, k] = (q_new_i . q_old_k)^2``, the diagonal in the new basis of the diagonal second moment ``S``
        describes in the old one)."""
        if self.value is None:
            return
        s = self.value.to(torch.promote_types(compute_dtype(self.dtype), new[0].dtype))
        self.value = change_basis(s, basis_changes(old, new), squared=True).to(self.dtype)
