"""Where each layer's reduced gradient lies on this rank, and who preconditions it.

At the optimizer step every rank holds some *fragments* of the averaged
gradient: all of ``p.grad`` in plain data parallelism and ZeRO stage 0
(replicated), or only its own partition under ZeRO stages 1 and 2 (sharded).
A :class:`GradientLayout` turns those fragments into whole gradient matrices
for the layers this rank preconditions, and writes the results back into the
same storage, so the base optimizer (or ZeRO's partitioned step) sees them.

Sharded layouts precondition a layer where its gradient lies: a layer whose
parameters all lie in this rank's partition is preconditioned by this rank
alone, with no communication. Only layers that ZeRO split across ranks are
assembled, in one bucketed all-reduce of just those layers, and each holder
writes back its own fragment. The KL-clip sum ``sum(P(g) * g)`` is computed
over the fragments each rank holds and summed with one scalar all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce_sum_
from ..curvature import KFACBlock, blocks_device


@dataclass
class Fragment:
    """Elements ``[start, start + numel)`` of a parameter's reduced gradient in row-major order, held here as
    ``grad``: a flat slice (a ZeRO partition) or the whole gradient in the parameter's shape, in whatever
    memory layout it has (e.g. ``channels_last``). Read and written through :meth:`flat` and :meth:`store`,
    which never assume a contiguous layout."""

    start: int
    numel: int
    grad: torch.Tensor

    def covers(self, param: nn.Parameter) -> bool:
        return self.start == 0 and self.numel == param.numel()

    def flat(self) -> torch.Tensor:
        """The held elements in row-major order (a copy when the layout is not row-major)."""
        return self.grad.reshape(-1)

    def store(self, values: torch.Tensor) -> None:
        """Write ``numel`` row-major values into ``grad`` itself (the storage the optimizer reads), in its dtype."""
        self.grad.copy_(values.reshape(self.grad.shape))


FragmentOf = Callable[[nn.Parameter], Optional[Fragment]]


def whole_grad(param: nn.Parameter) -> Optional[Fragment]:
    """The replicated case: all of ``param.grad``, as it lies (``None`` if the parameter got no gradient)."""
    if param.grad is None:
        return None
    return Fragment(0, param.numel(), param.grad)


class GradientLayout:
    """Gather, score and write back the gradient matrices this rank preconditions.

    Args:
        fragment_of: this rank's fragment of a parameter's reduced gradient, or ``None``.
        group: data-parallel group; only used when ``sharded``.
        sharded: whether ranks hold disjoint fragments (ZeRO 1/2) rather than copies.
        grad_scale: the factor the stored gradients carry (the fp16 loss scale under ZeRO).
    """

    def __init__(
        self,
        fragment_of: FragmentOf = whole_grad,
        group: Optional[dist.ProcessGroup] = None,
        sharded: bool = False,
        grad_scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.fragment_of = fragment_of
        self.group = group
        self.sharded = sharded
        self.grad_scale = grad_scale
        self._split: Optional[list[bool]] = None

    def has_gradients(self, blocks: Sequence[KFACBlock]) -> bool:
        """Whether this rank holds a gradient for any of the blocks' parameters (no communication)."""
        return any(self.fragment_of(p) is not None for b in blocks for p in b.adapter.params())

    def split_blocks(self, blocks: Sequence[KFACBlock]) -> list[bool]:
        """Per block, whether no single rank holds all of its gradient (agreed on by all ranks, computed once)."""
        if self._split is None:
            whole_here = [self._whole_here(b) for b in blocks]
            if self.sharded:
                holders = torch.tensor(whole_here, dtype=torch.int32, device=blocks_device(blocks))
                all_reduce_sum_([holders], self.group)
                whole_here = [int(h) > 0 for h in holders.tolist()]
            self._split = [not w for w in whole_here]
        return self._split

    def _whole_here(self, block: KFACBlock, frags: Optional[Sequence[Optional[Fragment]]] = None) -> bool:
        """Whether this rank's fragments cover all of the layer's gradient."""
        params = block.adapter.params()
        frags = [self.fragment_of(p) for p in params] if frags is None else frags
        return all(f is not None and f.covers(p) for f, p in zip(frags, params))

    def gather(
        self, blocks: Sequence[KFACBlock]
    ) -> tuple[list[KFACBlock], list[torch.Tensor], list[list[Optional[Fragment]]]]:
        """The blocks this rank preconditions, their whole gradient matrices and this rank's fragments."""
        split = self.split_blocks(blocks) if self.sharded else [False] * len(blocks)
        frags = [[self.fragment_of(p) for p in b.adapter.params()] for b in blocks]
        assembled = self._assemble([b for b, s in zip(blocks, split) if s], [f for f, s in zip(frags, split) if s])
        chosen, matrices, fragments = [], [], []
        for block, block_frags, is_split in zip(blocks, frags, split):
            if is_split:
                if all(f is None for f in block_frags):
                    continue
                grads = assembled[block.name]
            else:
                if not self._whole_here(block, block_frags):
                    continue
                grads = [f.grad.reshape(p.shape) for f, p in zip(block_frags, block.adapter.params())]
            chosen.append(block)
            matrices.append(block.adapter.grad_to_matrix(grads))
            fragments.append(block_frags)
        return chosen, matrices, fragments

    def _assemble(
        self, blocks: Sequence[KFACBlock], frags: Sequence[Sequence[Optional[Fragment]]]
    ) -> dict[str, list[torch.Tensor]]:
        """Whole fp32 gradients of split blocks: each rank adds its fragments into zeros, then one all-reduce."""
        if not blocks:
            return {}
        buffers = [
            [torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in b.adapter.params()] for b in blocks
        ]
        for block_bufs, block_frags in zip(buffers, frags):
            for buf, f in zip(block_bufs, block_frags):
                if f is not None:
                    buf[f.start : f.start + f.numel] = f.flat()
        all_reduce_sum_([buf for block_bufs in buffers for buf in block_bufs], self.group)
        return {
            b.name: [buf.view_as(p) for buf, p in zip(block_bufs, b.adapter.params())]
            for b, block_bufs in zip(blocks, buffers)
        }

    def dot(
        self,
        blocks: Sequence[KFACBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        precond: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """This rank's part of ``sum over layers of sum(P(g) * g)``: over the fragments it
        holds, so that summed over ranks every element counts once when sharded."""
        parts = []
        for block, block_frags, p, g in zip(blocks, fragments, precond, grads):
            if self._whole_here(block, block_frags):  # the whole matrices, without slicing out (copying) the weight
                parts.append(torch.dot(p.reshape(-1), g.to(p.dtype).reshape(-1)))
                continue
            pieces = zip(block.adapter.matrix_to_grads(p), block.adapter.matrix_to_grads(g.to(p.dtype)), block_frags)
            for p_param, g_param, f in pieces:
                if f is not None:
                    held = slice(f.start, f.start + f.numel)
                    parts.append((p_param.reshape(-1)[held] * g_param.reshape(-1)[held]).sum())
        return torch.stack(parts).sum() if parts else torch.zeros((), device=blocks_device(blocks))

    def write(
        self,
        blocks: Sequence[KFACBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        matrices: Sequence[torch.Tensor],
    ) -> None:
        """Write each matrix's elements back into the fragments this rank holds."""
        for block, block_frags, m in zip(blocks, fragments, matrices):
            for new, f in zip(block.adapter.matrix_to_grads(m), block_frags):
                if f is not None:
                    f.store(new.reshape(-1)[f.start : f.start + f.numel])
