"""Per-phase wall time of K-FAC's work, and named ranges for profilers.

Every phase runs inside ``torch.profiler.record_function("kfac/<phase>")``, so
a ``torch.profiler`` trace shows K-FAC's phases by name. The seconds are host
wall time (``time.perf_counter``). On a GPU, kernels run asynchronously, so
host time mostly measures launches: set :attr:`PhaseTimer.synchronize` (the
benchmarks do) to synchronise the device at both ends of each phase, which
makes the times true at the cost of the synchronisations. It is off by
default, so training pays nothing for it.

Phases, in the order a step runs them:

* ``hooks``: factor rows and outer products in the forward and backward hooks;
* ``factor_comm``: waiting for the step's factor reduction to finish;
* ``factors``: folding the step's factors into the running averages;
* ``decompose``: decompositions, their sharing, and their finiteness check;
* ``precondition``: gathering gradients, ``P(g)``, the KL clip, and writing back
  (including the broadcast of results when not every rank preconditions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

PHASES = ("hooks", "factor_comm", "factors", "decompose", "precondition")


class PhaseTimer:
    """Accumulated seconds per phase since the last :meth:`clear`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.synchronize = False
        """Synchronise the current CUDA device around each phase (true GPU times; off by default)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        sync = self.synchronize and torch.cuda.is_available()
        with torch.profiler.record_function(f"kfac/{name}"):
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                yield
            finally:
                if sync:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - start

    def clear(self) -> None:
        self.seconds.clear()
