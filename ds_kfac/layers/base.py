"""How K-FAC sees one module type.

A :class:`LayerAdapter` turns a module's input into the rows ``a_r`` of the
activation factor and its output gradient into the rows ``g_r`` of the
gradient factor, and converts between the module's parameter gradients and
the ``d_out x (d_in [+1])`` matrix that K-FAC preconditions. Adapters are pure
functions of tensors: they never read ``.grad`` themselves, so the same code
serves plain PyTorch, DeepSpeed and ZeRO-partitioned gradients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch
from torch import nn


def param_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's logical shape: ``ds_shape`` under ZeRO stage 3 (``param`` is then an empty
    placeholder between uses, its ``shape`` that of the placeholder), else ``param.shape``."""
    return getattr(param, "ds_shape", param.shape)


class UnsupportedLayerError(ValueError):
    """A module that matches a registered type but that K-FAC cannot handle exactly."""


class LayerAdapter(ABC):
    """K-FAC's view of one module: factor rows and gradient matrix layout."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        bias = getattr(module, "bias", None)
        self.has_bias = bias is not None and bias.requires_grad
        """Whether the bias is preconditioned, decided at registration. A frozen bias is absent to K-FAC (no
        column in ``A``, nothing in the gradient matrix): the weight's curvature block is the same without it."""

    @property
    @abstractmethod
    def a_dim(self) -> int:
        """Size of the activation factor ``A`` (input features, +1 with a trainable bias)."""

    @property
    @abstractmethod
    def g_dim(self) -> int:
        """Size of the gradient factor ``G`` (output features)."""

    def batch_size(self, x: torch.Tensor) -> int:
        """Micro-batch size ``B`` of one input (dim 0; 1 for an unbatched input)."""
        return x.shape[0] if x.dim() > 1 else 1

    def output_of(self, output: Any) -> Optional[torch.Tensor]:
        """The tensor of the module's output whose gradient gives the rows of ``G`` (the output itself)."""
        return output if isinstance(output, torch.Tensor) else None

    @abstractmethod
    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``a_r`` (``n x in_features``, without the bias column) of one input."""

    @abstractmethod
    def output_grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Rows ``g_r`` (``n x g_dim``) of one output gradient, in the order of :meth:`input_rows`."""

    def params(self) -> list[nn.Parameter]:
        """The parameters whose gradient this layer preconditions: weight, then bias (unless frozen)."""
        return [self.module.weight] + ([self.module.bias] if self.has_bias else [])

    def grad_to_matrix(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Gradients shaped like :meth:`params` as one ``g_dim x a_dim`` matrix."""
        w = grads[0].reshape(self.g_dim, -1)
        return torch.cat([w, grads[1].reshape(-1, 1)], dim=1) if self.has_bias else w

    def matrix_to_grads(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``g_dim x a_dim`` matrix back into tensors shaped like :meth:`params`."""
        weight = param_shape(self.module.weight)
        if not self.has_bias:
            return [matrix.reshape(weight)]
        return [matrix[:, :-1].reshape(weight), matrix[:, -1].reshape(param_shape(self.module.bias))]

    def describe(self) -> str:
        return f"{type(self.module).__name__}(A {self.a_dim}x{self.a_dim}, G {self.g_dim}x{self.g_dim})"
