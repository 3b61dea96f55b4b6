"""Tensor parallelism: which rank of a tensor-parallel group holds each layer, and where its gradient lies.

Every rank of a tensor-parallel group preconditions its own model part: the layers replicated over the group
(e.g. a plain ``nn.Linear`` head), its shards as independent layers (``tensor_parallel_factors: "shard"``),
and, with ``"exact"``, the whole tensor-parallel layers it *owns*. Owners are balanced over the group by
decomposition cost (:func:`split_tensor_parallel`); the other ranks relay their rows and gradient shards to
the owner. The data-parallel placement (:class:`~ds_kfac.placement.PlacementPlan`) then acts within each
rank's data-parallel group as without tensor parallelism: the ranks of one data-parallel group share a
tensor-parallel rank, so they hold the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import gather_, scatter_
from ..curvature import CurvatureBlock
from ..layers import LayerAdapter, TensorParallelAdapter
from .gradients import Fragment, Gathered, WholeGradients, Workers
from .plan import lpt


@dataclass
class TensorParallelLayers:
    """A model's layers split by tensor-parallel role on this rank."""

    kept: list[tuple[str, LayerAdapter]]
    """The layers this rank preconditions (replicated, shards, and the exact layers it owns)."""
    exact: list[TensorParallelAdapter]
    """Every ``exact`` tensor-parallel layer of this rank's model part, owned here or not, in model order."""
    relays: list[TensorParallelAdapter]
    """The ``exact`` layers another rank of the group owns."""
    group: dist.ProcessGroup


def split_tensor_parallel(layers: Sequence[tuple[str, LayerAdapter]]) -> Optional[TensorParallelLayers]:
    """Assign each ``exact`` tensor-parallel layer an owner (largest ``a^3 + g^3`` first to the least loaded rank of
    the group, the same on every rank) and split ``layers`` accordingly; ``None`` without tensor-parallel layers."""
    parallel = [a for _, a in layers if isinstance(a, TensorParallelAdapter)]
    if not parallel:
        return None
    groups = {tuple(dist.get_process_group_ranks(a.group)) for a in parallel}
    if len(groups) > 1:
        raise ValueError(f"K-FAC supports one tensor-parallel group per rank; the layers use {sorted(groups)}")
    exact = [a for a in parallel if a.exact]
    owners, _ = lpt([float(a.a_dim) ** 3 + float(a.g_dim) ** 3 for a in exact], parallel[0].size)
    for adapter, owner in zip(exact, owners):
        adapter.owner = owner
    kept = [(n, a) for n, a in layers if not (isinstance(a, TensorParallelAdapter) and a.exact and not a.is_owner)]
    relays = [a for a in exact if not a.is_owner]
    return TensorParallelLayers(kept, exact, relays, parallel[0].group)


class TensorParallelGradients(WholeGradients):
    """Each rank's whole ``.grad`` of every parameter it holds (ZeRO stage 0), shards included.

    An ``exact`` layer's gradient matrix is assembled on its owner (one ``gather`` of the shards' pieces over the
    tensor-parallel group), preconditioned whole there, and each rank's piece sent back (one ``scatter``; a
    row-parallel bias, replicated, goes to every rank). Every data-parallel replica does this within its own
    tensor-parallel group, so on the owners' data-parallel group the gradients are whole, as
    :class:`WholeGradients` has them, and the data-parallel placement applies unchanged.

    Args:
        exact: every ``exact`` tensor-parallel layer of this rank's model part, in model order (the same order
            on every rank of the group, which the collectives need).
        group: the tensor-parallel group.
    """

    def __init__(self, exact: Sequence[TensorParallelAdapter], group: dist.ProcessGroup) -> None:
        super().__init__()
        self.exact = list(exact)
        self.rank = dist.get_rank(group)
        self._active: list[tuple[TensorParallelAdapter, list[Fragment], torch.Tensor]] = []
        """The exact layers of the step in progress, with this rank's fragments and piece of each."""

    def counts(self, block: CurvatureBlock) -> bool:
        """Tensor-parallel layers count on the rank preconditioning them; replicated layers on group rank 0."""
        return isinstance(block.adapter, TensorParallelAdapter) or self.rank == 0

    def _is_exact(self, block: CurvatureBlock) -> bool:
        return isinstance(block.adapter, TensorParallelAdapter) and block.adapter.exact

    def gather(self, blocks: Sequence[CurvatureBlock], workers: Workers) -> Gathered:
        chosen, matrices, fragments = super().gather([b for b in blocks if not self._is_exact(b)], workers)
        owned = {id(b.adapter): b for b in blocks}
        self._active = []
        for adapter in self.exact:
            frags = [self.fragment(p) for p in adapter.params()]
            if any(f is None for f in frags):  # no backward through the layer: the same on every rank
                continue
            piece = adapter.local_matrix([f.grad for f in frags])
            self._active.append((adapter, frags, piece))
            pieces = gather_(piece, adapter.owner, adapter.group)
            if pieces is not None:
                chosen.append(owned[id(adapter)])
                matrices.append(adapter.assemble(pieces))
                fragments.append(frags)
        return chosen, matrices, fragments

    def write(
        self,
        blocks: Sequence[CurvatureBlock],
        fragments: Sequence[Sequence[Optional[Fragment]]],
        matrices: Sequence[torch.Tensor],
    ) -> None:
        """Write the replicated and shard layers' results as they lie; scatter each exact layer's from its owner."""
        local = [i for i, b in enumerate(blocks) if not self._is_exact(b)]
        super().write([blocks[i] for i in local], [fragments[i] for i in local], [matrices[i] for i in local])
        result = {id(b.adapter): m for b, m in zip(blocks, matrices)}
        for adapter, frags, piece in self._active:
            pieces = adapter.split(result[id(adapter)].to(piece.dtype)) if adapter.is_owner else None
            scatter_(piece, pieces, adapter.owner, adapter.group)
            for f, new in zip(frags, adapter.local_grads(piece)):
                f.store(new)
        self._active = []
