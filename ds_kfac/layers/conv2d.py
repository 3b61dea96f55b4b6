"""``nn.Conv2d`` through unfolded input patches (stride, padding, dilation)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerAdapter, UnsupportedLayerError


class Conv2dAdapter(LayerAdapter):
    """Rows are the ``C_in*kh*kw`` input patches at every output position:
    ``n = B * H_out * W_out``. Grouped convolutions and non-zero padding modes
    are refused at registration: their curvature is not one Kronecker product
    of these factors."""

    module: nn.Conv2d

    def __init__(self, module: nn.Conv2d) -> None:
        super().__init__(module)
        if module.groups != 1:
            raise UnsupportedLayerError(f"Conv2d with groups={module.groups} is not supported (only groups=1)")
        if module.padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"Conv2d with padding_mode={module.padding_mode!r} is not supported (only 'zeros')"
            )
        self._pad = self._explicit_padding(module)

    @staticmethod
    def _explicit_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
        """(left, right, top, bottom) zero padding, resolving 'same' and 'valid'."""
        if module.padding == "valid":
            return (0, 0, 0, 0)
        if module.padding == "same":
            th, tw = (d * (k - 1) for d, k in zip(module.dilation, module.kernel_size))
            return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
        ph, pw = module.padding
        return (pw, pw, ph, ph)

    @property
    def a_dim(self) -> int:
        return self.module.in_channels * math.prod(self.module.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels

    def batch_size(self, x: torch.Tensor) -> int:
        return x.shape[0] if x.dim() == 4 else 1

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dim() == 4 else x.unsqueeze(0)
        if any(self._pad):
            x = F.pad(x, self._pad)
        m = self.module
        patches = F.unfold(x, m.kernel_size, dilation=m.dilation, stride=m.stride)  # B x (C*kh*kw) x L
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def output_grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        g = grad_output if grad_output.dim() == 4 else grad_output.unsqueeze(0)
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
