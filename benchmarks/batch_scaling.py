"""Batch scaling: steps and wall seconds to a fixed held-out target against the global batch, one line per optimizer.

Each point of a ladder of global batches (reached by gradient accumulation, ``micro x accumulation x 2
ranks``) trains the real example through the ``deepspeed`` launcher for every arm of the ladder, each over
its own learning-rate grid; a run's budget is a fixed number of training samples (so ``samples / batch``
steps, its schedule compressed to them) or, where the ladder says so, a number of steps per batch; its time
to target is the first crossing of the fixed ``--target`` by its held-out curve (interpolated, as
``time_to_target.py`` does). The best learning rate of each arm at each batch is the one reaching the target
in the fewest steps; ``--seeds`` beyond the first re-run only those best points (an arm given one rate re-runs
it on every seed, reached or not). The arms run in an order rotated by one at every grid point::

    python benchmarks/batch_scaling.py run resnet --batches 256 1024 4096 --lrs 0.2 0.4 0.8
    python benchmarks/batch_scaling.py run resnet --batches 1024 --lrs 0.4 --seeds 0 1 2
    python benchmarks/batch_scaling.py run bert-phase2 --size 2x128 --batches 256 1024 2048 \
        --arm-lrs adamw=0.004,0.008,0.016 --arm-lrs soap=0.004,0.008,0.016 --arm-lrs kfac=0.004,0.008,0.016
    python benchmarks/batch_scaling.py table benchmarks/results/batch_scaling_resnet.json
    python benchmarks/batch_scaling.py table benchmarks/results/batch_scaling_resnet.json --target 0.98
    python benchmarks/batch_scaling.py merge benchmarks/results/batch_scaling_bert.json \
        runs/bs_256/batch_scaling_bert.json runs/bs_256_08/batch_scaling_bert.json

The ladders: ``resnet`` and ``bert`` (BERT phase 1 from scratch) have two arms, the base optimizer and the same
with K-FAC; ``resnet-peers`` adds SOAP between SGD and K-FAC at 1,024 and 4,096 (budgets 120 and 60 steps);
``bert-phase2`` is the BERT demo's phase 2 at a size of ``benchmarks/ladder.py``'s (``--size``, from
that size's LAMB phase-1 checkpoint, built once) with tuned AdamW, SOAP, DeepSpeed's JSON Muon (its ``muon_lr`` on
the grid, its Adam half's rate ``--set-arm muon:optimizer.params.adam_lr=...``) and ds_kfac's shipped config (its
Adam rate, ``adam_lr``, on the grid; Muon's rate for the three matrices K-FAC leaves stays the config's), budgets in
steps per batch (the target comes in fewer steps at larger batches) and a target per size. The first arm is the
reference the ratios divide by; K-FAC is also divided by the best other arm at each batch (``peer_ratios``).
``--arms kfac kfac+fresh --set-arm kfac+fresh:KEY=JSON`` runs a variant of an arm beside it (``batch_ladders.py``).

``merge`` joins the runs of several ``run``s of one task and target (a ladder whose learning-rate grid
differs with the batch, a grid's edge run for some arms only with ``--arms``, or more seeds) into one result, best
points and ratios recomputed. ``table --target`` scores a saved result's curves at another target (another
horizon, nothing re-run).

``run`` writes ``<out>/batch_scaling_<task>.json`` (settings, versions, every run's curve, the best point
of each arm at each batch, the ratios) and ``.png`` (log-log steps to target against the batch, one line per
arm, with the perfect-scaling line, and the wall-time panel) and prints the Markdown table that ``table`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
import ladder as sizes  # noqa: E402
import peers  # noqa: E402
from batch_ladders import (  # noqa: E402
    KFAC,
    LADDERS,
    WARMUP,
    WORLD,
    Ladder,
    arm_spec,
    budget,
    configure,
    ordered,
    parse_budgets,
)
from batch_results import best_points, merge, plot, rescore, summary, table, to_target  # noqa: E402
from time_to_target import ROOT, apply_overrides, launch, portable, read_curve, versions  # noqa: E402


def again(grid: Sequence[float], best: Optional[float]) -> Optional[float]:
    """The rate ``--seeds`` beyond the first re-run: a one-rate grid's rate whether or not the first seed reached
    the target (the rate was chosen on seed 0 before, so a miss on seed 1 is a result for seed 2 as well), else the
    first seed's best (``None``: no rate of the grid reached it, nothing to re-run)."""
    return grid[0] if len(grid) == 1 else best


def _names(ladder: Ladder, args: argparse.Namespace) -> list[str]:
    """The ladder's arms and the variants ``--arms`` names, in the ladder's order."""
    return ordered(ladder, [*ladder.arms, *(args.arms or ())])


def _grids(ladder: Ladder, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each arm's learning-rate grid: ``--arm-lrs ARM=...`` (``--kfac-lrs`` for K-FAC), else ``--lrs``, else the
    ladder's."""
    names = _names(ladder, args)
    grids = {arm: list(args.lrs or ladder.lrs) for arm in names}
    if args.kfac_lrs:
        grids[KFAC] = list(args.kfac_lrs)
    for spec in args.arm_lrs:
        arm, _, values = spec.partition("=")
        if arm not in names or not values:
            raise SystemExit(f"--arm-lrs {spec!r}: expected ARM=LR[,LR...] with ARM one of {names}")
        grids[arm] = [float(v) for v in values.split(",")]
    return grids


def _sets(ladder: Ladder, args: argparse.Namespace) -> dict[str, list[str]]:
    """Each arm's config overrides: ``--set`` (K-FAC's), ``--set-base`` (the reference's), ``--set-arm ARM:KEY=JSON``
    (a variant's are its own, over its arm's config file)."""
    sets = peers.parse_sets(args.set_arm, _names(ladder, args), "--set-arm")
    sets[KFAC] = args.set + sets[KFAC]
    sets[ladder.reference] = args.set_base + sets[ladder.reference]
    return sets


def run(args: argparse.Namespace) -> dict[str, Any]:
    ladder = LADDERS[args.task]
    task = ladder.task
    out = args.out / f"batch_scaling_{args.task}"
    (out / "configs").mkdir(parents=True, exist_ok=True)
    sets = _sets(ladder, args)
    model, extra = [], list(ladder.smoke_args if args.smoke else ())
    phase1 = None
    if ladder.targets is not None:  # phase 2 at a size: its model, from its phase-1 checkpoint
        model = [f"bert.model={json.dumps(sizes.SIZES[args.size])}"]
        phase1 = args.phase1 or sizes.phase1(args.size, args.phase1_steps, args.timeout, out)[0]
        extra += ["--init-checkpoint", str(phase1), "--cache-dir", str(ROOT / "runs" / "bert-cache")]
    extra += list(args.extra)
    bases = {
        arm: apply_overrides(json.loads((ROOT / arm_spec(ladder, arm).config).read_text()), model + sets[arm])
        for arm in sets
    }
    lrs = _grids(ladder, args)
    batches = args.batches or ladder.batches
    arms = list(args.arms or ladder.arms)
    runs: list[dict[str, Any]] = []
    order = 0

    def one(arm: str, batch: int, lr: float, seed: int) -> None:
        steps = budget(ladder, batch, args.samples, args.steps, args.budgets)
        name = f"{arm}-b{batch}-lr{lr:g}-seed{seed}"
        path = out / "configs" / f"{name}.json"
        path.write_text(json.dumps(configure(bases[arm], ladder, arm, batch, lr, steps), indent=1))
        evaluate = ["--eval-every", str(max(1, steps // args.evaluations))]
        load = os.getloadavg()[0]
        launch(task, path, seed, out, name, [*evaluate, *extra], args.timeout)
        curve = read_curve(out / name / "metrics.csv", task.metric)
        hit = to_target(curve, args.target, task.higher_is_better)
        runs.append(
            {"arm": arm, "batch": batch, "lr": lr, "seed": seed, "steps": steps, "load_before": load, "curve": curve}
            | {"to_target": hit}
        )
        print(f"{name}: final {curve[-1][2]:.4f}, to target {hit}", flush=True)

    def rotated() -> list[str]:  # the arms' order, rotated by one at every grid point
        nonlocal order
        k = order % len(arms)
        order += 1
        return arms[k:] + arms[:k]

    first, *more = args.seeds
    for batch in batches:  # every arm's grid, interleaved
        for i in range(max(len(lrs[arm]) for arm in arms)):
            for arm in rotated():
                if i < len(lrs[arm]):
                    one(arm, batch, lrs[arm][i], first)
    best = best_points(runs, arms)
    for seed in more:  # the best points again, rotating
        for batch in batches:
            for arm in rotated():
                lr = again(lrs[arm], best[arm][str(batch)]["lr"])
                if lr is not None:
                    one(arm, batch, lr, seed)
    best = best_points(runs, arms)
    result = {
        "task": args.task,
        "command": shlex.join(["python", "benchmarks/batch_scaling.py", *sys.argv[1:]]),
        "settings": {
            "world": WORLD,
            "metric": task.metric,
            "higher_is_better": task.higher_is_better,
            "target": args.target,
            "samples": args.samples,
            "steps": args.steps,
            "budgets": {str(b): budget(ladder, b, args.samples, args.steps, args.budgets) for b in batches},
            "size": args.size if ladder.targets is not None else None,
            "phase1": None if phase1 is None else Path(phase1).name,
            "batches": batches,
            "lrs": {arm: lrs[arm] for arm in arms},
            "seeds": args.seeds,
            "arms": {arm: arm_spec(ladder, arm).config for arm in arms},
            "set": sets,
            "extra_args": extra,
            "warmup_fraction": WARMUP if ladder.warmup_key else None,
        },
        "versions": versions(),
        "runs": runs,
        **summary(best),
    }
    result = portable(result)
    (args.out / f"batch_scaling_{args.task}.json").write_text(json.dumps(result, indent=1))
    plot(args.out / f"batch_scaling_{args.task}.png", result)
    print(table(result))
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the ladder of a task, every arm, each over its learning-rate grid")
    r.add_argument("task", choices=sorted(LADDERS))
    r.add_argument("--batches", type=int, nargs="+", help="global batches (default: the task's ladder)")
    r.add_argument("--lrs", type=float, nargs="+", help="learning-rate grid of every arm (default: the task's)")
    r.add_argument("--kfac-lrs", type=float, nargs="+", help="the K-FAC arm's grid (default: --lrs)")
    r.add_argument("--arm-lrs", action="append", default=[], metavar="ARM=LR,LR", help="one arm's grid")
    r.add_argument("--arms", nargs="+", help="the arms (and ARM+LABEL variants) to run, in the ladder's order")
    r.add_argument("--seeds", type=int, nargs="+", default=[0], help="the first runs the grids, the others the best")
    r.add_argument("--samples", type=int, help="training samples per run (default: the task's)")
    r.add_argument("--steps", type=int, help="steps per run, whatever the batch (overrides budgets and --samples)")
    r.add_argument("--budget", action="append", default=[], metavar="BATCH=STEPS", help="steps per run at a batch")
    r.add_argument("--target", type=float, help="held-out target (default: the task's, or its size's)")
    r.add_argument("--size", choices=sorted(sizes.SIZES), default="2x128", help="bert-phase2: the model size")
    r.add_argument("--phase1-steps", type=int, default=1500, help="bert-phase2: phase 1's LAMB steps at the size")
    r.add_argument("--phase1", type=Path, help="bert-phase2: the size's phase-1 run directory (default: built once)")
    r.add_argument("--evaluations", type=int, default=15, help="held-out evaluations per run")
    r.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override in the K-FAC config")
    r.add_argument("--set-base", action="append", default=[], metavar="KEY=JSON", help="override in the first arm's")
    r.add_argument("--set-arm", action="append", default=[], metavar="ARM:KEY=JSON", help="override in an arm's")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "batch_scaling")
    r.add_argument("--smoke", action="store_true", help="tiny data: checks the machinery, not the optimizers")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    r.add_argument("extra", nargs="*", help="after --: arguments passed to the example")
    t = sub.add_parser("table", help="the Markdown table of a saved result")
    t.add_argument("result", type=Path)
    t.add_argument("--target", type=float, help="score the stored curves at another held-out target")
    m = sub.add_parser("merge", help="one result (JSON and PNG) from the runs of several results of a task")
    m.add_argument("out", type=Path)
    m.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        ladder = LADDERS[args.task]
        args.samples = args.samples or ladder.samples
        args.budgets = parse_budgets(args.budget)
        if args.arms:
            try:
                args.arms = ordered(ladder, args.arms)
            except ValueError as error:
                parser.error(f"--arms of {args.task}: {error}")
        if args.target is None:
            args.target = ladder.target if ladder.targets is None else ladder.targets[args.size]
        run(args)
    elif args.command == "merge":
        print(table(merge(args.results, args.out)))
    else:
        result = json.loads(args.result.read_text())
        if args.target is not None:
            result = rescore(result, args.target)
        commands = result["command"] if isinstance(result["command"], list) else [result["command"]]
        print("\n".join(commands) + f"\n\n{table(result)}")


if __name__ == "__main__":
    main()
