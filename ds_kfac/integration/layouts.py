"""Where DeepSpeed's ZeRO optimizers keep the reduced gradients: the :class:`~ds_kfac.placement.GradientLayout`
of each ZeRO stage, built once by :class:`~ds_kfac.integration.engine.KFACEngine`.

The DeepSpeed internals these read are listed in docs/maintainers.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_local_grad, safe_set_local_grad
from torch import nn

from ..comm import all_to_all_, data_parallel_rank, data_parallel_world
from ..curvature import CurvatureBlock, blocks_device
from ..layers import param_shape
from ..placement import Fragment, GradientLayout, PartitionedGradients
from ..placement.gradients import Gathered, Workers


class Zero12Gradients(PartitionedGradients):
    """ZeRO 1/2: this rank's fragment of each parameter's reduced gradient, through the fragment mapping
    DeepSpeed attaches to every parameter (the same one behind ``deepspeed.utils.safe_get_full_grad``),
    without that function's full-size all-reduce: only the local fragment is read."""

    def has_fragment(self, param: nn.Parameter) -> bool:
        return getattr(param, "_hp_mapping", None) is not None

    def fragment(self, param: nn.Parameter) -> Optional[Fragment]:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        grad = mapping.get_lp_grad_fragment(param._index_in_param_group)
        address = mapping.lp_fragment_address
        return Fragment(address.start, address.numel, grad.view(-1))


def zero12_param_holders(
    groups: Sequence[Sequence[int]], world: int, element_size: int, parameter_alignment: bool = False
) -> list[list[tuple[int, ...]]]:
    """Per param group, per trainable parameter (given by its element count): the data-parallel ranks whose ZeRO 1/2
    partitions hold some of its gradient, known before any engine exists (for :mod:`ds_kfac.planning`). As DeepSpeed's
    ``DeepSpeedZeroOptimizer`` lays a group out without ``round_robin_gradients``: its parameters flattened in order
    (with ``parameter_alignment``, each but the last padded to a multiple of ``16 / element_size`` elements), the
    whole padded to a multiple of ``2 * world`` and cut into ``world`` equal partitions; a parameter with elements
    lies in each partition its elements overlap. A running engine reads the same from ``param._hp_mapping``
    (:meth:`Zero12Gradients.has_fragment`); ``tests/test_plan.py`` compares the two."""
    align = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    out = []
    for numels in groups:
        starts, offset = [], 0
        for i, n in enumerate(numels):
            starts.append(offset)
            offset += n + (0 if i == len(numels) - 1 else -(offset + n) % align)
        size = -(-offset // (2 * world)) * 2  # the group padded to 2 * world * size elements
        out.append(
            [
                tuple(r for r in range(world) if n and start < (r + 1) * size and r * size < start + n)
                for n, start in zip(numels, starts)
            ]
        )
    return out


@dataclass
class LocalSlice(Fragment):
    """This rank's slice of a ZeRO 3 parameter's reduced gradient (``grad``, a view of ``padded``, DeepSpeed's
    local partition as ``safe_get_local_grad`` returned it); :meth:`store` hands the partition back to
    DeepSpeed through ``safe_set_local_grad``. ``worker``: the rank preconditioning the layer this step."""

    param: Optional[nn.Parameter] = None
    padded: Optional[torch.Tensor] = None
    worker: int = -1

    def store(self, values: torch.Tensor) -> None:
        super().store(values)
        safe_set_local_grad(self.param, self.padded)


class Zero3Gradients(GradientLayout):
    """ZeRO 3: every parameter's reduced gradient is spread over all ranks as contiguous flat slices
    (rank ``r`` holds elements ``[r c, min((r+1) c, n))`` of ``n``, ``c = ceil(n / world)``, in a partition
    padded to ``c``), read and written through DeepSpeed's public ``safe_get_local_grad`` /
    ``safe_set_local_grad``. Each layer has one gradient worker (``initialize`` refuses more): the other
    ranks' slices of its gradient are gathered to it, it preconditions the whole matrix, and each rank gets
    its slice of the result back; one all-to-all each way for all layers. No rank but the worker ever
    holds a layer's whole gradient.
    """

    sharded = True

    def __init__(self, group: Optional[dist.ProcessGroup], grad_scale: Callable[[], float]) -> None:
        super().__init__(grad_scale)
        self.group = group
        self.world = data_parallel_world(group)
        self.rank = data_parallel_rank(group)

    def span(self, param: nn.Parameter, rank: int) -> slice:
        """The elements of ``param``'s (row-major) gradient that data-parallel ``rank`` holds."""
        n = param.ds_numel
        c = -(-n // self.world)
        return slice(min(rank * c, n), min((rank + 1) * c, n))

    def _per_rank(self) -> list[list[torch.Tensor]]:
        """One list of tensors per rank (what an all-to-all sends to, or receives from, each)."""
        return [[] for _ in range(self.world)]

    def fragment(self, param: nn.Parameter) -> Optional[Fragment]:
        padded = safe_get_local_grad(param)
        if padded is None:
            return None
        held = self.span(param, self.rank)
        return LocalSlice(held.start, held.stop - held.start, padded[: held.stop - held.start], param, padded)

    def has_gradients(self, blocks: Sequence[CurvatureBlock]) -> bool:
        """Whether any slice here is non-zero (DeepSpeed's partitions exist, zeroed, before any backward)."""
        slices = [f.grad for b in blocks for f in map(self.fragment, b.adapter.params()) if f is not None]
        return any(bool(s.any()) for s in slices)

    def gather(self, blocks: Sequence[CurvatureBlock], workers: Workers) -> Gathered:
        """Every block with this rank's slices; the whole matrices of those it is the gradient worker of."""
        fragments = [[self.fragment(p) for p in b.adapter.params()] for b in blocks]
        owner = [workers(b)[0] for b in blocks]
        send, recv = self._per_rank(), self._per_rank()
        whole: dict[int, list[torch.Tensor]] = {}
        device = blocks_device(blocks)
        for i, (block, frags, w) in enumerate(zip(blocks, fragments, owner)):
            for f in frags:
                f.worker = w
            if w != self.rank:
                send[w] += [f.flat() for f in frags]
                continue
            whole[i] = [torch.empty(p.ds_numel, dtype=torch.float32, device=device) for p in block.adapter.params()]
            for buf, p, f in zip(whole[i], block.adapter.params(), frags):
                buf[self.span(p, self.rank)] = f.flat()
                for src in range(self.world):
                    if src != self.rank:
                        recv[src].append(buf[self.span(p, src)])
        all_to_all_(send, recv, self.group, torch.float32, device)
        matrices = [
            block.adapter.grad_to_matrix([buf.view(param_shape(p)) for buf, p in zip(whole[i], block.adapter.params())])
            if i in whole
            else None
            for i, block in enumerate(blocks)
        ]
        return list(blocks), matrices, fragments

    def dot(
        self,
        blocks: Sequence[CurvatureBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        precond: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The layers' whole ``sum(P(g) * g)``: only a layer's gradient worker counts it, and holds it whole."""
        parts = [torch.dot(p.reshape(-1), g.to(p.dtype).reshape(-1)) for p, g in zip(precond, grads)]
        return torch.stack(parts).sum() if parts else torch.zeros((), device=blocks_device(blocks))

    def write(
        self,
        blocks: Sequence[CurvatureBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        matrices: Sequence[Optional[torch.Tensor]],
    ) -> None:
        """Each gradient worker sends every rank its slices of the result (one all-to-all); every rank
        writes its slices back through ``safe_set_local_grad``."""
        send, recv = self._per_rank(), self._per_rank()
        mine: list[tuple[LocalSlice, torch.Tensor]] = []
        device = blocks_device(blocks)
        for block, frags, m in zip(blocks, fragments, matrices):
            params = block.adapter.params()
            if m is None:  # its gradient worker sends this rank's slices
                for f in frags:
                    recv[f.worker].append(torch.empty(f.numel, dtype=torch.float32, device=device))
                    mine.append((f, recv[f.worker][-1]))
                continue
            for p, f, new in zip(params, frags, block.adapter.matrix_to_grads(m.to(torch.float32))):
                flat = new.reshape(-1)
                for dst in range(self.world):
                    if dst != self.rank:
                        send[dst].append(flat[self.span(p, dst)])
                mine.append((f, flat[self.span(p, self.rank)]))
        all_to_all_(send, recv, self.group, torch.float32, device)
        for f, values in mine:
            f.store(values)


def zero_layout(stage: int, group: Optional[dist.ProcessGroup], grad_scale: Callable[[], float]) -> GradientLayout:
    """The gradient layout of ZeRO ``stage`` (1-3) over the data-parallel ``group``."""
    if stage == 3:
        return Zero3Gradients(group, grad_scale)
    return Zero12Gradients(group, grad_scale)
