"""Linear layers whose weight is split over a tensor-parallel group (Megatron's column- and row-parallel layers).

A *column-parallel* layer splits the output features: rank ``r`` of the group holds rows
``[r o/t, (r+1) o/t)`` of the weight and of the bias, and sees the whole input. A *row-parallel* layer
splits the input features: rank ``r`` holds columns ``[r i/t, (r+1) i/t)`` of the weight and sees that
part of the input; its bias is whole and replicated (added after the outputs are summed).

``tensor_parallel_factors`` chooses K-FAC's view (``docs/conventions.md``):

* ``"exact"``: the K-FAC of the unsharded layer. One rank of the group, the layer's *owner*, holds the
  whole factors: the sharded side's rows (column: output gradients, row: inputs) are gathered to it at
  factor-update steps (:meth:`input_rows` and :meth:`output_grad_rows` are collective over the group,
  and return ``None`` on the other ranks); the replicated side is computed from its own rows. The whole
  gradient matrix is assembled on the owner and each rank's slice sent back by
  :class:`ds_kfac.placement.TensorParallelGradients` through :meth:`local_matrix`, :meth:`assemble`,
  :meth:`split` and :meth:`local_grads`.
* ``"shard"``: each rank's shard is an independent layer (block-diagonal K-FAC over the shards), with no
  tensor-parallel communication. A row-parallel layer's replicated bias is then left to the base
  optimizer (its gradient is the same on every rank, so it stays the same).

Subclasses (:mod:`ds_kfac.integration.megatron`) say where the group and the full sizes are.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import gather_
from .base import LayerAdapter

TensorParallelFactors = Literal["exact", "shard"]


class TensorParallelAdapter(LayerAdapter):
    """A weight split along its output (``partition = "output"``) or input (``"input"``) features."""

    partition: Literal["output", "input"]

    def __init__(self, module: nn.Module, tensor_parallel_factors: TensorParallelFactors = "exact") -> None:
        super().__init__(module)
        self.exact = tensor_parallel_factors == "exact"
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.owner = 0
        """The group rank holding the whole factors and gradient (``exact``), set by the placement."""
        if self.partition == "input" and not self.exact:
            self.has_bias = False  # the replicated bias of a row-parallel shard: the base optimizer's alone

    @property
    @abstractmethod
    def group(self) -> dist.ProcessGroup:
        """The tensor-parallel group the weight is split over."""

    @property
    @abstractmethod
    def in_features(self) -> int:
        """Input features of the unsharded layer."""

    @property
    @abstractmethod
    def out_features(self) -> int:
        """Output features of the unsharded layer."""

    def _local(self, features: int, split: bool) -> int:
        return features // self.size if split else features

    @property
    def a_dim(self) -> int:
        split = self.partition == "input" and not self.exact
        return self._local(self.in_features, split) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self._local(self.out_features, self.partition == "output" and not self.exact)

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    def output_of(self, output: tuple) -> torch.Tensor:
        """Megatron's layers return ``(output, bias)``; the bias may be added by the caller (``skip_bias_add``),
        which leaves the output's gradient, and so ``G``, unchanged."""
        return output[0]

    def input_rows(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])
        return self._gathered(rows) if self.exact and self.partition == "input" else rows

    def output_grad_rows(self, grad_output: torch.Tensor) -> Optional[torch.Tensor]:
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        return self._gathered(rows) if self.exact and self.partition == "output" else rows

    def _gathered(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole layer's rows on the owner (the shards' features side by side); ``None`` elsewhere."""
        pieces = gather_(rows, self.owner, self.group)
        return None if pieces is None else torch.cat(pieces, dim=1)

    # ------------------------------------------------- the gradient (exact)
    def local_matrix(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's piece of the gradient matrix: its weight shard, with its bias as the last column."""
        w = grads[0].reshape(grads[0].shape[0], -1)
        return torch.cat([w, grads[1].reshape(-1, 1)], dim=1) if self.has_bias else w

    def assemble(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole ``g_dim x a_dim`` matrix of every rank's :meth:`local_matrix` (group-rank order)."""
        if self.partition == "output":
            return torch.cat(list(pieces), dim=0)
        if not self.has_bias:
            return torch.cat(list(pieces), dim=1)
        return torch.cat([p[:, :-1] for p in pieces] + [pieces[self.rank][:, -1:]], dim=1)  # bias: replicated

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`assemble`: each rank's piece (a row-parallel bias goes to every rank)."""
        if self.partition == "output":
            return list(matrix.chunk(self.size, dim=0))
        if not self.has_bias:
            return list(matrix.chunk(self.size, dim=1))
        return [torch.cat([w, matrix[:, -1:]], dim=1) for w in matrix[:, :-1].chunk(self.size, dim=1)]

    def local_grads(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """A :meth:`local_matrix` piece as tensors shaped like :meth:`params`."""
        params = self.params()
        if not self.has_bias:
            return [piece.reshape(params[0].shape)]
        return [piece[:, :-1].reshape(params[0].shape), piece[:, -1].reshape(params[1].shape)]

    def describe(self) -> str:
        mode = "exact" if self.exact else "shard"
        return f"{super().describe()} [{self.partition}-parallel over {self.size} ranks, {mode}]"
