"""Refuse, at construction, data-parallel ranks whose models register different K-FAC layers.

A plan is computed identically on every rank only if every rank registers the same layers with the
same factor sizes; a parameter frozen on some ranks only would make the first factor collective
mismatch (a rank then aborted with signal 6), so this names the layers instead.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm import data_parallel_world
from ..layers import LayerAdapter, SkippedLayer


def refuse_layers_differing_between_ranks(
    layers: list[tuple[str, LayerAdapter]],
    skipped: list[SkippedLayer],
    group: Optional[dist.ProcessGroup],
    model: nn.Module,
) -> None:
    """Raise on every rank, naming the layers, when the layers K-FAC registers differ between the data-parallel ranks
    of ``group``, whose models must be replicas: a parameter frozen on some ranks only skips its layer there or
    changes its ``A``, and the first factor collective would not match (a rank then aborted with signal 6).

    Two small all-reduces (max of each value and of its negation), at construction only: a digest of the names of
    the layers K-FAC looked at, then each one's factor sizes (0 where skipped)."""
    if data_parallel_world(group) == 1:
        return
    sizes = {name: (adapter.a_dim, adapter.g_dim) for name, adapter in layers} | {s.name: (0, 0) for s in skipped}
    names = sorted(sizes)
    device = next(model.parameters(), torch.empty(0)).device

    def extremes(values: list[int]) -> tuple[list[int], list[int]]:
        both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        got = both.tolist()
        return got[: len(values)], [-v for v in got[len(values) :]]

    digest = int.from_bytes(hashlib.sha256("\n".join(names).encode()).digest()[:7], "big")
    high, low = extremes([digest])
    if high != low:
        raise ValueError(
            "the data-parallel ranks' models have layers of different names (K-FAC's layers differ): they must be "
            "replicas of one model"
        )
    high, low = extremes([d for name in names for d in sizes[name]])
    problems = []
    for i, name in enumerate(names):
        (a_high, g_high), (a_low, g_low) = high[2 * i : 2 * i + 2], low[2 * i : 2 * i + 2]
        if a_low == 0 < a_high:
            problems.append(f"{name!r}: registered on some ranks, skipped on others (its weight frozen on some?)")
        elif (a_low, g_low) != (a_high, g_high):
            problems.append(
                f"{name!r}: A of size {a_low} on some ranks, {a_high} on others (its bias frozen on some?)"
                if a_low != a_high
                else f"{name!r}: G of size {g_low} on some ranks, {g_high} on others"
            )
    if problems:
        raise ValueError(
            "K-FAC's layers differ between the data-parallel ranks, whose models must be replicas (parameters "
            "frozen differently on different ranks?): " + "; ".join(problems)
        )
