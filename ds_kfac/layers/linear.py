"""``nn.Linear`` with any number of leading dimensions (batch, sequence, ...)."""

from __future__ import annotations

import torch
from torch import nn

from .base import LayerAdapter


class LinearAdapter(LayerAdapter):
    """Rows are the input vectors at every leading index: ``n = prod(x.shape[:-1])``."""

    module: nn.Linear

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    def output_grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])
