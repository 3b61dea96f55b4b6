"""Adaptive decomposition refresh (SP-NGD): each factor on its own interval.

With ``inv_update_steps: "adaptive"`` every factor's decomposition is
refreshed when its own next refresh step comes, and the interval to the
following one is chosen from how much the factor moved (relative Frobenius
norm ``||F - F_ref|| / ||F_ref||``, threshold ``adaptive_threshold``):

* moved more than the threshold since its last refresh: halve the interval;
* else moved more than it since the refresh before: keep the interval;
* else: grow it like Fibonacci (the new interval is the sum of the last two).

Every factor starts at interval 1 with a refresh at step 0. The decision is
made where the factor lives (its decomposing rank) and shared, so the
schedule is identical on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

Key = tuple[str, str]
"""A factor: (layer name, side: "A" or "G"; "F" for a unit-wise block). Defined here, used by placement too."""


def factor_name(key: Key) -> str:
    """A factor's name in the saved schedule and the metrics: ``<layer>.<side>``."""
    name, side = key
    return f"{name}.{side}"


@dataclass
class FactorRefresh:
    """The refresh schedule of one factor and the factor at its last two refreshes."""

    interval: int = 1
    previous_interval: int = 0
    next_step: int = 0
    refreshes: int = 0
    last: Optional[torch.Tensor] = None
    before_last: Optional[torch.Tensor] = None


def relative_change(new: torch.Tensor, reference: Optional[torch.Tensor]) -> float:
    """``||new - reference||_F / ||reference||_F`` (infinite with no reference); the norm of all entries, also of a
    stack of matrices (a unit-wise block's)."""
    if reference is None:
        return float("inf")
    ref = reference.float()
    return (torch.linalg.vector_norm(new.float() - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-30)).item()


class AdaptiveRefresh:
    """Per-factor refresh steps and intervals (see the module docstring)."""

    def __init__(self, keys: list[Key], threshold: float) -> None:
        self.threshold = threshold
        self.factors = {key: FactorRefresh() for key in keys}

    def due(self, step: int) -> list[Key]:
        return [key for key, f in self.factors.items() if f.next_step <= step]

    def decide(self, key: Key, value: torch.Tensor) -> int:
        """The next interval for a due factor whose current value this rank holds."""
        f = self.factors[key]
        if f.last is None:
            return f.interval
        if relative_change(value, f.last) > self.threshold:
            return max(1, f.interval // 2)
        if relative_change(value, f.before_last) > self.threshold:
            return f.interval
        return f.interval + max(1, f.previous_interval)

    def refreshed(self, key: Key, step: int, interval: int, value: Optional[torch.Tensor]) -> None:
        """Record a refresh at ``step`` with the agreed ``interval`` (``value``: the factor, where held)."""
        f = self.factors[key]
        f.previous_interval, f.interval = (f.interval if f.refreshes else 0), interval
        f.next_step = step + interval
        f.refreshes += 1
        if value is not None:
            f.before_last, f.last = f.last, value.detach().clone()

    def intervals(self) -> dict[str, int]:
        return {factor_name(key): f.interval for key, f in self.factors.items()}

    def snapshot(self) -> dict[Key, FactorRefresh]:
        """Copies of every schedule (the reference tensors are shared: they are replaced, never modified)."""
        return {key: dataclasses.replace(f) for key, f in self.factors.items()}

    def restore(self, snapshot: dict[Key, FactorRefresh]) -> None:
        self.factors = {key: dataclasses.replace(f) for key, f in snapshot.items()}

    def state_dict(self) -> dict[str, list[int]]:
        """The schedule, the same on every rank (the references travel with the factors)."""
        return {
            factor_name(key): [f.interval, f.previous_interval, f.next_step, f.refreshes]
            for key, f in self.factors.items()
        }

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        for key, f in self.factors.items():
            f.interval, f.previous_interval, f.next_step, f.refreshes = state[factor_name(key)]
