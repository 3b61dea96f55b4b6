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
from typing import Any, Callable, Generic, TypeVar, Union

from .ranges import MILESTONE, NUMBER

T = TypeVar("T", int, float)

ScheduleLike = Union[T, Callable[[int], T], "PiecewiseSchedule"]


@dataclass(frozen=True)
class PiecewiseSchedule(Generic[T]):
    """Piecewise-constant value of the step: ``values[i]`` for steps in
    ``[milestones[i-1], milestones[i])`` (``milestones`` strictly increasing).

    Built from lists or tuples (JSON gives lists); stored as tuples, milestones as ``int``. A malformed
    schedule raises ``ValueError`` saying what is allowed, which the schema reports under the key."""

    milestones: tuple[int, ...]
    values: tuple[T, ...]

    def __post_init__(self) -> None:
        _check_milestones(self.milestones)
        if not isinstance(self.values, (list, tuple)) or len(self.values) != len(self.milestones) + 1:
            raise ValueError(
                f"a piecewise schedule needs a list of len(values) == len(milestones) + 1 values, "
                f"not values={self.values!r} with {len(self.milestones)} milestones"
            )
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))
        object.__setattr__(self, "values", tuple(self.values))

    def __call__(self, step: int) -> T:
        return self.values[bisect.bisect_right(self.milestones, step)]

    @classmethod
    def step_decay(cls, initial: float, milestones: list[int], gamma: float) -> "PiecewiseSchedule[float]":
        """MultiStepLR-style decay: ``initial * gamma**k`` after the k-th milestone."""
        for name, x in (("initial", initial), ("gamma", gamma)):
            if not NUMBER.contains(x):
                raise ValueError(f"schedule '{name}' must be {NUMBER.allowed}, not {x!r}")
        _check_milestones(milestones)
        return cls(tuple(milestones), tuple(initial * gamma**k for k in range(len(milestones) + 1)))


def _check_milestones(milestones: Any) -> None:
    ok = isinstance(milestones, (list, tuple)) and all(MILESTONE.contains(m) for m in milestones)
    if not ok or any(b <= a for a, b in zip(milestones, milestones[1:])):
        raise ValueError(
            f"schedule milestones must be a list of non-negative, strictly increasing integers, not {milestones!r}"
        )


def resolve(value: "ScheduleLike[T]", step: int) -> T:
    """The value of a constant-or-schedule hyperparameter at ``step``."""
    return value(step) if callable(value) else value
