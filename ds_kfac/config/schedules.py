"""Hyperparameter schedules: a value that may change with the optimizer step.

Every K-FAC hyperparameter (damping, factor decay, KL clip, update intervals)
is either a constant, a Python callable ``f(step) -> value`` or, in JSON, a
piecewise-constant schedule in one of two documented forms::

    {"milestones": [1000, 5000], "values": [0.003, 0.001, 0.0003]}
    {"initial": 0.003, "milestones": [1000, 5000], "gamma": 0.5}

The first takes ``values[i]`` from step ``milestones[i-1]`` on; the second is
step-wise decay (``initial * gamma**k`` after the k-th milestone), as
``torch.optim.lr_scheduler.MultiStepLR`` does for the learning rate.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar, Union

T = TypeVar("T", int, float)

ScheduleLike = Union[T, Callable[[int], T], "PiecewiseSchedule"]


@dataclass(frozen=True)
class PiecewiseSchedule(Generic[T]):
    """Piecewise-constant value of the step: ``values[i]`` for steps in
    ``[milestones[i-1], milestones[i])`` (``milestones`` strictly increasing)."""

    milestones: tuple[int, ...]
    values: tuple[T, ...]

    def __post_init__(self) -> None:
        if len(self.values) != len(self.milestones) + 1:
            raise ValueError(
                f"a piecewise schedule needs len(values) == len(milestones) + 1, "
                f"got {len(self.values)} values and {len(self.milestones)} milestones"
            )
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])) or any(m < 0 for m in self.milestones):
            raise ValueError(
                f"schedule milestones must be non-negative and strictly increasing, got {list(self.milestones)}"
            )

    def __call__(self, step: int) -> T:
        return self.values[bisect.bisect_right(self.milestones, step)]

    @classmethod
    def step_decay(cls, initial: float, milestones: list[int], gamma: float) -> "PiecewiseSchedule[float]":
        """MultiStepLR-style decay: ``initial * gamma**k`` after the k-th milestone."""
        values = tuple(initial * gamma**k for k in range(len(milestones) + 1))
        return cls(tuple(milestones), values)


def resolve(value: "ScheduleLike[T]", step: int) -> T:
    """The value of a constant-or-schedule hyperparameter at ``step``."""
    return value(step) if callable(value) else value
