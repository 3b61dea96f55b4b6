"""Where each layer's reduced gradient lies on this rank, and who preconditions it.

At the optimizer step every rank holds some *fragments* of the averaged
gradient: all of ``p.grad`` in plain data parallelism and ZeRO stage 0
(replicated), or only its own partition under ZeRO (sharded). A
:class:`GradientLayout` is the one place that knows which: it is built once,
when the preconditioner (or the DeepSpeed engine) starts, and alone knows the
partitions, which ranks hold each layer's gradient and which layers are split
across ranks. It turns the fragments into whole gradient matrices for the
layers this rank preconditions, and writes the results back into the same
storage, so the base optimizer (or ZeRO's partitioned step) sees them.

Implementations, one per setup:

* :class:`WholeGradients`: each parameter's whole ``.grad`` (standalone, DDP,
  ZeRO stage 0);
* :class:`PartitionedGradients`: ranks hold disjoint fragments and
  precondition a layer where its gradient lies (ZeRO 1/2, in
  :mod:`ds_kfac.integration.layouts`): a layer whose parameters all lie in
  this rank's partition is preconditioned by this rank alone, with no
  communication; only layers that ZeRO split across ranks are assembled, in
  one bucketed all-reduce of just those layers, and each holder writes back
  its own fragment;
* ZeRO stage 3 (:mod:`ds_kfac.integration.layouts`): every layer is spread
  over all ranks; its slices are gathered to its one gradient worker and
  scattered back.

Sharded layouts compute the KL-clip sum ``sum(P(g) * g)`` so that, summed
over ranks with one scalar all-reduce, every element counts once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce_sum_, data_parallel_rank, data_parallel_world
from ..curvature import CurvatureBlock, blocks_device

Workers = Callable[[CurvatureBlock], tuple[int, ...]]
"""The data-parallel ranks that precondition a layer (its gradient workers under the placement plan)."""


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


def layer_holders(
    blocks: Sequence[CurvatureBlock], param_holders: Sequence[tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], list[bool]]:
    """Each layer's holders (the ranks whose partitions hold some of its gradient) and whether it is split (no rank
    is the only holder of every parameter: the partitions cover each gradient exactly once), from the ranks holding
    each parameter of ``blocks`` (in order, each block's ``adapter.params()``)."""
    holders, split, i = {}, [], 0
    for b in blocks:
        mine = param_holders[i : i + len(b.adapter.params())]
        i += len(mine)
        holders[b.name] = tuple(sorted({r for ranks in mine for r in ranks}))
        split.append(len(set(mine)) != 1 or len(mine[0]) != 1)
    return holders, split


Gathered = tuple[list[CurvatureBlock], list[Optional[torch.Tensor]], list[list[Optional[Fragment]]]]
"""What :meth:`GradientLayout.gather` returns: blocks, their whole gradient matrices (``None`` where this rank
does not precondition the block) and this rank's fragments of each."""


class GradientLayout(ABC):
    """Gather, score and write back the gradient matrices this rank preconditions.

    Args:
        grad_scale: the factor the stored gradients carry (the fp16 loss scale under ZeRO).
    """

    sharded: bool = False
    """Whether ranks hold disjoint fragments rather than copies (the KL-clip sum is then summed over ranks)."""
    group: Optional[dist.ProcessGroup] = None
    """The data-parallel group that sharded fragments are spread over."""

    def __init__(self, grad_scale: Callable[[], float] = lambda: 1.0) -> None:
        self.grad_scale = grad_scale

    @abstractmethod
    def fragment(self, param: nn.Parameter) -> Optional[Fragment]:
        """This rank's fragment of ``param``'s reduced gradient, or ``None``."""

    @abstractmethod
    def gather(self, blocks: Sequence[CurvatureBlock], workers: Workers) -> Gathered:
        """The blocks whose gradient this rank holds, their whole gradient matrices where it preconditions them,
        and its fragments. ``workers`` gives each layer's gradient workers (collective where fragments move)."""

    def block_holders(self, blocks: Sequence[CurvatureBlock]) -> Optional[dict[str, tuple[int, ...]]]:
        """The ranks whose partitions hold each layer's gradient, which then are its gradient workers when
        fewer than all ranks are (``None``: the placement plan chooses them freely)."""
        return None

    def counts(self, block: CurvatureBlock) -> bool:
        """Whether this rank's part of the KL-clip sum over the model-parallel group counts the layer (where
        several ranks of the group hold copies of it, one does)."""
        return True

    def has_gradients(self, blocks: Sequence[CurvatureBlock]) -> bool:
        """Whether this rank holds a gradient for any of the blocks' parameters (no communication)."""
        return any(self.fragment(p) is not None for b in blocks for p in b.adapter.params())

    def _whole_here(self, block: CurvatureBlock, frags: Optional[Sequence[Optional[Fragment]]] = None) -> bool:
        """Whether this rank's fragments cover all of the layer's gradient."""
        params = block.adapter.params()
        frags = [self.fragment(p) for p in params] if frags is None else frags
        return all(f is not None and f.covers(p) for f, p in zip(frags, params))

    def dot(
        self,
        blocks: Sequence[CurvatureBlock],
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

    def clip_by_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the reduced gradients of ``params`` in place by ``max_norm / (||g|| + 1e-6)`` where that is below
        1, as DeepSpeed's ``gradient_clipping`` does, ``||g||`` the norm of all of them without the loss scale;
        return ``||g||``. A norm that is not finite (an fp16 overflow) changes nothing, so the overflow is still
        seen. No host sync; collective over the data-parallel group where fragments are sharded."""
        frags = [f for f in map(self.fragment, params) if f is not None]
        device = frags[0].grad.device if frags else torch.device("cpu")
        squares = [f.flat().to(torch.float32).square().sum() for f in frags]
        total = torch.stack(squares).sum().reshape(1) if squares else torch.zeros(1, device=device)
        if self.sharded:
            all_reduce_sum_([total], self.group)
        norm = total[0].sqrt() / self.grad_scale()
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        coefficient = torch.where(norm.isfinite(), coefficient, torch.ones_like(coefficient))
        for f in frags:
            f.store(f.flat() * coefficient.to(f.grad.dtype))
        return norm

    def write(
        self,
        blocks: Sequence[CurvatureBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        matrices: Sequence[torch.Tensor],
    ) -> None:
        """Write each matrix's elements back into the fragments this rank holds."""
        for block, block_frags, m in zip(blocks, fragments, matrices):
            for new, f in zip(block.adapter.matrix_to_grads(m), block_frags):
                if f is not None:
                    f.store(new.reshape(-1)[f.start : f.start + f.numel])


class WholeGradients(GradientLayout):
    """The replicated case: every rank holds each parameter's whole ``.grad`` (plain PyTorch, DDP, ZeRO 0)."""

    def fragment(self, param: nn.Parameter) -> Optional[Fragment]:
        """All of ``param.grad``, as it lies (``None`` if the parameter got no gradient)."""
        if param.grad is None:
            return None
        return Fragment(0, param.numel(), param.grad)

    def gather(self, blocks: Sequence[CurvatureBlock], workers: Workers) -> Gathered:
        chosen, matrices, fragments = [], [], []
        for block in blocks:
            frags = [self.fragment(p) for p in block.adapter.params()]
            if not self._whole_here(block, frags):
                continue
            chosen.append(block)
            matrices.append(block.adapter.grad_to_matrix([f.grad for f in frags]))
            fragments.append(frags)
        return chosen, matrices, fragments


class PartitionedGradients(GradientLayout):
    """Disjoint fragments (ZeRO 1/2): each rank preconditions the layers its partition holds.

    Subclasses say where a parameter's fragment lies (:meth:`fragment`) and, before any backward,
    whether this rank's partition holds any of it (:meth:`holds`). From that, one all-reduce at
    construction of the preconditioner gives every layer's holders and which layers are split.

    Args:
        group: the data-parallel group the partitions are spread over.
        grad_scale: the factor the stored gradients carry (the fp16 loss scale under ZeRO).
    """

    sharded = True

    def __init__(self, group: Optional[dist.ProcessGroup], grad_scale: Callable[[], float]) -> None:
        super().__init__(grad_scale)
        self.group = group
        self.holders: Optional[dict[str, tuple[int, ...]]] = None
        """Which ranks' partitions hold each layer's gradient (set by :meth:`block_holders`)."""
        self.split: Optional[list[bool]] = None
        """Per block, whether no single rank holds all of its gradient (set by :meth:`block_holders`)."""

    @abstractmethod
    def has_fragment(self, param: nn.Parameter) -> bool:
        """Whether this rank's partition holds any of ``param``'s gradient (known before any backward)."""

    def block_holders(self, blocks: Sequence[CurvatureBlock]) -> dict[str, tuple[int, ...]]:
        """One all-reduce of a rank x parameter table, computed once. A layer is split when no rank is
        its only holder of every parameter (the partitions cover each gradient exactly once)."""
        if self.holders is None:
            params = [p for b in blocks for p in b.adapter.params()]
            world = data_parallel_world(self.group)
            table = torch.zeros(world, len(params), dtype=torch.int32, device=blocks_device(blocks))
            mine = [self.has_fragment(p) for p in params]
            table[data_parallel_rank(self.group)] = torch.tensor(mine, dtype=torch.int32)
            all_reduce_sum_([table], self.group)
            held = table.t().tolist()
            self.holders, self.split = layer_holders(blocks, [tuple(r for r in range(world) if row[r]) for row in held])
        return self.holders

    def gather(self, blocks: Sequence[CurvatureBlock], workers: Workers) -> Gathered:
        self.block_holders(blocks)
        frags = [[self.fragment(p) for p in b.adapter.params()] for b in blocks]
        assembled = self._assemble(
            [b for b, s in zip(blocks, self.split) if s], [f for f, s in zip(frags, self.split) if s]
        )
        chosen, matrices, fragments = [], [], []
        for block, block_frags, is_split in zip(blocks, frags, self.split):
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
        self, blocks: Sequence[CurvatureBlock], frags: Sequence[Sequence[Optional[Fragment]]]
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
