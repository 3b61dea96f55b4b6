"""When decompositions are refreshed, and installing them: step 3 of the flow.

Four schedules, from the ``"kfac"`` section: a fixed cadence (every ``inv_update_steps`` steps),
the same cadence spread over the cycle (``refresh_spread``, each factor in its own slot of it,
:mod:`.spread`), adaptive refresh (``inv_update_steps: "adaptive"``, each factor on its own interval,
:mod:`~ds_kfac.curvature.refresh`), and, with ``async_decompositions``, the fixed cadence's
decompositions run in the background (:mod:`~ds_kfac.curvature.background`) and installed at the next
step that updates factors or decomposes. Every schedule depends on the step alone (adaptive intervals
are agreed on by all ranks), so all ranks decompose at the same steps. A candidate decomposition is
installed only where finite (:meth:`DecompositionSchedule._adopt`).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..config import KFACConfig
from ..curvature import Background, CurvatureBlock, all_finite, blocks_device, curvature_floor
from ..curvature.decomposition import State
from ..health import Health
from ..placement import Distributor
from ..state import PendingDecompositions, TrainingState
from ..timing import PhaseTimer
from .spread import SpreadRefresh


def _uncurved(block: CurvatureBlock, state: Optional[tuple], no: torch.Tensor) -> torch.Tensor:
    """Whether ``state``, a candidate decomposition of ``block``, has no usable curvature (a device bool; ``no``
    where its method cannot tell, or there is no state)."""
    flag = None if state is None else block.method.uncurved(state)
    return no if flag is None else flag.to(no.device)


def _unchanged(block: CurvatureBlock, state: State, no: torch.Tensor) -> list[torch.Tensor]:
    """Per tensor of ``state``, a candidate decomposition of ``block``, whether it equals the installed one's
    bit for bit (device bools; ``no`` throughout where none is installed)."""
    old = block.decomposition
    if old is None:
        return [no] * len(state)
    return [~no if t is o else (t == o).all().to(no.device) for t, o in zip(state, old)]


class DecompositionSchedule:
    """Decides at which steps factors are updated and decomposed, and runs the decompositions due."""

    def __init__(
        self,
        config: KFACConfig,
        blocks: list[CurvatureBlock],
        distributor: Distributor,
        state: TrainingState,
        health: Health,
        timer: PhaseTimer,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.distributor = distributor
        self.state = state
        self.refresh = state.refresh
        self.health = health
        self.timer = timer
        self._by_name = {b.name: b for b in blocks}
        self.spread = SpreadRefresh(blocks, distributor.decomposer) if config.refresh_spread else None

    def is_factor_step(self, step: int) -> bool:
        return step % self.config.at("factor_update_steps", step) == 0

    def is_decomposition_step(self, step: int) -> bool:
        return step % self.config.at("inv_update_steps", step) == 0

    def decompose(self, step: int) -> None:
        """Install background decompositions due at ``step``, then refresh what the schedule says is due."""
        scalars = self.state.scalars
        if scalars.pending is not None and step >= scalars.pending.install_at:
            with self.timer.phase("decompose"):
                self._adopt(*self.distributor.share_sides(scalars.pending.blocks, *scalars.pending.job.result()))
            scalars.pending = None
        damping = self.config.at("damping", step)
        if self.refresh is not None:
            self._refresh(step, damping)
        elif self.spread is not None:
            due = self.spread.due(step, self.config.at("inv_update_steps", step))
            due = {key for key in due if key[0] in self.state.scalars.seen}
            if due:
                with self.timer.phase("decompose"):
                    self._decompose_now(damping, due)
        elif self.is_decomposition_step(step):
            with self.timer.phase("decompose"):
                if self.config.async_decompositions:
                    self._start_in_background(step)
                else:
                    self._decompose_now(damping)

    def _refresh(self, step: int, damping: float) -> None:
        """Adaptive refresh: decompose the factors due (of layers that have had factors) and agree on each
        one's next interval."""
        due = [key for key in self.refresh.due(step) if key[0] in self.state.scalars.seen]
        if not due:
            return
        with self.timer.phase("decompose"):
            intervals = self.distributor.agree_intervals(due, self.refresh.decide)
            self._decompose_now(damping, set(due))
            for (name, side), interval in zip(due, intervals):
                factor = self._by_name[name].statistics()[side]
                held = self.distributor.decomposes(name, side)
                self.refresh.refreshed((name, side), step, interval, factor.value if held else None)

    def _start_in_background(self, started: int) -> None:
        """Start the decompositions of step ``started``'s factors in the background, to be installed at
        the next step that updates factors or decomposes (every rank computes the same step, so ranks
        agree). The factors are not changed before then, so a checkpoint in between can restart it."""
        install_at = started + 1
        while not (self.is_factor_step(install_at) or self.is_decomposition_step(install_at)):
            install_at += 1
        self.run_in_background(started, install_at)

    def run_in_background(self, started: int, install_at: int) -> None:
        """Decompose the current factors (those of step ``started``) in the background, to install at step
        ``install_at`` (also to restart a checkpoint's pending decompositions)."""
        seen = self._seen_blocks()
        damping = self.config.at("damping", started)
        # The factors as they are now: the next step folds new ones in (never in place) before installing.
        factors = {b.name: {side: b.statistics()[side].value for side in b.sides} for b in seen}
        job = Background(
            partial(self.distributor.compute_sides, seen, damping, factors=factors), blocks_device(self.blocks)
        )
        self.state.scalars.pending = PendingDecompositions(started, install_at, seen, job)

    def _seen_blocks(self) -> list[CurvatureBlock]:
        """The blocks that have had factors (the same on every rank): those that are decomposed."""
        return [b for b in self.blocks if b.name in self.state.scalars.seen]

    def _decompose_now(self, damping: float, due: Optional[set[tuple[str, str]]] = None) -> None:
        self._adopt(*self.distributor.decompose(self._seen_blocks(), damping, due))

    def _adopt(self, chosen: list[CurvatureBlock], states: list[State]) -> None:
        """Install the candidate decompositions that are finite; keep the previous ones of the others. A candidate's
        tensor equal to the installed one (a side not refreshed, or one that kept its basis: ``basis_keep_drift``)
        is installed as that same tensor, on every rank alike, so a kept basis moves no moments."""
        candidates = list(zip(chosen, states))
        if not candidates:
            return
        device = blocks_device(self.blocks)
        no = torch.zeros((), dtype=torch.bool, device=device)
        flags = [
            torch.stack([all_finite(state).to(device), _uncurved(block, state, no), *_unchanged(block, state, no)])
            for block, state in candidates
        ]
        values = iter(torch.cat(flags).tolist())  # the one host sync of a decomposition step
        failed, uncurved = [], []
        with self.timer.phase("rebase"):  # installing: the moments and the correction follow a new basis
            for block, state in candidates:
                good, flat, same = next(values), next(values), [next(values) for _ in state]
                if good:
                    old = block.decomposition
                    block.install(tuple(o if kept else t for t, o, kept in zip(state, old or state, same)))
                    if flat:
                        uncurved.append(block.name)
                else:
                    failed.append(block.name)
        if failed:
            self.health.failed_decompositions(failed)
        if uncurved:
            self.health.uncurved_blocks(uncurved, curvature_floor(self.config.inv_torch_dtype))
