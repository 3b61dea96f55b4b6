"""``nn.Conv2d`` through input patches (stride, padding, dilation): K-FAC-expand or K-FAC-reduce."""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerAdapter, UnsupportedLayerError


class Conv2dAdapter(LayerAdapter):
    """With ``conv_factors="expand"`` rows are the ``C_in*kh*kw`` input patches and
    the ``C_out`` output gradients at every output position: ``n = B * H_out * W_out``.
    With ``"reduce"`` (K-FAC-reduce, Eschenhagen et al. 2023) there is one row per
    example: the mean of its patches over the ``R = H_out * W_out`` positions and
    the sum of its output gradients over them, ``n = B``. Grouped convolutions and
    non-zero padding modes are refused at registration: their curvature is not one
    Kronecker product of these factors."""

    module: nn.Conv2d

    def __init__(self, module: nn.Conv2d, conv_factors: Literal["expand", "reduce"] = "expand") -> None:
        super().__init__(module)
        if conv_factors not in ("expand", "reduce"):
            raise ValueError(f"conv_factors must be 'expand' or 'reduce', got {conv_factors!r}")
        self.reduce = conv_factors == "reduce"
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
        if self.reduce:
            return self._mean_patches(x)
        if any(self._pad):
            x = F.pad(x, self._pad)
        m = self.module
        patches = F.unfold(x, m.kernel_size, dilation=m.dilation, stride=m.stride)  # B x (C*kh*kw) x L
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def output_grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        g = grad_output if grad_output.dim() == 4 else grad_output.unsqueeze(0)
        if self.reduce:
            return g.sum(dim=(2, 3), dtype=_reduction_dtype(g))
        return g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])

    def _mean_patches(self, x: torch.Tensor) -> torch.Tensor:
        """``B x C_in*kh*kw``: each example's patches averaged over the output positions, without unfold.

        The sum over positions of the patch entry at kernel offset ``(i, j)`` is the sum of
        the input over the rows that offset ``i`` visits and the columns offset ``j`` visits,
        so ``S = M_h X M_w^T`` per input channel ``X`` with 0/1 matrices ``M_h`` (``kh x H``) and ``M_w`` (``kw x W``):
        two GEMMs over all examples and channels at once, ``O(B C H W (kh + kw))``, instead of a
        ``C kh kw x B R`` patch matrix.
        """
        m, (left, right, top, bottom) = self.module, self._pad
        b, c, h, w = x.shape
        dtype = _reduction_dtype(x)
        rows, out_h = _visited(h, top, bottom, m.kernel_size[0], m.dilation[0], m.stride[0], dtype, x.device)
        cols, out_w = _visited(w, left, right, m.kernel_size[1], m.dilation[1], m.stride[1], dtype, x.device)
        kh, kw = rows.shape[0], cols.shape[0]
        by_column = x.to(dtype).reshape(b * c * h, w) @ cols.t()  # (B C H) x kw
        sums = by_column.view(b * c, h, kw).transpose(1, 2).reshape(b * c * kw, h) @ rows.t()  # (B C kw) x kh
        # B x C x kh x kw: unfold's column order.
        return sums.view(b, c, kw, kh).transpose(2, 3).reshape(b, -1).div_(out_h * out_w)


def _reduction_dtype(t: torch.Tensor) -> torch.dtype:
    """Sums over positions run in float32 or better: half-precision sums over R terms lose digits or overflow."""
    return torch.promote_types(t.dtype, torch.float32)


@functools.lru_cache(maxsize=256)
def _visited(
    size: int,
    pad_before: int,
    pad_after: int,
    kernel: int,
    dilation: int,
    stride: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """The ``kernel x size`` 0/1 matrix whose entry ``(k, y)`` is 1 when kernel offset ``k``
    reads input index ``y`` at some output position (reads of the zero padding add nothing),
    and the number of output positions along this dimension. Cached: a layer sees few input
    sizes, and the matrix is only read."""
    out = (size + pad_before + pad_after - dilation * (kernel - 1) - 1) // stride + 1
    offsets = torch.arange(kernel, device=device)[:, None] * dilation - pad_before
    read = offsets + stride * torch.arange(out, device=device)  # kernel x out input indices
    visited = torch.zeros(kernel, size + 1, dtype=dtype, device=device)
    # Reads of the padding go to a spare last column, dropped below; one offset never reads an index twice.
    visited.scatter_(1, torch.where((read >= 0) & (read < size), read, size), 1.0)
    return visited[:, :size], out
