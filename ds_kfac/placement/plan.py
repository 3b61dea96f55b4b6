"""Who does what: the per-layer placement of K-FAC work over data-parallel ranks.

A plan is computed once from layer shapes, identically on every rank (no
communication), and never changes. It follows KAISA's layout:

* ``n = grad_worker_fraction * world`` *gradient workers* per layer
  (``comm-opt``: ``n = world``; ``mem-opt``: ``n = 1``; ``hybrid-opt``: ``n = world/2``).
  Ranks form ``world/n`` contiguous *columns* ``[k*n, ..., k*n + n-1]``; every
  layer belongs to one column, whose ranks hold its decompositions and
  precondition its gradient.
* The ``n`` *rows* ``[j, j+n, j+2n, ...]`` hold one rank of every column: the
  preconditioned gradient of a layer travels along rows, from the layer's
  worker in that row to the rest of it.
* Layers go to columns, and within a column each factor's decomposition to one
  rank, by greedy longest-processing-time on cost ``dim^3`` (``compute``) or
  ``dim^2`` (``memory``). ``A`` and ``G`` of a layer may land on different ranks,
  except with ``compute_method="inverse"`` (whose damping couples them) and
  ``factor_reduction="local"`` (one owner computes both), where they share one.
  A block with one statistic (unit-wise BatchNorm: ``units`` small matrices of
  size ``size``, cost ``units * size^3`` or ``units * size^2``) has one rank for it
  (its ``a_worker``, also named as its ``g_worker``).
* Under ZeRO 1/2 with ``n < world`` the gradient already lies partitioned, so
  columns follow ownership (the gradient layout's holders) instead of LPT: a
  layer's gradient workers are the column(s) of the rank(s) whose partition
  holds its gradient, and nothing travels along rows (each holder writes its
  own partition).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..config import KFACConfigError

PRESET_FRACTIONS = {"comm-opt": 1.0, "hybrid-opt": 0.5}


@dataclass(frozen=True)
class LayerShape:
    """A Kronecker-factored layer: factors of sizes ``a_dim`` and ``g_dim``."""

    name: str
    a_dim: int
    g_dim: int

    def costs(self, power: int) -> tuple[float, ...]:
        """The decomposition cost of each factor: ``dim^power``."""
        return float(self.a_dim) ** power, float(self.g_dim) ** power


@dataclass(frozen=True)
class UnitShape:
    """A block of ``units`` independent ``size x size`` matrices decomposed together (unit-wise BatchNorm)."""

    name: str
    units: int
    size: int

    def costs(self, power: int) -> tuple[float, ...]:
        return (self.units * float(self.size) ** power,)


Shape = Union[LayerShape, UnitShape]


@dataclass(frozen=True)
class LayerPlacement:
    """Ranks (within the data-parallel group) doing one layer's work."""

    a_worker: int
    g_worker: int
    column: int
    grad_workers: tuple[int, ...]


def workers_per_layer(fraction: Union[str, float], world: int) -> int:
    """``n``, the number of gradient workers per layer, checked to divide ``world``."""
    if fraction == "auto":
        raise KFACConfigError(
            "kfac.grad_worker_fraction='auto' is chosen by ds_kfac.initialize from kfac.calibration, before K-FAC "
            "starts; a KFACPreconditioner built directly needs a fraction or a preset (comm-opt, hybrid-opt, mem-opt)"
        )
    if fraction == "mem-opt":
        return 1
    value = PRESET_FRACTIONS.get(fraction, fraction) if isinstance(fraction, str) else fraction
    n = value * world
    if world == 1:
        return 1
    if abs(n - round(n)) > 1e-9 or round(n) < 1 or world % round(n):
        allowed = [f"{d}/{world}" for d in range(1, world + 1) if world % d == 0]
        raise KFACConfigError(
            f"kfac.grad_worker_fraction={fraction!r} with {world} data-parallel ranks gives {n:g} gradient "
            f"workers per layer; it must be a whole number dividing {world} (allowed fractions: {', '.join(allowed)})"
        )
    return round(n)


def zero3_problem(fraction: Union[str, float], world: int) -> Optional[str]:
    """Why ZeRO stage 3 cannot run ``fraction`` on ``world`` ranks (``None``: it can): each layer's gradient is
    gathered to one gradient worker there."""
    n = workers_per_layer(fraction, world)
    if n == 1:
        return None
    return (
        f"kfac.grad_worker_fraction={fraction!r} ({n} gradient workers per layer) at ZeRO stage 3, where each "
        f'layer\'s gradient is gathered to one gradient worker: use "grad_worker_fraction": "mem-opt"'
    )


def lpt(costs: Sequence[float], bins: int, initial: Sequence[float] = ()) -> tuple[list[int], list[float]]:
    """Greedy longest-processing-time: each item, largest first (ties: lower index), to the
    least-loaded bin (ties: lower bin). Returns the bin of each item and the bin loads."""
    loads = list(initial) or [0.0] * bins
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    assignment = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        assignment[i] = b
        loads[b] = load + costs[i]
        heapq.heappush(heap, (loads[b], b))
    return assignment, loads


class PlacementPlan:
    """The placement of every layer; see the module docstring."""

    def __init__(
        self,
        layers: Sequence[Shape],
        world: int,
        grad_worker_fraction: Union[str, float] = "comm-opt",
        assignment: str = "compute",
        colocate: bool = False,
        holders: Optional[dict[str, tuple[int, ...]]] = None,
    ) -> None:
        self.world = world
        self.n = workers_per_layer(grad_worker_fraction, world)
        self.owners = holders is not None and self.n < world
        """Whether gradient workers follow ZeRO ownership (``holders`` given and fewer workers than ranks)."""
        self.columns = world // self.n
        if self.owners:
            self._place_on_holders(layers, holders, assignment, colocate)
            return
        power = 3 if assignment == "compute" else 2
        # Per layer, the cost of each item placed on its own rank: one for a colocated or one-statistic block.
        items_of = [c if len(c) > 1 and not colocate else (sum(c),) for c in (s.costs(power) for s in layers)]
        column_of, _ = lpt([sum(c) for c in items_of], self.columns)
        self.rank_loads = [0.0] * world
        self.layers: dict[str, LayerPlacement] = {}
        for k in range(self.columns):
            members = list(self._column_members(k))
            mine = [i for i, c in enumerate(column_of) if c == k]
            where, loads = lpt([c for i in mine for c in items_of[i]], self.n)
            for m, load in zip(members, loads):
                self.rank_loads[m] = load
            at = 0
            for i in mine:
                a, g = where[at], where[at + len(items_of[i]) - 1]
                at += len(items_of[i])
                self.layers[layers[i].name] = LayerPlacement(members[a], members[g], k, tuple(members))

    def _place_on_holders(
        self, layers: Sequence[Shape], holders: dict[str, tuple[int, ...]], assignment: str, colocate: bool
    ) -> None:
        """ZeRO 1/2 ownership: a layer's gradient workers are the columns of the ranks whose
        partitions hold its gradient (with ``mem-opt`` just those ranks: one, or two or more
        where ZeRO split it). Its decompositions go to the least loaded of its workers,
        largest first. Preconditioned gradients then never move: each holder writes its own
        partition and ZeRO's parameter all-gather delivers the update."""
        missing = [s.name for s in layers if not holders.get(s.name)]
        if missing:
            raise ValueError(f"no data-parallel rank holds the gradient of K-FAC layers {missing}")
        workers_of = {
            s.name: tuple(sorted({m for h in holders[s.name] for m in self._column_members(h // self.n)}))
            for s in layers
        }
        power = 3 if assignment == "compute" else 2
        items = []  # (cost, layer index, sides)
        for i, s in enumerate(layers):
            costs = s.costs(power)
            if colocate or len(costs) == 1:
                items.append((sum(costs), i, "AG"))
            else:
                items += [(costs[0], i, "A"), (costs[1], i, "G")]
        self.rank_loads = [0.0] * self.world
        workers: dict[tuple[int, str], int] = {}
        for cost, i, sides in sorted(items, key=lambda item: (-item[0], item[1], item[2])):
            rank = min(workers_of[layers[i].name], key=lambda r: (self.rank_loads[r], r))
            self.rank_loads[rank] += cost
            for side in sides:
                workers[(i, side)] = rank
        self.layers = {
            s.name: LayerPlacement(workers[(i, "A")], workers[(i, "G")], -1, workers_of[s.name])
            for i, s in enumerate(layers)
        }

    def _column_members(self, column: int) -> tuple[int, ...]:
        return tuple(range(column * self.n, (column + 1) * self.n))

    def is_grad_worker(self, name: str, rank: int) -> bool:
        return rank in self.layers[name].grad_workers

    def broadcast_sets(self) -> list[tuple[int, ...]]:
        """The rank sets that exchange decompositions or gradients (each needs a process group)."""
        if self.owners:
            return sorted({p.grad_workers for p in self.layers.values() if len(p.grad_workers) > 1})
        columns = [self._column_members(k) for k in range(self.columns)]
        rows = [tuple(range(j, self.world, self.n)) for j in range(self.n)]
        return [m for m in columns + rows if len(m) > 1]

    def row(self, rank: int) -> int:
        return rank % self.n

    def row_members(self, row: int) -> list[int]:
        return list(range(row, self.world, self.n))

    def sender_to(self, name: str, rank: int) -> int:
        """The gradient worker of layer ``name`` in ``rank``'s row (it broadcasts P(g) along the row)."""
        return self.layers[name].column * self.n + self.row(rank)

    @property
    def replicated(self) -> bool:
        """Every rank is a gradient worker of every layer (``comm-opt``)."""
        return not self.owners and self.n == self.world

    def makespan_ratio(self) -> float:
        """max / mean of the decomposition cost assigned to each rank (1.0 is perfect balance)."""
        mean = sum(self.rank_loads) / len(self.rank_loads)
        return max(self.rank_loads) / mean if mean > 0 else 1.0
