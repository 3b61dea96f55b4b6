"""K-FAC's seconds per step under each placement, predicted from measurements on the user's own hardware.

A :class:`Calibration` holds what ``python -m ds_kfac.plan --calibrate`` measured (:mod:`.calibrate`): K-FAC's
seconds per step by phase with the whole model on one rank (the real preconditioner, the job's ``"kfac"`` section,
averaged over a refresh cycle), the forward and backward's, and a latency and a per-byte time for each collective
kind across the launched ranks. :func:`predict_plan` splits each compute phase over the ranks by what the placement
gives each rank (from :class:`~ds_kfac.placement.RankRoles`, as the planner's byte counts do) in proportion to each
layer's arithmetic, and adds the time of every collective the rank takes part in:

* ``hooks`` (the factors' outer products): the layers the rank collects, weighted ``a^2 + g^2``; the sampled
  Fisher's extra backward (``sampled_backward``) as the hooks;
* ``factors`` (the running averages): the statistics it stores, weighted ``dim^2``;
* ``decompose``: the sides it decomposes, weighted by their decomposition cost (``dim^3``), plus the broadcasts of
  decompositions it sends or receives (per refresh, over the refresh interval);
* ``rebase`` and ``stack``: the layers it preconditions, whose new bases it installs (the moments re-expressed:
  ``dim^3`` a side for the change of basis and ``2 g a (g + a)`` for the moments) and stacks (``a^2 + g^2``), per
  refresh, over the refresh interval;
* ``precondition``: the layers it preconditions, weighted ``g a (g + a)``, plus the broadcast of ``P(g)`` along its
  row when not every rank is a gradient worker, or at ZeRO 3 the two all-to-alls of the gradients' slices;
* ``factor_comm``: the factor reduction (per factor-update step, over the interval), not credited with overlap.

A step waits for its slowest rank at its collectives, so a placement's predicted overhead is the largest rank's sum.
The model and its assumptions are in docs/placement.md ("Time: calibrate").
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence, Union

from torch import nn

from ..comm import DEFAULT_BUCKET_BYTES
from ..comm.network import Network
from ..config import KFACConfig
from ..curvature import CurvatureBlock
from ..placement import RankRoles
from ..placement.decompositions import shared_sides
from ..placement.factors import PRESENCE_DTYPE
from ..preconditioning.build import model_blocks
from .costs import BlockSizes, RankCost
from .placements import PlacementCost, Plan

COMPUTE_PHASES = ("hooks", "sampled_backward", "factors", "decompose", "rebase", "stack", "precondition")
"""K-FAC's phases (:data:`ds_kfac.timing.PHASES`) that the calibration measures on one rank and splits by layer."""
REPORTED_PHASES = ("hooks", "factor_comm", "factors", "decompose", "precondition")
"""The phases the tables show (:func:`reported`)."""


def reported(phases: dict[str, float]) -> dict[str, float]:
    """``phases`` (measured or predicted seconds or ms, by :data:`ds_kfac.timing.PHASES`) as the tables show them:
    ``rebase`` and ``stack`` counted in ``decompose``, the sampled Fisher's backward in ``hooks``."""
    out = {p: phases.get(p, 0.0) for p in REPORTED_PHASES}
    out["decompose"] += phases.get("rebase", 0.0) + phases.get("stack", 0.0)
    out["hooks"] += phases.get("sampled_backward", 0.0)
    return out


@dataclass(frozen=True)
class Link:
    """One collective kind's time: ``latency`` seconds per call plus ``per_byte`` seconds per payload byte."""

    latency: float
    per_byte: float

    def seconds(self, calls: float, nbytes: float) -> float:
        return calls * self.latency + nbytes * self.per_byte


@dataclass
class Calibration:
    """What ``--calibrate`` measured on one device kind and one set of launched ranks."""

    device: str
    world: int
    """Ranks the links were measured across."""
    phases: dict[str, float]
    """K-FAC's seconds per step by phase, every layer on one rank, averaged over a refresh cycle."""
    forward_backward: float
    """Seconds per step of the model's forward and backward passes (all micro-batches, without K-FAC's hooks)."""
    accumulation: int
    """Micro-batches per step in that measurement."""
    micro_batch: int
    """Examples per micro-batch in that measurement (the factors' products scale with it)."""
    collected: int
    """Micro-batches a factor-update step collected factors from in that measurement (``factor_micro_batches``)."""
    cadence: dict[str, int]
    """The ``factor_update_steps`` and ``inv_update_steps`` the phases were measured at."""
    links: dict[str, Link] = field(default_factory=dict)
    """``all_reduce``, ``broadcast`` (a reduce is timed as a broadcast: one tree) and ``all_to_all`` (its bytes: those
    a rank sends to the others)."""
    samples: dict[str, list[list[float]]] = field(default_factory=dict)
    """Each link's measured ``[bytes, seconds]`` pairs, kept for the record."""

    layers: list[list[int]] = field(default_factory=list)
    """``[a_dim, g_dim]`` of each K-FAC layer of the model measured (:func:`layer_shapes`): ``"auto"`` refuses to
    predict another model's step from it."""
    network: str = ""
    """A stated network (``ds_kfac.comm.network``'s ``latency=...,bandwidth=...``) that replaces the measured
    links in predictions: a cluster's interconnect, for predictions at world sizes not launched."""

    def forward_backward_for(self, micro_batch: int, accumulation: int) -> float:
        """The forward and backward's seconds a step at another micro-batch and accumulation (in proportion to the
        examples)."""
        return self.forward_backward * micro_batch * accumulation / (self.micro_batch * self.accumulation)

    def seconds(self, kind: str, calls: int, nbytes: float, world: int) -> float:
        """``calls`` collectives of ``kind`` carrying ``nbytes`` in all among ``world`` ranks: by the measured
        link, or by the stated network's algorithms (the bytes split evenly over the calls)."""
        if not calls:
            return 0.0
        if self.network:
            return calls * Network.parse(self.network).seconds(kind, nbytes / calls, world)
        link = self.links.get("broadcast" if kind == "reduce" else kind)
        if link is None:
            raise ValueError(
                f"the calibration has no {kind} link (measured by an older ds_kfac): calibrate again, or predict on "
                f"a stated network (--network)"
            )
        return link.seconds(calls, nbytes)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> Calibration:
        return cls.load_dict(json.loads(Path(path).read_text()))

    @classmethod
    def load_dict(cls, data: dict) -> Calibration:
        """A calibration from its JSON object (:meth:`save`'s); a ``ValueError`` names the fields it lacks."""
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
        missing = [name for name in [*required, "links"] if name not in data]
        unknown = set(data) - {f.name for f in fields}
        if missing or unknown:
            wrong = [f"{what} {keys}" for what, keys in (("missing", missing), ("unknown", sorted(unknown))) if keys]
            raise ValueError(f"not a saved calibration: {', '.join(wrong)}")
        return cls(**{**data, "links": {kind: Link(**link) for kind, link in data["links"].items()}})


def layer_shapes(model: nn.Module, config: KFACConfig) -> list[list[int]]:
    """``[a_dim, g_dim]`` of each layer ``config`` registers in ``model``, sorted (the same for any names)."""
    return sorted([b.adapter.a_dim, b.adapter.g_dim] for b in model_blocks(model, config)[0])


def arithmetic(block: CurvatureBlock) -> dict[str, float]:
    """``block``'s arithmetic in each compute phase, the weights the phases are split by (module docstring): the
    factors' running averages and decompositions by the block's own per-side costs (a one-sided block stores and
    decomposes one side, a unit-wise block ``g`` small ones)."""
    a, g = block.adapter.a_dim, block.adapter.g_dim
    products = a * a + g * g
    return {
        "hooks": products,
        "sampled_backward": products,
        "factors": sum(block.costs(2)),
        "decompose": sum(block.costs(3)),
        "rebase": sum(block.costs(3)) + 2 * g * a * (g + a),
        "stack": products,
        "precondition": g * a * (g + a),
    }


def _share(blocks: Sequence[CurvatureBlock], roles: RankRoles) -> dict[str, float]:
    """The fraction of each compute phase's arithmetic (:func:`arithmetic`) that ``roles``' rank does."""
    mine = dict.fromkeys(COMPUTE_PHASES, 0.0)
    total = dict.fromkeys(COMPUTE_PHASES, 0.0)
    for b in blocks:
        weights = arithmetic(b)
        preconditions = roles.rank in roles.preconditioners(b)
        collects = roles.collects(b)
        for phase, does in (("hooks", collects), ("sampled_backward", collects), ("precondition", preconditions),
                            ("rebase", preconditions), ("stack", preconditions)):  # fmt: skip
            total[phase] += weights[phase]
            mine[phase] += weights[phase] * does
        for side, memory, cost in zip(b.sides, b.costs(2), b.costs(3)):
            total["factors"] += memory
            mine["factors"] += memory * roles.stores_factor(b, side)
            total["decompose"] += cost
            mine["decompose"] += cost * roles.decomposes(b.name, side)
    return {phase: mine[phase] / total[phase] if total[phase] else 0.0 for phase in COMPUTE_PHASES}


def _calls(nbytes: float, bucket_bytes: int) -> int:
    return math.ceil(nbytes / bucket_bytes) if nbytes else 0


def predict_rank(
    calibration: Calibration,
    blocks: Sequence[CurvatureBlock],
    sizes: dict[str, BlockSizes],
    roles: RankRoles,
    cost: RankCost,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    rows: float = 1.0,
    spread: bool = False,
) -> dict[str, float]:
    """``roles``' rank's predicted seconds per step by phase (a mean over a refresh cycle at the job's cadence);
    ``rows``: the examples a factor-update step collects from, the job's over the calibration's (the factors'
    products scale with them); ``spread``: ZeRO 3's gradients (:class:`~.costs.Gradients`)."""
    config = roles.config
    factor_every = config.factor_update_steps
    refresh_every = config.inv_update_steps if isinstance(config.inv_update_steps, int) else factor_every
    measured_refresh = calibration.cadence["inv_update_steps"]
    share = _share(blocks, roles)
    out = {}
    for phase in COMPUTE_PHASES:
        seconds = calibration.phases.get(phase, 0.0) * share[phase]
        if phase in ("hooks", "sampled_backward", "factors"):  # at the calibration's factor cadence: the job's
            seconds *= calibration.cadence["factor_update_steps"] / factor_every * (rows if phase != "factors" else 1)
        if phase in ("decompose", "rebase", "stack"):
            seconds *= measured_refresh / refresh_every
        out[phase] = seconds
    world = roles.world
    flags = len(blocks) * PRESENCE_DTYPE.itemsize if world > 1 else 0  # which layers a rank saw: one call more
    reduction = 0.0  # this rank's payload of each kind of the factor reduction, every factor step
    for kind, n in cost.factor_step.items():
        calls = _calls(n - flags, bucket_bytes) + 1 if kind == "all_reduce" else _calls(n, bucket_bytes)
        reduction += calibration.seconds(kind, calls, n, world)
    out["factor_comm"] = reduction / factor_every
    shared = shared_sides(roles, blocks, {b.name: set(b.sides) for b in blocks})  # sent or received at a refresh
    groups = {(roles.decomposer(b.name, side), holders) for b, side, holders in shared}  # one broadcast each
    moved = sum(sizes[b.name].sides[side] for b, side, _ in shared)
    width = max((len(holders) for _, holders in groups), default=1)
    out["decompose"] += calibration.seconds("broadcast", len(groups), moved, width) / refresh_every
    row = roles.plan.row_members(roles.plan.row(roles.rank))
    if roles.shares_along_rows and roles.holders is None and len(row) > 1 and not spread:  # P(g) along the row
        senders = {roles.plan.sender_to(b.name, roles.rank) for b in blocks}
        moved = sum(sizes[b.name].matrix for b in blocks)
        out["precondition"] += calibration.seconds("broadcast", len(senders), moved, len(row))
    summed = cost.every_step.get("all_reduce", 0)  # the KL clip's sum, ZeRO 1/2's split layers assembled
    out["precondition"] += calibration.seconds("all_reduce", 1 if summed else 0, summed, world)
    if spread and world > 1:  # ZeRO 3: the gradients' slices to their workers and P(g)'s back, every rank
        out["precondition"] += calibration.seconds("all_to_all", 2, cost.every_step.get("all_to_all", 0), world)
    return out


def collected(config: KFACConfig, accumulation: int) -> int:
    """Micro-batches a factor-update step collects factors from: ``factor_micro_batches``, by default all."""
    return min(config.factor_micro_batches or accumulation, accumulation)


@dataclass
class PlacementTime:
    """One placement's predicted seconds per step: each rank's phases, and the step's (its slowest rank's)."""

    fraction: Union[str, float]
    reduction: str
    ranks: list[dict[str, float]]
    refused: str = ""

    @property
    def overhead(self) -> float:
        return max((sum(r.values()) for r in self.ranks), default=math.nan)

    @property
    def slowest(self) -> dict[str, float]:
        """The slowest rank's seconds by phase (the one the step waits for)."""
        return max(self.ranks, key=lambda r: sum(r.values()))


def predict_plan(plan: Plan, calibration: Calibration, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[PlacementTime]:
    """Every placement of ``plan`` (:func:`~ds_kfac.planning.plan_job`'s), every rank, predicted."""
    job = plan.job
    out = []
    for placement in plan.placements:
        if placement.refused:
            out.append(PlacementTime(placement.fraction, placement.reduction, [], placement.refused))
            continue
        examples = collected(placement.roles[0].config, job.accumulation) * job.micro_batch
        examples /= calibration.collected * calibration.micro_batch
        ranks = [
            predict_rank(
                calibration, plan.blocks, plan.sizes, roles, cost, bucket_bytes, examples, plan.gradients.spread
            )
            for roles, cost in zip(placement.roles, placement.ranks)
        ]
        out.append(PlacementTime(placement.fraction, placement.reduction, ranks))
    return out


def fastest(plan: Plan, times: Sequence[PlacementTime]) -> tuple[PlacementCost, PlacementTime]:
    """The placement with the least predicted overhead among those at the job's own ``factor_reduction`` (another
    reduction changes the math; the first listed wins a tie): the CLI's recommendation and ``"auto"``'s choice."""
    placed = [(p, t) for p, t in zip(plan.placements, times) if not t.refused]
    same = [(p, t) for p, t in placed if p.reduction == plan.job.kfac.factor_reduction]
    return min(same or placed, key=lambda pt: pt[1].overhead)
