"""A Gauss-Newton oracle: the damped Gauss-Newton step of a batch, solved matrix-free, for the whole model and layer
by layer (block-diagonal), and the quadratic model that scores any other update against it.

K-FAC approximates the layerwise (block-diagonal) Gauss-Newton matrix of a batch by Kronecker products of running
factor averages. This module computes what it approximates, exactly, for a model whose outputs feed a cross-entropy
loss (BERT's masked-LM and next-sentence heads, a classifier): the Gauss-Newton matrix ``G = J^T H J`` (``J`` the
outputs' Jacobian in the parameters, ``H`` the loss's Hessian in the outputs) times a vector by one forward-mode
pass (``J v``, :func:`torch.func.jvp`) and one backward pass (``J^T u``, through a ``torch.func.vjp`` made once per
batch), never forming ``G``; the step ``d = -(G + lambda I)^-1 g`` by conjugate gradient (:func:`conjugate_gradient`)
to a relative residual or an iteration cap; and the block-diagonal step, each block's system solved alone with
products restricted to it (one product per block per iteration: a layer count times the cost).

:func:`quadratic_report` scores an update ``u`` (K-FAC's, say) on the same batch by the quadratic model
``M(u) = g.u + u.(G + lambda I)u / 2``: the fraction of the oracle's reduction ``M(d)`` it achieves, split into its
direction (``M`` of ``u`` at its best scale, over ``M(d)``) and its scale (``M(u)`` over ``M`` at the best scale).

The model must be deterministic in the parameters (no dropout: evaluate the curvature in eval mode) and its ops
must have forward-mode derivatives (BERT with ``attn_implementation="eager"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

Outputs = tuple[Tensor, ...]
HessianProduct = Callable[[Outputs, Outputs], Outputs]


def cross_entropy_hessian(weights: tuple[Tensor, ...]) -> HessianProduct:
    """``H u`` for a sum of cross-entropies over softmaxes of the outputs' last dimension, ``weights[i]`` each
    position's weight in output ``i`` (1 / count where labelled, 0 where ignored): per position,
    ``w (p * u - p (p . u))`` with ``p`` the softmax."""

    def product(outputs: Outputs, tangents: Outputs) -> Outputs:
        out = []
        for logits, u, weight in zip(outputs, tangents, weights):
            p = torch.softmax(logits.detach(), dim=-1)
            out.append(weight.unsqueeze(-1) * (p * u - p * (p * u).sum(-1, keepdim=True)))
        return tuple(out)

    return product


class GaussNewton:
    """The Gauss-Newton matrix of ``f`` (parameters -> outputs) at ``params`` with the loss Hessian ``hessian``,
    as products with flat vectors (the parameters' order of ``params``)."""

    def __init__(self, f: Callable[[dict[str, Tensor]], Outputs], params: dict[str, Tensor], hessian: HessianProduct):
        self.f, self.params, self.hessian = f, {k: v.detach() for k, v in params.items()}, hessian
        self.names = list(self.params)
        self.outputs, self._pull = torch.func.vjp(f, self.params)
        self.products = 0

    def split(self, flat: Tensor) -> dict[str, Tensor]:
        out, start = {}, 0
        for name in self.names:
            param = self.params[name]
            out[name] = flat[start : start + param.numel()].view_as(param)
            start += param.numel()
        return out

    def flat(self, tensors: dict[str, Tensor]) -> Tensor:
        return torch.cat([tensors[name].reshape(-1) for name in self.names])

    def product(self, v: Tensor) -> Tensor:
        """``G v``: one forward-mode pass and one backward pass."""
        _, jv = torch.func.jvp(self.f, (self.params,), (self.split(v),))
        (pulled,) = self._pull(self.hessian(self.outputs, jv))
        self.products += 1
        return self.flat(pulled)

    def forms(self, vectors: list[Tensor]) -> Tensor:
        """The matrix ``V^T G V`` of ``vectors`` (``V``'s columns): one forward-mode pass each, no backward."""
        jvs = [torch.func.jvp(self.f, (self.params,), (self.split(v),))[1] for v in vectors]
        self.products += len(vectors)
        out = torch.empty(len(vectors), len(vectors), dtype=torch.float64)
        for i, ju in enumerate(jvs):
            hu = self.hessian(self.outputs, ju)
            for j in range(i, len(vectors)):
                out[i, j] = out[j, i] = sum(float((a * b).sum()) for a, b in zip(hu, jvs[j]))
        return out

    def blocks(self, groups: list[list[str]]) -> list[Tensor]:
        """Each group's positions in the flat vector (a block of the block-diagonal matrix)."""
        offsets, start = {}, 0
        for name in self.names:
            offsets[name] = (start, start + self.params[name].numel())
            start += self.params[name].numel()
        return [torch.cat([torch.arange(*offsets[name]) for name in group]) for group in groups]


@dataclass(frozen=True)
class Solved:
    """A conjugate-gradient solve: the solution, its iterations and its final relative residual."""

    x: Tensor
    iterations: int
    residual: float


def conjugate_gradient(
    apply: Callable[[Tensor], Tensor], b: Tensor, damping: float, iterations: int, tolerance: float,
    x0: Optional[Tensor] = None,
) -> Solved:  # fmt: skip
    """``x`` with ``(A + damping I) x = b`` (``apply``: ``A v``, symmetric positive semi-definite), from ``x0``
    (zero), until ``|r| <= tolerance |b|`` or ``iterations`` products."""
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - (apply(x) + damping * x) if x0 is not None else b.clone()
    p, rr, norm_b = r.clone(), r.dot(r), b.norm()
    done = 0
    while done < iterations and rr.sqrt() > tolerance * norm_b:
        ap = apply(p) + damping * p
        alpha = rr / p.dot(ap)
        x, r = x + alpha * p, r - alpha * ap
        rr, previous = r.dot(r), rr
        p = r + (rr / previous) * p
        done += 1
    return Solved(x, done, float(rr.sqrt() / norm_b))


def gauss_newton_step(
    curvature: GaussNewton, gradient: Tensor, damping: float, iterations: int, tolerance: float,
    groups: Optional[list[list[str]]] = None,
) -> tuple[Tensor, list[Solved]]:  # fmt: skip
    """``-(G + damping I)^-1 g`` for the whole model, or, with ``groups``, for each block of the block-diagonal
    ``G`` alone (its products restricted to the block)."""
    if groups is None:
        solved = conjugate_gradient(curvature.product, -gradient, damping, iterations, tolerance)
        return solved.x, [solved]
    step, solves = torch.zeros_like(gradient), []
    for index in curvature.blocks(groups):

        def apply(v: Tensor, index: Tensor = index) -> Tensor:
            full = torch.zeros_like(gradient)
            full[index] = v
            return curvature.product(full)[index]

        solved = conjugate_gradient(apply, -gradient[index], damping, iterations, tolerance)
        step[index] = solved.x
        solves.append(solved)
    return step, solves


def quadratic_model(curvature: GaussNewton, gradient: Tensor, damping: float, update: Tensor) -> float:
    """``M(u) = g.u + u.(G + damping I)u / 2``: the batch's loss change the damped quadratic model predicts."""
    return float(gradient.dot(update) + 0.5 * update.dot(curvature.product(update) + damping * update))


def rescaled(
    curvature: GaussNewton, gradient: Tensor, damping: float, update: Tensor, previous: Optional[Tensor],
    max_scale: float,
) -> tuple[float, float]:  # fmt: skip
    """Martens and Grosse's choice (K-FAC, sections 6.4 and 7): the ``(alpha, mu)`` minimizing the damped quadratic
    model ``M(alpha u + mu p)`` of the proposed ``update`` ``u`` and the ``previous`` step ``p`` (``mu = 0`` without
    one), solved as the 2 x 2 (or 1 x 1) system of ``V^T (G + damping I) V``. ``alpha`` is clipped to
    ``[0, max_scale]``; a system that is not positive definite, or a slope that is not downhill, keeps ``(1, 0)``."""
    vectors = [update] if previous is None else [update, previous]
    matrix = curvature.forms(vectors) + damping * torch.tensor([[a.dot(b).item() for b in vectors] for a in vectors],
                                                               dtype=torch.float64)  # fmt: skip
    slopes = torch.tensor([float(gradient.dot(v)) for v in vectors], dtype=torch.float64)
    if slopes[0] >= 0 or torch.linalg.eigvalsh(matrix).min() <= 0:
        return 1.0, 0.0
    solution = torch.linalg.solve(matrix, -slopes)
    alpha = min(max(float(solution[0]), 0.0), max_scale)
    return alpha, float(solution[1]) if previous is not None else 0.0


def quadratic_report(
    curvature: GaussNewton, gradient: Tensor, damping: float, update: Tensor, oracle: Tensor
) -> dict[str, float]:
    """How much of the oracle step's model reduction ``update`` achieves, and why: its direction (at its best
    scale ``alpha``) and its scale."""
    best = quadratic_model(curvature, gradient, damping, oracle)
    curve = float(update.dot(curvature.product(update) + damping * update))
    slope = float(gradient.dot(update))
    alpha = -slope / curve
    scaled = -(slope**2) / (2 * curve)
    mine = slope + 0.5 * curve
    return {
        "fraction": mine / best,
        "direction": scaled / best,
        "scale": mine / scaled if scaled else float("nan"),
        "best_scale": alpha,
        "oracle_reduction": best,
    }
