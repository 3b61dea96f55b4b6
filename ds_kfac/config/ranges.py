"""The values each numeric K-FAC key allows: one definition per range, shared by the schema (constants and JSON
schedules, when the config is parsed) and by :meth:`KFACConfig.at` (Python callables, when they are called)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

FLOAT32_TINY = 2.0**-126
"""``torch.finfo(torch.float32).tiny`` (1.1754944e-38), float32's smallest normal number."""

UNDERFLOW = (
    f"0 or subnormal in float32, the arithmetic it is used in (whose smallest normal number is {FLOAT32_TINY:.8g})"
)
"""Why a positive value below :data:`FLOAT32_TINY` is refused, for error messages."""


@dataclass(frozen=True)
class Range:
    """Numbers of one kind between two bounds, and the words an error message uses for them.

    A bool or a string is never a number. An integer range also takes integral floats (``10.0``, as JSON writers
    sometimes emit; ``kind(v)`` makes them ``int``); NaN and infinities are outside every range. ``smallest``: the
    smallest value the range takes that its bound alone would not exclude (a positive value that is 0 or subnormal
    in float32 passes ``> 0`` but is refused, with its own message: :meth:`underflows`).
    """

    kind: type
    allowed: str
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = True
    high_open: bool = True
    smallest: float = -math.inf

    def underflows(self, v: Any) -> bool:
        """Whether ``v``, a number of the range, is below :attr:`smallest`."""
        return v < self.smallest

    def contains(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return False
        if self.kind is int and not (isinstance(v, numbers.Integral) or float(v).is_integer()):
            return False
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below


NUMBER = Range(float, "a number")
POSITIVE = Range(float, "a number > 0", low=0.0, smallest=FLOAT32_TINY)
DECAY = Range(float, "a number in [0, 1)", low=0.0, high=1.0, low_open=False)
FRACTION = Range(float, "in (0, 1]", low=0.0, high=1.0, high_open=False)
UNIT = Range(float, "a number in [0, 1]", low=0.0, high=1.0, low_open=False, high_open=False)
POSITIVE_INTEGER = Range(int, "an integer >= 1", low=1, low_open=False)
MILESTONE = Range(int, "an integer >= 0", low=0, low_open=False)
