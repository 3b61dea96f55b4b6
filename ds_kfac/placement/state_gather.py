"""Gather the whole per-layer state to the saving rank for a checkpoint (:func:`gather_state`).

Placement decides where each piece of the state lives (a statistic on its keepers, a decomposition on its
holders, adaptive-refresh references on the decomposing rank); this module reads that from the
:class:`~ds_kfac.placement.distributor.Distributor` and moves every piece at most once, point to point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..checkpoint.record import LayerRecord
from ..comm import receive, send_
from ..curvature import blocks_device
from ..curvature.decomposition import Shape
from .distributor import Distributor

SAVER = 0
"""The data-parallel rank that :func:`gather_state` gathers to: DeepSpeed saves from data-parallel rank 0."""


def gather_state(distributor: Distributor, local: dict[str, LayerRecord]) -> Optional[dict[str, LayerRecord]]:
    """The whole per-layer state, as CPU tensors, on rank :data:`SAVER`; ``None`` on the others,
    which receive nothing. ``local`` is every rank's own view (``None`` for what it does not hold).

    Each entry (a statistic, the decomposition, a factor's adaptive-refresh references) crosses
    at most once, point to point: from the saver itself where it holds the entry, else from the
    one rank the plan designates (the factor's decomposing rank; the layer's ``A`` worker for
    the decomposition). Collective: call it on every rank of the distributor's group."""
    d = distributor
    entries = [e for name in d.plan.layers for e in _state_entries(d, name, local[name])]
    device = blocks_device(d._blocks.values())
    if d.rank != SAVER:
        mine = [(e, e.get(local[e.name])) for e in entries if e.source == d.rank]
        tensors = [
            None if t is None else t.to(dtype) for e, value in mine for t, dtype in zip(e.tensors(value), e.dtypes)
        ]
        if tensors:
            send_(tensors, d.groups.to_global(SAVER), d.group, device)
        return None
    remote = [e for e in entries if e.source != SAVER]
    specs = [(shape, dtype) for e in remote for shape, dtype in zip(e.shapes, e.dtypes)]
    srcs = [d.groups.to_global(e.source) for e in remote for _ in e.shapes]
    received = iter(receive(specs, srcs, d.group, device) if specs else [])
    state = {name: LayerRecord() for name in d.plan.layers}
    for e in entries:
        if e.source == SAVER:
            tensors = e.tensors(e.get(local[e.name]))
        else:
            tensors = [next(received) for _ in e.shapes]
        e.put(state[e.name], [None if t is None else _saved(t) for t in tensors])
    return state


def _state_entries(d: Distributor, name: str, record: LayerRecord) -> list[_StateEntry]:
    """The entries of layer ``name``'s ``record``, each with the rank it is taken from: the saver
    where it holds the entry, else the plan's designated rank."""
    p, block = d.plan.layers[name], d._blocks[name]
    factor, inv = d.config.factor_torch_dtype, d.config.inv_torch_dtype
    stats = block.statistics()
    # (record field, side, ranks holding it, designated rank, its tensors' shapes, their dtype)
    where: list[tuple[str, Optional[str], Sequence[int], int, list[Shape], torch.dtype]] = []
    for side in record.statistics:
        designated = d.decomposer(name, side) if side in block.sides else p.a_worker
        where.append(("statistics", side, d._factor_stores(name, side), designated, [stats[side].shape], factor))
    shapes = [s for v in block.side_shapes().values() for s in v]
    where.append(("decomposition", None, d.decomposition_holders(block), p.a_worker, shapes, inv))
    for side in record.references:  # adaptive refresh's references, on the decomposing rank
        decomposer = d.decomposer(name, side)
        where.append(("references", side, (decomposer,), decomposer, [stats[side].shape] * 2, factor))
    entries = [
        _StateEntry(name, part, side, SAVER if SAVER in holders else designated, shapes, (dtype,) * len(shapes))
        for part, side, holders, designated, shapes, dtype in where
    ]
    if record.has_moments:  # on the ranks that precondition the layer: m and v, then their update count
        workers = d.preconditioners(block)
        matrix = (block.adapter.g_dim, block.adapter.a_dim)
        source = SAVER if SAVER in workers else workers[0]
        entries.append(_StateEntry(name, "moments", None, source, [matrix, matrix, ()], (inv, inv, torch.int64)))
    return entries


@dataclass(frozen=True)
class _StateEntry:
    """One entry of a layer's saved state: a field of its :class:`LayerRecord` (``part``: ``"statistics"``,
    ``"decomposition"``, ``"references"`` or ``"moments"``; ``side``: the statistic's name, ``None`` for the
    others), the rank it is taken from, and the shapes and dtypes of its tensors."""

    name: str
    part: str
    side: Optional[str]
    source: int
    shapes: list[Shape]
    dtypes: tuple[torch.dtype, ...]

    def get(self, record: LayerRecord) -> Any:
        """The entry's value in ``record``."""
        return getattr(record, self.part) if self.side is None else getattr(record, self.part)[self.side]

    def put(self, record: LayerRecord, tensors: list[Optional[torch.Tensor]]) -> None:
        """Set the entry in ``record`` from its tensors (the inverse of :meth:`get` then :meth:`tensors`)."""
        if self.part == "moments":
            record.has_moments = True
            record.moments = None if tensors[0] is None else tensors
        elif self.part == "decomposition":
            record.decomposition = None if tensors[0] is None else tensors
        elif self.part == "references":
            record.references[self.side] = tensors
        else:
            record.statistics[self.side] = tensors[0]

    def tensors(self, value: Any) -> list[Optional[torch.Tensor]]:
        """The entry's value as one slot per tensor (``None`` where absent)."""
        if value is None:
            return [None] * len(self.shapes)
        return [value] if isinstance(value, torch.Tensor) else list(value)


def _saved(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, copied where it is a view into a larger storage (a decomposition lives in
    its shape's stack), which saving would otherwise write whole."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.to("cpu", copy=True)
    return t.cpu()
