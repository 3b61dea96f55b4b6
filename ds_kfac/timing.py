"""Per-phase wall time of K-FAC's work, and named ranges for profilers.

Every phase runs inside ``torch.profiler.record_function("kfac/<phase>")``, so
a ``torch.profiler`` trace shows K-FAC's phases by name. The seconds are host
wall time (``time.perf_counter``). On a GPU, kernels run asynchronously, so
host time mostly measures launches: set :attr:`PhaseTimer.synchronize` (the
benchmarks do) to synchronise the current stream at both ends of each phase, which
makes the times true at the cost of the synchronisations. Only the current
stream: a whole-device synchronisation would also wait for ``async_decompositions``'
side stream and so time them as if they ran in the step. It is off by
default, so training pays nothing for it.

Phases, in the order a step runs them:

* ``hooks``: factor rows and outer products in the forward and backward hooks;
* ``sampled_backward``: the sampled Fisher's extra backward pass (``sample_fisher``
  on factor-update micro-batches: the sampling and the pass), less the ``hooks``
  that run inside it;
* ``factor_comm``: waiting for the step's factor reduction to finish;
* ``factors``: folding the step's factors into the running averages;
* ``decompose``: decompositions, their sharing, and their finiteness check;
* ``rebase``: installing a new basis: the base optimizer's moments (``eigenbasis_moments``) and the eigenvalue
  correction re-expressed in it, on every rank that preconditions the layer (not only its decomposer);
* ``stack``: copying new decompositions into the stacks preconditioning reads
  (after a refresh; only the groups of equal shapes with a new member);
* ``precondition``: gathering gradients, ``P(g)``, the KL clip, and writing back
  (including the broadcast of results when not every rank preconditions).

A phase that runs inside another (the hooks inside ``sampled_backward``) counts
in the inner one only, so the phases never overlap and their sum is K-FAC's time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

PHASES = ("hooks", "sampled_backward", "factor_comm", "factors", "decompose", "rebase", "stack", "precondition")


class PhaseTimer:
    """Accumulated seconds per phase since the last :meth:`clear`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.synchronize = False
        """Synchronise the current CUDA stream around each phase (true GPU times; off by default)."""
        self._nested: list[float] = []
        """Per phase in progress (outermost first), the seconds of the phases run inside it so far."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        sync = self.synchronize and torch.cuda.is_available()
        with torch.profiler.record_function(f"kfac/{name}"):
            if sync:
                torch.cuda.current_stream().synchronize()
            start = time.perf_counter()
            self._nested.append(0.0)
            try:
                yield
            finally:
                if sync:
                    torch.cuda.current_stream().synchronize()
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed

    def clear(self) -> None:
        self.seconds.clear()
