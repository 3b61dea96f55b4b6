"""KL-Shampoo's two-sided factor estimation (Lin et al. 2025, arXiv 2509.03378) inside K-FAC's blocks: a prototype
for issue 66, item 3, tried on the BERT demo through ``gn_diagnose.py run --two-sided FLOOR`` before anything is
built into the package.

K-FAC estimates a layer's curvature ``E[(a a^T) kron (g g^T)]`` as ``A kron G`` with ``A = E[a a^T]`` and
``G = E[g g^T]``, which is exact when ``a`` and ``g`` are independent. The Kronecker product closest to it in KL
divergence (the maximum-likelihood Kronecker covariance, the "flip-flop" fixed point KL-Shampoo iterates once per
step) weights each row by its whitened norm under the other factor::

    A = E[a a^T (g^T G^-1 g)] / d_g        G = E[g g^T (a^T A^-1 a)] / d_a

Here ``A^-1`` and ``G^-1`` come from the block's current decomposition (``Q diag(v) Q^T``, floored at ``floor``
times the mean eigenvalue so that a direction with no curvature gets a bounded weight), as KL-Shampoo uses the
previous step's preconditioners; before the first decomposition the statistics are K-FAC's own. With
``eigenbasis_moments`` only the eigenvectors of ``A`` and ``G`` reach the update, so this changes the basis the
base optimizer's moments live in, nothing else. Blocks other than two-sided Kronecker blocks with an eigen
decomposition (the one-sided decoder) keep K-FAC's statistics.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ds_kfac.curvature import CurvatureBlock
from ds_kfac.curvature.block import KFACBlock
from ds_kfac.curvature.decomposition import EigenDecomposition


def whitened(rows: torch.Tensor, basis: torch.Tensor, values: torch.Tensor, floor: float) -> torch.Tensor:
    """Each row's ``x^T (Q diag(v + floor mean(v)) Q^T)^-1 x / d``: its weight for the other factor."""
    damped = values.clamp_min(0) + floor * values.clamp_min(0).mean()
    return (rows @ basis).square_().div_(damped).sum(dim=1).div_(rows.shape[1])


def weighted_second_moment(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(1 / n) sum_r w_r x_r x_r^T`` over the ``n`` rows."""
    return (rows * weights[:, None]).t() @ rows / rows.shape[0]


class TwoSided:
    """One block's statistics made two-sided, by replacing its bound ``forward_statistic`` and
    ``backward_statistic`` on the instance (a benchmark's prototype, not the package's way)."""

    def __init__(self, block: KFACBlock, floor: float) -> None:
        self.block, self.floor = block, floor
        self.plain_forward, self.plain_backward = block.forward_statistic, block.backward_statistic
        block.forward_statistic, block.backward_statistic = self.forward, self.backward

    def forward(self, x: torch.Tensor) -> Any:
        if self.block.decomposition is None:
            return self.plain_forward(x)
        return ("two-sided", x.detach())

    def backward(self, pending: Any, grad: torch.Tensor, examples: int, scale: Any) -> None:
        if not (isinstance(pending, tuple) and pending[0] == "two-sided"):
            return self.plain_backward(pending, grad, examples, scale)
        block = self.block
        dtype = torch.float32
        a = block.adapter.input_rows(pending[1]).detach().to(dtype)
        if block.adapter.has_bias:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        g = block.adapter.output_grad_rows(grad).detach().to(dtype) * scale
        qa, va, qg, vg = (t.to(dtype) for t in block.decomposition)
        block.a.add(weighted_second_moment(a, whitened(g, qg, vg, self.floor)).to(block.a.dtype))
        block.g.add(weighted_second_moment(g, whitened(a, qa, va, self.floor)).to(block.g.dtype))


def make_two_sided(blocks: Iterable[CurvatureBlock], floor: float) -> list[str]:
    """Every two-sided Kronecker block with an eigen decomposition made :class:`TwoSided`; their names."""
    done = []
    for block in blocks:
        if isinstance(block, KFACBlock) and isinstance(block.method, EigenDecomposition) and block.correction is None:
            TwoSided(block, floor)
            done.append(block.name)
    return done
