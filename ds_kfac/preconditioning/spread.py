"""Refreshes spread over the cycle (``refresh_spread``): no step pays for every decomposition at once.

With a fixed ``inv_update_steps = K``, each factor's refresh gets a slot ``o`` in ``[0, K)`` and is refreshed at the
steps ``s`` with ``s % K == o``; at step 0 every factor is decomposed (preconditioning starts at once). Slots are
given per decomposing rank by longest-processing-time on the cost ``dim^3``, so that each step refreshes about
``1/K`` of every rank's decomposition work: the slowest step is then a plain step plus one slot's refreshes,
not every refresh of the cycle (the "spike" of a fixed cadence). The sides of a block decomposed together (a
colocated method, a unit-wise block) share a slot. Slots depend on the placement plan and ``K`` only, so every
rank computes the same ones and a resumed run refreshes where an uninterrupted one does.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Callable, Sequence

from ..curvature import CurvatureBlock
from ..curvature.refresh import Key


def spread_slots(
    blocks: Sequence[CurvatureBlock], period: int, decomposer: Callable[[str, str], int]
) -> dict[Key, int]:
    """Each factor's slot in ``[0, period)``: per decomposing rank (``decomposer(name, side)``), its items (a side,
    or a colocated block's sides together) longest first, each to the slot of least load so far (ties: the lowest)."""
    items: dict[int, list[tuple[float, tuple[Key, ...]]]] = defaultdict(list)
    for b in blocks:
        costs = b.costs(3)
        groups = [tuple(b.sides)] if b.colocated else [(side,) for side in b.sides]
        for sides in groups:
            cost = sum(costs[b.sides.index(s)] for s in sides)
            items[decomposer(b.name, sides[0])].append((cost, tuple((b.name, s) for s in sides)))
    slots: dict[Key, int] = {}
    for rank_items in items.values():
        heap = [(0.0, slot) for slot in range(period)]
        for cost, keys in sorted(rank_items, key=lambda item: (-item[0], item[1])):
            load, slot = heapq.heappop(heap)
            slots.update({key: slot for key in keys})
            heapq.heappush(heap, (load + cost, slot))
    return slots


class SpreadRefresh:
    """Which factors are due at a step under ``refresh_spread`` (slots recomputed when ``K`` changes)."""

    def __init__(self, blocks: Sequence[CurvatureBlock], decomposer: Callable[[str, str], int]) -> None:
        self._blocks = list(blocks)
        self._decomposer = decomposer
        self._slots: dict[int, dict[Key, int]] = {}

    def due(self, step: int, period: int) -> set[Key]:
        """The factors refreshed at ``step`` with ``inv_update_steps = period``: every one at step 0, else those
        whose slot is ``step % period``."""
        if period not in self._slots:
            self._slots[period] = spread_slots(self._blocks, period, self._decomposer)
        slots = self._slots[period]
        if step == 0:
            return set(slots)
        return {key for key, slot in slots.items() if slot == step % period}
