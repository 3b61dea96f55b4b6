"""Carry out a placement plan: move factors, decompositions and preconditioned gradients.

The :class:`Distributor` is the only part of K-FAC that knows who does what (:mod:`~ds_kfac.placement.roles`).
Per factor-update step it reduces the factors to the ranks that store them
(:mod:`~ds_kfac.placement.factors`); per decomposition step each rank decomposes the factors
assigned to it and shares the result with the layer's decomposition holders
(:mod:`~ds_kfac.placement.decompositions`). Per step, gradient workers precondition and, when not
every rank is a gradient worker, broadcast the result along rows to the others. Under ZeRO ownership
(``mem-opt`` with partitioned gradients) a layer's gradient workers are its partition's owners, who
write their own partitions: no preconditioned gradient moves. For a checkpoint it gathers the state
to the saving rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from ..comm import broadcast_, receive, send_
from ..curvature import blocks_device
from ..curvature.decomposition import Shape
from .decompositions import DecompositionSharing
from .factors import FactorReduction
from .work import LayerWork

SAVER = 0
"""The data-parallel rank that :meth:`Distributor.gather_state` gathers to: DeepSpeed saves from data-parallel rank 0."""


class Distributor(FactorReduction, DecompositionSharing):
    """One rank's share of the K-FAC work under a :class:`~ds_kfac.placement.plan.PlacementPlan`: its roles,
    the factor reduction, the decompositions' sharing, and the preconditioned gradients' and checkpoint's moves."""

    def share_preconditioned(self, work: Sequence[LayerWork]) -> None:
        """Give every rank every layer's result when every rank holds every gradient: gradient workers
        broadcast theirs along rows (in the gradient's dtype). Nothing moves when every rank is a
        gradient worker. (Under ZeRO nothing is shared: each rank writes the partition it holds.)"""
        if self.plan.replicated or self.world == 1:
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

    # ------------------------------------------------------------- checkpoint
    def gather_state(self, local: dict[str, dict[str, Any]]) -> Optional[dict[str, dict[str, Any]]]:
        """The whole per-layer state, as CPU tensors, on rank :data:`SAVER`; ``None`` on the others,
        which receive nothing. ``local`` is every rank's own view (``None`` for what it does not hold).

        Each entry (``A``, ``G``, the decomposition, a factor's adaptive-refresh references) crosses
        at most once, point to point: from the saver itself where it holds the entry, else from the
        one rank the plan designates (the factor's decomposing rank; the layer's ``A`` worker for
        the decomposition). Collective: call it on every rank."""
        entries = [e for name in self.plan.layers for e in self._state_entries(name, local[name])]
        device = blocks_device(self._blocks.values())
        if self.rank != SAVER:
            mine = [(e, local[e.name][e.key]) for e in entries if e.source == self.rank]
            tensors = [None if t is None else t.to(e.dtype) for e, value in mine for t in e.tensors(value)]
            if tensors:
                send_(tensors, self.groups.to_global(SAVER), self.group, device)
            return None
        remote = [e for e in entries if e.source != SAVER]
        specs = [(shape, e.dtype) for e in remote for shape in e.shapes]
        srcs = [self.groups.to_global(e.source) for e in remote for _ in e.shapes]
        received = iter(receive(specs, srcs, self.group, device) if specs else [])
        state: dict[str, dict[str, Any]] = {name: {} for name in self.plan.layers}
        for e in entries:
            if e.source == SAVER:
                tensors = e.tensors(local[e.name][e.key])
            else:
                tensors = [next(received) for _ in e.shapes]
            state[e.name][e.key] = e.value([None if t is None else _saved(t) for t in tensors])
        return state

    def _state_entries(self, name: str, keys: Iterable[str]) -> list[_StateEntry]:
        """Layer ``name``'s saved entries ``keys``, each with the rank it is taken from: the saver
        where it holds the entry, else the plan's designated rank."""
        p, block = self.plan.layers[name], self._blocks[name]
        factor, inv = self.config.factor_torch_dtype, self.config.inv_torch_dtype
        # key: (ranks holding it, designated rank, its tensors' shapes, their dtype)
        where = {
            "state": (
                self.decomposition_holders(block), p.a_worker, [s for v in block.side_shapes().values() for s in v], inv
            )
        }
        for key, stat in block.statistics().items():
            designated = self.decomposer(name, key) if key in block.sides else p.a_worker
            where[key] = (self._factor_stores(name, key), designated, [stat.shape], factor)
            if key in block.sides:  # adaptive refresh's references, on the decomposing rank
                where[f"{key}_refs"] = ((designated,), designated, [stat.shape] * 2, factor)
        entries = []
        for key in keys:
            holders, designated, shapes, dtype = where[key]
            entries.append(_StateEntry(name, key, SAVER if SAVER in holders else designated, shapes, dtype))
        return entries


@dataclass(frozen=True)
class _StateEntry:
    """One entry of a layer's saved state (``key``: a statistic's name (``A``, ``G``, ``S``, ``F``), ``state``, or a
    side's adaptive-refresh references ``<side>_refs``):
    the rank it is taken from, and the shapes and dtype of its tensors."""

    name: str
    key: str
    source: int
    shapes: list[Shape]
    dtype: torch.dtype

    def tensors(self, value: Any) -> list[Optional[torch.Tensor]]:
        """The entry's value as one slot per tensor (``None`` where absent)."""
        if value is None:
            return [None] * len(self.shapes)
        return [value] if isinstance(value, torch.Tensor) else list(value)

    def value(self, tensors: list[Optional[torch.Tensor]]) -> Any:
        """The inverse of :meth:`tensors`: a factor, a decomposition (a list, or ``None``), or the references."""
        if self.key == "state":
            return None if tensors[0] is None else tensors
        if self.key.endswith("_refs"):
            return tensors
        return tensors[0]


def _saved(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, copied where it is a view into a larger storage (a decomposition lives in
    its shape's stack), which saving would otherwise write whole."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.to("cpu", copy=True)
    return t.cpu()
