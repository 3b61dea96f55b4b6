"""The state a K-FAC step changes, in one place: what snapshot/restore and checkpoints cover.

A step changes the blocks' running factors, eigenvalue corrections, decompositions and eigenbasis
moments, the adaptive refresh schedule, and the scalars held here (:class:`TrainingState`): the
step count, the health counters, the last KL-clip factor, the background
decompositions in flight and the layers that have had factors. Keeping them
together means a skipped step is undone completely (DeepSpeed's overflow
rollback) and a checkpoint saves and restores the same fields; tensors are
never modified in place, so a snapshot holds references, not copies.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from .curvature import AdaptiveRefresh, Background, CurvatureBlock
from .curvature.decomposition import State


@dataclass
class PendingDecompositions:
    """Decompositions running in the background (``async_decompositions``): started from the
    factors of step ``started``, installed at the start of step ``install_at``."""

    started: int
    install_at: int
    blocks: list[CurvatureBlock]
    job: Background


@dataclass
class Scalars:
    """The per-run values besides the tensors (replaced, never mutated, except the counters' dict)."""

    steps: int = 0
    counters: defaultdict = field(default_factory=lambda: defaultdict(int))
    last_nu: Optional[torch.Tensor] = None
    pending: Optional[PendingDecompositions] = None
    seen: frozenset = frozenset()
    """Layers that have had factors (the same set on every rank): those that are decomposed."""


@dataclass(frozen=True)
class Snapshot:
    """What :meth:`TrainingState.restore` needs to undo a step (references, not copies)."""

    scalars: Scalars
    blocks: list[tuple[dict[str, Optional[torch.Tensor]], Optional[State], Optional[tuple]]]
    """Per block, its running statistics' values by name (``A``, ``G``, ``S``), its decomposition and, with
    ``eigenbasis_moments``, its moments' value and update count."""
    refresh: Optional[dict]


class TrainingState:
    """The blocks' factors and decompositions, the refresh schedule and the :class:`Scalars`."""

    def __init__(self, blocks: list[CurvatureBlock], refresh: Optional[AdaptiveRefresh]) -> None:
        self.blocks = blocks
        self.refresh = refresh
        self.scalars = Scalars()

    def snapshot(self) -> Snapshot:
        s = self.scalars
        return Snapshot(
            scalars=dataclasses.replace(s, counters=defaultdict(int, s.counters)),
            blocks=[
                (
                    {k: stat.value for k, stat in b.statistics().items()},
                    b.decomposition,
                    None if b.moments is None else (b.moments.value, b.moments.steps),
                )
                for b in self.blocks
            ],
            refresh=self.refresh.snapshot() if self.refresh is not None else None,
        )

    def restore(self, snap: Snapshot) -> None:
        for b, (values, state, moments) in zip(self.blocks, snap.blocks):
            for k, stat in b.statistics().items():
                stat.value = values[k]
            b.decomposition = state
            if moments is not None:
                b.moments.value, b.moments.steps = moments
        self.scalars = dataclasses.replace(snap.scalars, counters=defaultdict(int, snap.scalars.counters))
        if self.refresh is not None:
            self.refresh.restore(snap.refresh)
