"""``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` with affine parameters, for the unit-wise natural gradient
(``"batchnorm": "unit-wise"``, :mod:`ds_kfac.curvature.unitwise`)."""

from __future__ import annotations

import torch
from torch import nn

from .base import LayerAdapter


class BatchNormAdapter(LayerAdapter):
    """The gradient matrix is ``C x k``: each channel's ``gamma`` gradient, then (unless frozen) its ``beta``
    gradient (``a_dim = k``, ``g_dim = C``). The "rows" are per example, channel and position (``B x C x P``):
    :meth:`input_rows` the normalized input, :meth:`output_grad_rows` the output gradient."""

    module: nn.modules.batchnorm._BatchNorm

    @property
    def a_dim(self) -> int:
        return 1 + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.num_features

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``xhat = (x - mean) / sqrt(var + eps)`` with the batch's per-channel mean and biased variance (as the
        layer normalizes in training), ``B x C x P``, detached."""
        x = x.detach()
        x = x.reshape(x.shape[0], x.shape[1], -1).to(torch.promote_types(x.dtype, torch.float32))
        var, mean = torch.var_mean(x, dim=(0, 2), correction=0, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.module.eps)

    def output_grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(grad_output.shape[0], grad_output.shape[1], -1)

    def describe(self) -> str:
        return f"{type(self.module).__name__}({self.g_dim} channels, unit-wise {self.a_dim}x{self.a_dim})"
