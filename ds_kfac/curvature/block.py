"""A curvature block: the Kronecker-factored curvature of one layer.

The block owns the layer's two factors and its current decomposition. It
knows nothing about hooks, ranks or optimizers: the preconditioner feeds it
rows, the communication layer moves its tensors, and it turns a gradient
matrix into a preconditioned one.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..layers.base import LayerAdapter
from .decomposition import Decomposition, State
from .factors import KroneckerFactor


class KFACBlock:
    """Factors ``A`` (``a_dim``) and ``G`` (``g_dim``) of one layer and their decomposition."""

    def __init__(
        self,
        name: str,
        adapter: LayerAdapter,
        method: Decomposition,
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.name = name
        self.adapter = adapter
        self.method = method
        self.inv_dtype = inv_dtype
        self.a = KroneckerFactor(adapter.a_dim, factor_dtype)
        self.g = KroneckerFactor(adapter.g_dim, factor_dtype)
        self.state: Optional[State] = None

    def precondition(self, grad: torch.Tensor, damping: float, graft: bool = False) -> torch.Tensor:
        """``P(grad)`` in the decomposition's dtype; the gradient itself before the first decomposition.

        With ``graft``, ``P(grad)`` is rescaled to the L2 norm of ``grad`` (layer-wise norm
        grafting): K-FAC chooses the direction, the gradient keeps its magnitude."""
        if self.state is None:
            return grad.to(self.inv_dtype)
        out = self.method.precondition(self.state, grad, damping)
        if graft:
            norm = out.norm()
            out.mul_(grad.to(out.dtype).norm() / norm.clamp(min=torch.finfo(norm.dtype).tiny))
        return out


def blocks_device(blocks: Iterable[KFACBlock]) -> torch.device:
    """The device of the first block's layer (CPU with no blocks): where per-layer flags live."""
    first = next(iter(blocks), None)
    return first.adapter.module.weight.device if first is not None else torch.device("cpu")
