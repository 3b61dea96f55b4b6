"""The planner's tables: memory per rank and bytes per rank and step, one row per placement."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .costs import RankCost
from .placements import PlacementCost, Plan
from .predict import REPORTED_PHASES, Calibration, PlacementTime, fastest, reported

HELD = ("factors", "decompositions", "eigenbasis_moments")
"""The memory categories with a column of their own; the others (``S``, ``eigen-outer``'s cache, adaptive refresh's
references) are summed in "other"."""
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def unit_for(largest: float) -> tuple[str, int]:
    """The largest unit in which ``largest`` bytes is at least 1000 (so that the smaller rows keep their digits)."""
    return next(((name, size) for name, size in UNITS if largest >= 1000 * size), UNITS[-1])


def held(cost: RankCost) -> int:
    return sum(cost.memory.values())


def per_step(cost: RankCost, factor_every: int, refresh_every: int) -> float:
    """Bytes this rank sends per step on average at a fixed cadence."""
    total = sum(cost.every_step.values()) + sum(cost.factor_step.values()) / factor_every
    return total + sum(cost.refresh.values()) / refresh_every


def label(p: PlacementCost, plan: Plan) -> str:
    mine = (p.fraction, p.reduction) == (plan.job.kfac.grad_worker_fraction, plan.job.kfac.factor_reduction)
    return f"{p.fraction} (n={p.workers}) {p.reduction}{' *' if mine else ''}"


def render(plan: Plan, title: str, per_rank: bool = False) -> str:
    """The plan as text: the job, then memory and traffic per rank for every placement (``per_rank``: every rank's
    line, not only the largest and smallest)."""
    job, kfac = plan.job, plan.job.kfac
    fus = kfac.at("factor_update_steps", 0)
    ius = None if kfac.inv_update_steps == "adaptive" else kfac.at("inv_update_steps", 0)
    lines = [
        f"K-FAC plan: {title} on {job.world} data-parallel ranks, ZeRO stage {job.zero_stage}, "
        f"{DTYPE_NAMES[job.param_dtype]}",
        f"  micro-batch {job.micro_batch} x accumulation {job.accumulation} x {job.world} ranks "
        f"= {job.micro_batch * job.accumulation * job.world} examples per step; factors every {fus} steps, "
        + (f"decompositions every {ius}" if ius else "decompositions on adaptive intervals"),
        f"  {len(plan.blocks)} K-FAC layers ({kfac.compute_method}, factors {kfac.factor_dtype}, decompositions "
        f"{kfac.inv_dtype}{', eigenbasis moments' if kfac.eigenbasis_moments else ''}); "
        f"skipped: {', '.join(s.name for s in plan.skipped) or 'none'}",
    ]
    if plan.split:
        lines.append(
            f"  ZeRO {job.zero_stage} splits {len(plan.split)} of them across ranks' partitions: their gradients "
            f"({plan.gradients.split_elements:,} elements) are assembled (all-reduced) every step"
        )
    placed = [p for p in plan.placements if not p.refused]
    costs = [c for p in placed for c in p.ranks]
    if costs:
        lines += ["", *_memory(plan, placed, per_rank), "", *_traffic(plan, placed, per_rank, fus, ius)]
        start = max(sum(c.start.values()) for c in costs)
        first = max(sum(c.first_step.values()) for c in costs)
        once = [f"{_amount(first)} at the first step (the engine's check that preconditioning reached the gradients)"]
        once += [f"{_amount(start)} in initialize (which rank's ZeRO partition holds each parameter)"] if start else []
        lines.append(f"Once per run, per rank at most: {'; '.join(once)}.")
    lines += [
        f"{p.fraction} {p.reduction}: refused: {p.refused.splitlines()[-1].strip()}"
        for p in plan.placements
        if p.refused
    ]
    lines.append("* the placement the config asks for.")
    return "\n".join(lines)


def _amount(nbytes: int) -> str:
    unit, size = next(((name, size) for name, size in UNITS if nbytes >= size), UNITS[-1])
    return f"{nbytes / size:.1f} {unit}"


def _rows(
    plan: Plan, placed: Sequence[PlacementCost], per_rank: bool, key: Callable[[RankCost], float]
) -> list[tuple[str, RankCost]]:
    """Per placement, the rank ``key`` puts largest (and the smallest, where it differs), or every rank."""
    rows = []
    for p in placed:
        ranked = sorted(p.ranks, key=lambda c: (-key(c), c.rank))
        chosen = p.ranks if per_rank else [ranked[0]] + ([ranked[-1]] if key(ranked[-1]) != key(ranked[0]) else [])
        rows += [(f"{label(p, plan)}{'' if len(ranked) == 1 else f', rank {c.rank}'}", c) for c in chosen]
    return rows


def _table(header: Sequence[str], rows: list[tuple[str, list[float]]], unit: tuple[str, int]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    out = [f"{'':{width}}  " + "  ".join(f"{h:>14}" for h in header)]
    out += [f"{name:{width}}  " + "  ".join(f"{v / unit[1]:14,.1f}" for v in values) for name, values in rows]
    return out


def _memory(plan: Plan, placed: Sequence[PlacementCost], per_rank: bool) -> list[str]:
    columns = [c for c in HELD if any(r.memory[c] for p in placed for r in p.ranks)]
    other = any(held(r) > sum(r.memory[c] for c in columns) for p in placed for r in p.ranks)
    rows = []
    for name, c in _rows(plan, placed, per_rank, held):
        values = [c.memory[k] for k in columns] + ([held(c) - sum(c.memory[k] for k in columns)] if other else [])
        rows.append((name, [*values, held(c), c.buffers["accumulators"], c.buffers["factor_buckets"]]))
    unit = unit_for(max(v for _, values in rows for v in values) or 1)
    header = [*(c.replace("eigenbasis_", "") for c in columns), *(["other"] if other else []), "held"]
    return [
        f"Memory per rank, {unit[0]} (the largest rank, and the smallest where they differ): held between steps"
        + (" (other: eigenvalue corrections, eigen-outer's cache, refresh references)" if other else "")
        + "; during a step, the accumulators, which move into the factor reduction's buckets layer by layer in the "
        "last micro-batch's backward",
        *_table([*header, "accumulators", "buckets"], rows, unit),
    ]


def _traffic(plan: Plan, placed: Sequence[PlacementCost], per_rank: bool, fus: int, ius: Optional[int]) -> list[str]:
    """``ius`` ``None``: adaptive refresh, counted as a refresh of every factor at every step (an upper bound)."""

    def mean(c: RankCost) -> float:
        return per_step(c, fus, ius or 1)

    rows = [
        (name, [sum(c.every_step.values()), sum(c.factor_step.values()), sum(c.refresh.values()), mean(c)])
        for name, c in _rows(plan, placed, per_rank, mean)
    ]
    unit = unit_for(max(v for _, values in rows for v in values) or 1)
    return [
        f"Bytes per rank into K-FAC's collectives, {unit[0]} (payload, as ds_kfac.comm.STATS counts): every step, "
        f"more on a factor-update step, more on a decomposition step, and the mean per step"
        + ("" if ius else " (adaptive refresh: at most, as if every factor were due at every step)"),
        *_table(["every step", "+ factor step", "+ refresh", "mean per step"], rows, unit),
    ]


def render_times(plan: Plan, times: Sequence[PlacementTime], calibration: Calibration, refresh_budget: float) -> str:
    """The predicted seconds per step of each placement (its slowest rank's phases), the recommended placement
    and refresh interval: the placement with the least overhead, and the shortest interval on a ladder around the
    configured one at which the decompositions cost at most ``refresh_budget`` of the step's forward and backward."""
    job = plan.job
    base = calibration.forward_backward_for(job.micro_batch, job.accumulation)
    placed = [(p, t) for p, t in zip(plan.placements, times) if not t.refused]
    rows = []
    for p, t in placed:
        phases = reported(t.slowest)
        values = [1e3 * phases[k] for k in REPORTED_PHASES]
        rows.append((label(p, plan), [*values, 1e3 * t.overhead, 100 * t.overhead / base]))
    width = max(len(name) for name, _ in rows)
    header = [*REPORTED_PHASES, "K-FAC ms", "% of fwd+bwd"]
    lines = [
        f"Predicted K-FAC time per step on {job.world} ranks, ms (the slowest rank; calibrated on "
        f"{calibration.world} x {calibration.device}: forward and backward {1e3 * base:,.1f} ms a step at "
        f"accumulation {job.accumulation})",
        f"{'':{width}}  " + "  ".join(f"{h:>12}" for h in header),
        *(f"{name:{width}}  " + "  ".join(f"{v:12,.2f}" for v in values) for name, values in rows),
    ]
    best_p, best_t = fastest(plan, times)
    refresh = job.kfac.inv_update_steps if isinstance(job.kfac.inv_update_steps, int) else None
    advice = f"Recommended: grad_worker_fraction {best_p.fraction!r}, factor_reduction {best_p.reduction!r}"
    if refresh:
        per_refresh = reported(best_t.slowest)["decompose"] * refresh  # seconds per decomposition step
        ladder = sorted({max(1, refresh // 4), max(1, refresh // 2), refresh, 2 * refresh, 4 * refresh})
        fits = [k for k in ladder if per_refresh / k <= refresh_budget * base]
        chosen = fits[0] if fits else ladder[-1]
        advice += (
            f"; inv_update_steps {chosen} (decompositions {1e3 * per_refresh / chosen:,.2f} ms a step, at most "
            f"{100 * refresh_budget:g}% of the forward and backward; configured: {refresh})"
        )
    return "\n".join([*lines, advice + "."])
