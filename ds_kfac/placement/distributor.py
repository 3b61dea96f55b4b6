"""Carry out a placement plan: move factors, decompositions and preconditioned gradients.

The :class:`Distributor` is the only part of K-FAC that knows who does what (:mod:`~ds_kfac.placement.roles`).
Per factor-update step it reduces the factors to the ranks that store them
(:mod:`~ds_kfac.placement.factors`); per decomposition step each rank decomposes the factors
assigned to it and shares the result with the layer's decomposition holders
(:mod:`~ds_kfac.placement.decompositions`). Per step, gradient workers precondition and, when not
every rank is a gradient worker, broadcast the result along rows to the others. Under ZeRO ownership
(``mem-opt`` with partitioned gradients) a layer's gradient workers are its partition's owners, who
write their own partitions: no preconditioned gradient moves. The checkpoint's gather is
:mod:`~ds_kfac.placement.state_gather`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm import broadcast_
from .decompositions import DecompositionSharing
from .factors import FactorReduction
from .work import LayerWork


class Distributor(FactorReduction, DecompositionSharing):
    """One rank's share of the K-FAC work under a :class:`~ds_kfac.placement.plan.PlacementPlan`: its roles,
    the factor reduction, the decompositions' sharing, and the preconditioned gradients' moves (the
    checkpoint's gather is :func:`~ds_kfac.placement.state_gather.gather_state`)."""

    def share_preconditioned(self, work: Sequence[LayerWork]) -> None:
        """Give every rank every layer's result when every rank holds every gradient: gradient workers
        broadcast theirs along rows (in the gradient's dtype). Nothing moves when every rank is a
        gradient worker. (Under ZeRO nothing is shared: each rank writes the partition it holds.)"""
        if not self.shares_along_rows:
            for w in work:
                w.result = w.result.to(w.grad.dtype)
            return
        row_group = self.groups.of(tuple(self.plan.row_members(self.plan.row(self.rank))))
        tensors, srcs = [], []
        for w in work:
            tensors.append(w.result.to(w.grad.dtype) if w.result is not None else torch.empty_like(w.grad))
            srcs.append(self.groups.to_global(self.plan.sender_to(w.block.name, self.rank)))
        broadcast_(tensors, srcs, [row_group] * len(tensors), self.bucket_bytes)
        for w, shared in zip(work, tensors):
            w.result = shared
