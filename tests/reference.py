"""Independent float64 K-FAC references: explicit rows, explicit Kronecker products.

Nothing here uses ds_kfac; conv patches are cut out with plain loops rather
than ``unfold``, so a bug in the library's layer code cannot hide in both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def linear_rows(x: torch.Tensor, bias: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).double()
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1) if bias else rows


def conv_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """One row per (batch, out_y, out_x): the dilated, strided, zero-padded input patch."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    xp = F.pad(x.double(), (pw, pw, ph, ph))
    out_h = (x.shape[2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for b in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                patch = xp[b, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh, j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                row = patch.reshape(-1)
                rows.append(torch.cat([row, row.new_ones(1)]) if conv.bias is not None else row)
    return torch.stack(rows)


def output_grad_rows(grad_out: torch.Tensor, conv: bool) -> torch.Tensor:
    g = grad_out.double()
    return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) if conv else g.reshape(-1, g.shape[-1])


def second_moment(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    r = rows * scale
    return r.t() @ r / rows.shape[0]


def vec(m: torch.Tensor) -> torch.Tensor:
    """Column-major vectorisation, so that vec(G M A) = kron(A, G) vec(M) for symmetric A."""
    return m.t().reshape(-1)


def unvec(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return v.reshape(cols, rows).t()


def precondition_eigen(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(A (x) G + damping I)^-1 vec(grad), solved with the explicit Kronecker product."""
    k = torch.kron(a, g)
    sol = torch.linalg.solve(k + damping * torch.eye(k.shape[0], dtype=k.dtype), vec(grad))
    return unvec(sol, *grad.shape)


def precondition_inverse(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """((A + pi sqrt(d) I) (x) (G + sqrt(d)/pi I))^-1 vec(grad)."""
    pi = math.sqrt((torch.trace(a) / a.shape[0]) / (torch.trace(g) / g.shape[0]))
    root = math.sqrt(damping)
    ad = a + pi * root * torch.eye(a.shape[0], dtype=a.dtype)
    gd = g + root / pi * torch.eye(g.shape[0], dtype=g.dtype)
    sol = torch.linalg.solve(torch.kron(ad, gd), vec(grad))
    return unvec(sol, *grad.shape)


def mean_eigenvalue(f: torch.Tensor) -> float:
    return (torch.trace(f) / f.shape[0]).item()


def precondition_relative(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(A (x) G + damping * mean eig(A) * mean eig(G) I)^-1 vec(grad): damping relative to the block's curvature."""
    return precondition_eigen(a, g, grad, damping * mean_eigenvalue(a) * mean_eigenvalue(g))


def precondition_inverse_relative(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """((A + sqrt(d) mean eig(A) I) (x) (G + sqrt(d) mean eig(G) I))^-1 vec(grad)."""
    root = math.sqrt(damping)
    ad = a + root * mean_eigenvalue(a) * torch.eye(a.shape[0], dtype=a.dtype)
    gd = g + root * mean_eigenvalue(g) * torch.eye(g.shape[0], dtype=g.dtype)
    sol = torch.linalg.solve(torch.kron(ad, gd), vec(grad))
    return unvec(sol, *grad.shape)


def per_example_gradients(layer: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn) -> torch.Tensor:
    """``B x d_out x (d_in [+1])``: each example's gradient matrix of its own loss, by one backward per example
    (``loss_fn`` a mean over elements, so the batch gradient is the mean of these)."""
    grads = []
    for i in range(x.shape[0]):
        layer.zero_grad()
        loss_fn(layer(x[i : i + 1].double()), target[i : i + 1].double()).backward()
        g = layer.weight.grad.reshape(layer.weight.shape[0], -1)
        grads.append(torch.cat([g, layer.bias.grad.reshape(-1, 1)], 1) if layer.bias is not None else g.clone())
    layer.zero_grad()
    return torch.stack(grads)


def eigenbasis(f: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(f).eigenvectors


def corrected_scaling(qa: torch.Tensor, qg: torch.Tensor, per_example: torch.Tensor) -> torch.Tensor:
    """``S = mean_i (Q_G^T g_i Q_A)^2``, one example at a time."""
    return torch.stack([(qg.t() @ g @ qa) ** 2 for g in per_example]).mean(0)


def rebased(s: torch.Tensor, old: tuple, new: tuple) -> torch.Tensor:
    """``S`` re-projected: entry (i, j) is ``sum_kl (qg_new_i . qg_old_k)^2 (qa_new_j . qa_old_l)^2 S[k, l]``."""
    (old_a, old_g), (new_a, new_g) = old, new
    out = torch.zeros_like(s)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            weights = torch.outer((new_g[:, i] @ old_g) ** 2, (new_a[:, j] @ old_a) ** 2)
            out[i, j] = (weights * s).sum()
    return out


def precondition_corrected(
    qa: torch.Tensor, qg: torch.Tensor, s: torch.Tensor, grad: torch.Tensor, damping: float
) -> torch.Tensor:
    """``Q_G [(Q_G^T grad Q_A) / (S + damping)] Q_A^T``."""
    return qg @ ((qg.t() @ grad @ qa) / (s + damping)) @ qa.t()
