"""Unit-wise natural gradient for BatchNorm (SP-NGD, Osawa et al. 2019, section 4.2).

A BatchNorm channel ``c`` has two parameters, ``gamma_c`` and ``beta_c``. The unit-wise Fisher is block diagonal
over the channels: each channel's ``2 x 2`` Fisher of ``(gamma_c, beta_c)`` from the per-example gradients

    u_{i,c} = c [ sum_p g_{i,c,p} xhat_{i,c,p},  sum_p g_{i,c,p} ]

(``g`` the output gradient, ``xhat`` the normalized input, ``p`` the example's positions, ``c`` as for the factors),
``F_c = (1/B) sum_i u_{i,c} u_{i,c}^T``, damped and inverted in closed form:
``P(g)_c = (F_c + damping I)^-1 g_c``. With a frozen ``beta`` the blocks are ``1 x 1``. The equations are in
docs/conventions.md, "Unit-wise BatchNorm".
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..layers.base import LayerAdapter
from .block import CurvatureBlock
from .decomposition import Decomposition, Shape, State
from .factors import RunningAverage
from .numerics import compute_dtype, curvature_floor, floor_damping


class UnitFisher(RunningAverage):
    """Running average of each channel's ``k x k`` Fisher over ``(gamma, beta)``: ``channels x k x k``."""

    def __init__(self, channels: int, size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__((channels, size, size), dtype)

    def accumulate(self, normalized: torch.Tensor, grad: torch.Tensor, examples: int, scale: Any) -> None:
        """Add one micro-batch: ``(scale^2 / B) sum_i u_i u_i^T`` per channel over its ``B = examples`` examples,
        ``u_i`` example ``i``'s gradient of ``(gamma, beta)`` (``normalized`` and ``grad``: ``B x C x positions``)."""
        channels, size = self.shape[0], self.shape[1]
        dtype = compute_dtype(self.dtype)
        g = grad.detach().to(dtype).reshape(examples, channels, -1)
        x = normalized.to(dtype).reshape(examples, channels, -1)
        u = torch.stack([(g * x).sum(-1), g.sum(-1)][:size], dim=-1)  # B x C x k
        self.add(torch.einsum("bci,bcj->cij", u, u).mul_(scale * scale / examples))


def _solve(f: torch.Tensor, grad: torch.Tensor, damping: Any) -> torch.Tensor:
    """``(F_c + damping I)^-1 g_c`` for every channel, in closed form (``k = 1`` or ``2``): ``f`` is ``... x C x k x k``,
    ``grad`` ``... x C x k``."""
    if f.shape[-1] == 1:
        return grad / (f[..., 0] + damping)
    a, b, c, d = f[..., 0, 0] + damping, f[..., 0, 1], f[..., 1, 0], f[..., 1, 1] + damping
    det = a * d - b * c
    g0, g1 = grad[..., 0], grad[..., 1]
    return torch.stack([(d * g0 - b * g1) / det, (a * g1 - c * g0) / det], dim=-1)


class UnitWiseInverse(Decomposition):
    """The state is the channels' Fisher blocks ``F`` (``C x k x k``) in ``inv_dtype``; preconditioning damps and
    inverts them in closed form with the damping of the current step. With ``relative_damping`` the damping is
    ``damping * mean_c(tr F_c / k)``, the layer's mean curvature (a layer below :func:`curvature_floor` of it is
    passed through, as a Kronecker block without usable curvature)."""

    name = "unit-wise"
    colocated = True

    def side_shapes(self, a_dim: int, g_dim: int) -> tuple[list[Shape], list[Shape]]:
        return [(g_dim, a_dim, a_dim)], []

    def compute(
        self, a: Optional[torch.Tensor], g: Optional[torch.Tensor], damping: float, dtype: torch.dtype
    ) -> tuple[Optional[State], Optional[State]]:
        """``a``: the Fisher blocks, kept as they are (in ``dtype``); there is no ``g``."""
        return (a.to(dtype, copy=True),), None

    def _mean_curvature(self, f: torch.Tensor) -> torch.Tensor:
        return f.diagonal(dim1=-2, dim2=-1).mean(dim=(-2, -1))

    def uncurved(self, state: State) -> Optional[torch.Tensor]:
        if not self.relative_damping:
            return None
        mean = self._mean_curvature(state[0])
        return mean < curvature_floor(mean.dtype)

    def precondition(
        self,
        state: State,
        grad: torch.Tensor,
        damping: float,
        cached: Optional[torch.Tensor] = None,
        scaling: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        (f,) = state
        if self.relative_damping:
            damping = floor_damping(self._mean_curvature(f) * damping)[..., None]
        return _solve(f, grad.to(f.dtype), damping)


class UnitWiseBlock(CurvatureBlock):
    """A BatchNorm layer's per-channel Fisher over ``(gamma, beta)`` (one side, ``F``) and its state."""

    sides = ("F",)

    def __init__(
        self,
        name: str,
        adapter: LayerAdapter,
        method: UnitWiseInverse,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(name, adapter, method, inv_dtype)
        self.f = UnitFisher(adapter.g_dim, adapter.a_dim, factor_dtype)

    def statistics(self) -> dict[str, RunningAverage]:
        return {"F": self.f}

    def forward_statistic(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized input (with the batch's statistics, as the layer computes it in training)."""
        return self.adapter.input_rows(x)

    def backward_statistic(self, pending: torch.Tensor, grad: torch.Tensor, examples: int, scale: Any) -> None:
        self.f.accumulate(pending, self.adapter.output_grad_rows(grad), examples, scale)

    def side_shapes(self) -> dict[str, list[Shape]]:
        (shapes, _) = self.method.side_shapes(self.adapter.a_dim, self.adapter.g_dim)
        return {"F": shapes}

    def compute_sides(
        self, values: dict[str, Optional[torch.Tensor]], damping: float, dtype: torch.dtype
    ) -> dict[str, Optional[State]]:
        state, _ = self.method.compute(values["F"], None, damping, dtype)
        return {"F": state}

    def costs(self, power: int) -> tuple[float, ...]:
        return (self.adapter.g_dim * float(self.adapter.a_dim) ** power,)
