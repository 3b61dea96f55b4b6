"""Two candidate terms of the step-time model (issue 68), tried on every recorded calibration before either is built.

Each ``step_cost.py run --predict`` result under ``benchmarks/results/issue68/calibration/`` holds a measured step
and the calibration it was predicted from. This re-predicts each from its own calibration with the current
predictor (:func:`ds_kfac.planning.predict.predict_plan`), then twice more:

* ``stepwise``: a step waits for that step's slowest rank. The overhead is the mean over the refresh cycle of the
  slowest rank's phases, each rank's decompositions at the steps ``refresh_spread`` gives them
  (:func:`~ds_kfac.preconditioning.spread.spread_slots`; all at the cycle's first step without it), instead of the
  slowest rank's mean over the cycle;
* ``timed_eigh``: each rank's share of the decompositions by each side's ``eigh`` seconds, timed here at the
  sides' sizes (one thread, the median of ``--repeats``), instead of by ``dim^3``.

::

    python benchmarks/model_terms.py --out benchmarks/results/issue68/model_terms.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_cost  # noqa: E402

from ds_kfac.curvature import CurvatureBlock  # noqa: E402
from ds_kfac.placement import RankRoles  # noqa: E402
from ds_kfac.planning import plan_job, read_job  # noqa: E402
from ds_kfac.planning.predict import Calibration, PlacementTime, predict_plan  # noqa: E402
from ds_kfac.preconditioning.spread import spread_slots  # noqa: E402

RESULTS = "benchmarks/results/issue68/calibration"


def eigh_seconds(dim: int, repeats: int) -> float:
    """The median seconds of one ``eigh`` of a ``dim x dim`` symmetric positive-definite matrix."""
    x = torch.randn(dim, dim, generator=torch.Generator().manual_seed(dim))
    matrix = x @ x.T / dim + torch.eye(dim)
    torch.linalg.eigh(matrix)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.linalg.eigh(matrix)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def side_weights(
    blocks: Sequence[CurvatureBlock], weight: Callable[[int, float], float]
) -> dict[tuple[str, str], float]:
    """Each side's decomposition weight: ``weight(dim, count)`` of its ``count`` matrices of size ``dim`` (one for a
    Kronecker or one-sided block's side, the units of a unit-wise block), read from its ``dim^2`` and ``dim^3`` costs."""
    out = {}
    for b in blocks:
        for side, square, cube in zip(b.sides, b.costs(2), b.costs(3)):
            dim = round(cube / square)
            out[(b.name, side)] = weight(dim, square / dim**2)
    return out


def cubes(dim: int, count: float) -> float:
    """The ``dim^3`` weight of ``count`` matrices of size ``dim``, as the predictor weighs decompositions."""
    return count * dim**3


def decompose_compute(
    calibration: Calibration, roles: Sequence[RankRoles], weights: dict[tuple[str, str], float], period: int
) -> list[float]:
    """Each rank's decomposition seconds a step (the calibration's, split by ``weights``), as the predictor does."""
    total = sum(weights.values())
    scale = calibration.phases.get("decompose", 0.0) * calibration.cadence["inv_update_steps"] / period
    return [scale * sum(w for (n, s), w in weights.items() if r.decomposes(n, s)) / total for r in roles]


def stepwise(time_: PlacementTime, roles: Sequence[RankRoles], blocks: Sequence[CurvatureBlock], spread: bool,
             period: int, compute: list[float]) -> float:  # fmt: skip
    """The mean over the cycle of the slowest rank's step, each rank's decompositions at their steps."""
    decomposer = roles[0].decomposer
    slots = spread_slots(blocks, period, decomposer) if spread else {}
    loads = [[0.0] * period for _ in roles]
    for (name, side), c in side_weights(blocks, cubes).items():
        loads[decomposer(name, side)][slots.get((name, side), 0)] += c
    steps = []
    for s in range(period):
        ranks = []
        for r, phases in enumerate(time_.ranks):
            own = sum(loads[r])
            at = compute[r] * period * loads[r][s] / own if own else 0.0
            ranks.append(sum(phases.values()) - compute[r] + at)
        steps.append(max(ranks))
    return sum(steps) / period


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    timed: dict[int, float] = {}

    def timed_eigh(dim: int, count: float) -> float:
        if dim not in timed:
            timed[dim] = eigh_seconds(dim, args.repeats)
        return count * timed[dim]

    rows = []
    for path in sorted((ROOT / RESULTS).glob("*.json")):
        result = json.loads(path.read_text())
        for c in result["configurations"]:
            if "predicted" not in c:
                continue
            model = step_cost.WORKLOADS[c["workload"]].build(result["settings"]["smoke"])
            calibration = Calibration.load_dict(c["predicted"]["calibration"])
            job = read_job({"train_micro_batch_size_per_gpu": calibration.micro_batch,
                            "gradient_accumulation_steps": c["ga"], "kfac": c["kfac_config"]}, c["world"])  # fmt: skip
            plan = plan_job(model, job, [c["placement"]], [job.kfac.factor_reduction])
            (now,) = predict_plan(plan, calibration)
            roles, period = plan.placements[0].roles, job.kfac.inv_update_steps
            cubic = decompose_compute(calibration, roles, side_weights(plan.blocks, cubes), period)
            by_eigh = decompose_compute(calibration, roles, side_weights(plan.blocks, timed_eigh), period)
            eigh_total = max(sum(p.values()) - a + b for p, a, b in zip(now.ranks, cubic, by_eigh))
            measured = step_cost.kfac_ms(c)
            row = {
                "file": path.name, "placement": c["placement"], "world": c["world"],
                "spread": job.kfac.refresh_spread, "measured_ms": measured, "predicted_ms": 1e3 * now.overhead,
                "stepwise_ms": 1e3 * stepwise(now, roles, plan.blocks, job.kfac.refresh_spread, period, cubic),
                "timed_eigh_ms": 1e3 * eigh_total,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "command": shlex.join(["python", "benchmarks/model_terms.py", *args.argv]),
        "eigh_ms": {str(d): 1e3 * s for d, s in sorted(timed.items())},
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| run | placement | ranks | measured ms | predicted / measured | stepwise | timed eigh |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["rows"]:
        m = r["measured_ms"]
        lines.append(f"| {r['file']} | {r['placement']} | {r['world']} | {m:.1f} | {r['predicted_ms'] / m:.2f} "
                     f"| {r['stepwise_ms'] / m:.2f} | {r['timed_eigh_ms'] / m:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
