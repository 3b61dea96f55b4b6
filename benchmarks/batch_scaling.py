"""Batch scaling: steps and wall seconds to a fixed held-out target against the global batch, base vs K-FAC.

Each point of a ladder of global batches (reached by gradient accumulation, ``micro x accumulation x 2
ranks``) trains the real example through the ``deepspeed`` launcher, for the base optimizer and for
base+K-FAC, each over its own learning-rate grid; a run's budget is a fixed number of training samples
(so ``samples / batch`` steps, its schedule compressed to them), and its time to target is the first
crossing of the fixed ``--target`` by its held-out curve (interpolated, as ``time_to_target.py`` does).
The best learning rate of each arm at each batch is the one reaching the target in the fewest steps;
``--seeds`` beyond the first re-run only those best points. Base and K-FAC runs alternate::

    python benchmarks/batch_scaling.py run resnet --batches 256 1024 4096 --lrs 0.2 0.4 0.8
    python benchmarks/batch_scaling.py run resnet --batches 1024 --lrs 0.4 --seeds 0 1 2
    python benchmarks/batch_scaling.py table benchmarks/results/batch_scaling_resnet.json
    python benchmarks/batch_scaling.py merge benchmarks/results/batch_scaling_bert.json \
        runs/bs_256/batch_scaling_bert.json runs/bs_256_08/batch_scaling_bert.json

``merge`` joins the runs of several ``run``s of one task and target (a ladder whose learning-rate grid
differs with the batch, or more seeds) into one result, best points and ratios recomputed.

``run`` writes ``<out>/batch_scaling_<task>.json`` (settings, versions, every run's curve, the best point
of each arm at each batch, the ratios) and ``.png`` (log-log steps to target against the batch with the
perfect-scaling line, and the wall-time panel) and prints the Markdown table that ``table`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
from time_to_target import ROOT, TASKS, Task, apply_overrides, crossing, launch, read_curve, versions  # noqa: E402

WORLD = 2


@dataclass(frozen=True)
class Ladder:
    """How a task's config takes a batch, a learning rate and a step budget."""

    task: Task
    lr_keys: tuple[str, ...]
    steps_keys: tuple[str, ...]
    warmup_key: Optional[str]  # a step count set to ``warmup`` of the budget (``None``: the example's own proportion)
    max_micro: int  # the largest per-rank micro-batch: beyond it the batch grows by accumulation
    samples: int
    target: float
    batches: tuple[int, ...]
    lrs: tuple[float, ...]
    smoke_args: tuple[str, ...]


LADDERS = {
    "resnet": Ladder(
        TASKS["resnet"],
        ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
        ("resnet.steps", "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_num_steps",
        128,
        122_880,
        0.95,
        (256, 1024, 4096),
        (0.2, 0.4, 0.8),
        ("--train-size", "2048", "--held-out-size", "256"),
    ),
    "bert": Ladder(
        TASKS["bert"],
        ("optimizer.params.lr",),
        ("bert.max_steps",),
        None,
        32,
        64_000,
        5.75,
        (64, 256, 1024),
        (0.01, 0.02, 0.04),
        ("--eval-batches", "1"),
    ),
}
ARMS = ("base", "kfac")
WARMUP = 0.08
"""Warm-up steps as a fraction of the budget (for a ladder with ``warmup_key``)."""


def shape(batch: int, max_micro: int) -> tuple[int, int]:
    """``(micro, accumulation)`` giving a global batch of ``batch`` on ``WORLD`` ranks."""
    per_rank = batch // WORLD
    if batch % WORLD:
        raise ValueError(f"batch {batch} is not a multiple of the {WORLD} ranks")
    micro = min(per_rank, max_micro)
    if per_rank % micro:
        raise ValueError(f"batch {batch}: {per_rank} per rank is not a multiple of the micro-batch {micro}")
    return micro, per_rank // micro


def configure(base: dict[str, Any], ladder: Ladder, batch: int, lr: float, steps: int) -> dict[str, Any]:
    """``base`` at global ``batch`` with learning rate ``lr`` and a budget of ``steps`` steps."""
    micro, accumulation = shape(batch, ladder.max_micro)
    sets = [f"train_micro_batch_size_per_gpu={micro}", f"gradient_accumulation_steps={accumulation}"]
    sets += [f"{key}={lr}" for key in ladder.lr_keys] + [f"{key}={steps}" for key in ladder.steps_keys]
    if ladder.warmup_key:
        sets.append(f"{ladder.warmup_key}={max(1, round(WARMUP * steps))}")
    config = apply_overrides(base, sets)
    config.pop("train_batch_size", None)
    return config


def to_target(curve: list, target: float, higher_is_better: bool) -> Optional[dict[str, float]]:
    hit = crossing(curve, target, higher_is_better)
    return None if hit is None else {"steps": hit[0], "seconds": hit[1]}


def best_points(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm and batch: the learning rate whose seed-0 run reached the target in the fewest steps, and the
    medians over that point's seeds (``None`` where a seed never reached it, or no learning rate did)."""
    best: dict[str, dict[str, Any]] = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for batch in sorted({r["batch"] for r in runs}):
            mine = [r for r in runs if r["arm"] == arm and r["batch"] == batch]
            first = [r for r in mine if r["seed"] == min(x["seed"] for x in mine)]
            reached = [r for r in first if r["to_target"] is not None]
            if not reached:
                best[arm][str(batch)] = {"lr": None, "steps": None, "seconds": None, "seeds": 0}
                continue
            lr = min(reached, key=lambda r: r["to_target"]["steps"])["lr"]
            hits = [r["to_target"] for r in mine if r["lr"] == lr]
            inf = float("inf")
            steps = statistics.median(h["steps"] if h else inf for h in hits)
            seconds = statistics.median(h["seconds"] if h else inf for h in hits)
            best[arm][str(batch)] = {
                "lr": lr,
                "steps": None if steps == inf else steps,
                "seconds": None if seconds == inf else seconds,
                "steps_per_seed": [h and h["steps"] for h in hits],
                "seconds_per_seed": [h and h["seconds"] for h in hits],
                "seeds": len(hits),
            }
    return best


def ratios(best: dict[str, dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """K-FAC / base steps and wall seconds to the target at each batch (``None`` where either never reached it)."""
    out = {}
    for batch, base in best["base"].items():
        kfac = best["kfac"][batch]
        out[batch] = {
            key: None if base[key] is None or kfac[key] is None else kfac[key] / base[key]
            for key in ("steps", "seconds")
        }
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def table(result: dict[str, Any]) -> str:
    """The Markdown table of a result: per batch, each arm's best learning rate, steps and seconds to target."""
    best, rat = result["best"], result["ratios"]
    lines = [
        f"| global batch (micro x accumulation x {WORLD}) | base lr | base steps | base s | K-FAC lr | K-FAC steps "
        f"| K-FAC s | K-FAC/base steps | K-FAC/base wall | seeds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ladder = LADDERS[result["task"]]
    for batch in sorted(best["base"], key=int):
        b, k, r = best["base"][batch], best["kfac"][batch], rat[batch]
        micro, accumulation = shape(int(batch), ladder.max_micro)
        lines.append(
            f"| {batch} ({micro} x {accumulation} x {WORLD}) | {_fmt(b['lr'], 'g')} | {_fmt(b['steps'], '.0f')} "
            f"| {_fmt(b['seconds'], '.1f')} | {_fmt(k['lr'], 'g')} | {_fmt(k['steps'], '.0f')} "
            f"| {_fmt(k['seconds'], '.1f')} | {_fmt(r['steps'], '.2f')} | {_fmt(r['seconds'], '.2f')} "
            f"| {min(b['seeds'], k['seeds'])} |"
        )
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Log-log steps to target against the global batch (with the perfect-scaling line through the base
    arm's smallest batch) and wall seconds to target against the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"base": "tab:blue", "kfac": "tab:red"}
    for arm in ARMS:
        points = [(int(b), p) for b, p in result["best"][arm].items() if p["steps"] is not None]
        points.sort()
        if not points:
            continue
        for ax, key in zip(axes, ("steps", "seconds")):
            ax.plot([b for b, _ in points], [p[key] for _, p in points], "o-", color=colors[arm], label=arm)
    base = sorted((int(b), p["steps"]) for b, p in result["best"]["base"].items() if p["steps"] is not None)
    if base:
        b0, s0 = base[0]
        batches = sorted(int(b) for b in result["best"]["base"])
        axes[0].plot(batches, [s0 * b0 / b for b in batches], "k--", lw=1, label="perfect scaling")
    target = result["settings"]["target"]
    for ax, ylabel in zip(axes, ("optimizer steps to target", "training seconds to target")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"batch scaling: {result['task']}, steps to {result['settings']['metric']} {target}, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    ladder = LADDERS[args.task]
    task = ladder.task
    out = args.out / f"batch_scaling_{args.task}"
    (out / "configs").mkdir(parents=True, exist_ok=True)
    bases = {
        "base": apply_overrides(json.loads((ROOT / task.base_config).read_text()), args.set_base),
        "kfac": apply_overrides(json.loads((ROOT / task.kfac_config).read_text()), args.set),
    }
    lrs = {"base": args.lrs or ladder.lrs, "kfac": args.kfac_lrs or args.lrs or ladder.lrs}
    batches = args.batches or ladder.batches
    extra = list(ladder.smoke_args if args.smoke else ()) + list(args.extra)
    runs: list[dict[str, Any]] = []
    order = 0

    def one(arm: str, batch: int, lr: float, seed: int) -> None:
        steps = args.steps or max(1, args.samples // batch)
        name = f"{arm}-b{batch}-lr{lr:g}-seed{seed}"
        path = out / "configs" / f"{name}.json"
        path.write_text(json.dumps(configure(bases[arm], ladder, batch, lr, steps), indent=1))
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

    first, *more = args.seeds
    for batch in batches:  # the learning-rate grids of both arms, interleaved and alternating which goes first
        for i in range(max(len(lrs["base"]), len(lrs["kfac"]))):
            arms = ARMS if order % 2 == 0 else ARMS[::-1]
            order += 1
            for arm in arms:
                if i < len(lrs[arm]):
                    one(arm, batch, lrs[arm][i], first)
    best = best_points(runs)
    for seed in more:  # the best points again, alternating
        for batch in batches:
            arms = ARMS if order % 2 == 0 else ARMS[::-1]
            order += 1
            for arm in arms:
                lr = best[arm][str(batch)]["lr"]
                if lr is not None:
                    one(arm, batch, lr, seed)
    best = best_points(runs)
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
            "batches": batches,
            "lrs": lrs,
            "seeds": args.seeds,
            "base_config": task.base_config,
            "kfac_config": task.kfac_config,
            "set_base": args.set_base,
            "set_kfac": args.set,
            "extra_args": extra,
            "warmup_fraction": WARMUP if ladder.warmup_key else None,
        },
        "versions": versions(),
        "runs": runs,
        "best": best,
        "ratios": ratios(best),
    }
    (args.out / f"batch_scaling_{args.task}.json").write_text(json.dumps(result, indent=1))
    plot(args.out / f"batch_scaling_{args.task}.png", result)
    print(table(result))
    return result


def merge(paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """One result from the runs of several results of the same task, metric and target (``settings`` are
    those of the first, with the union of batches, grids and seeds; the commands are kept in a list)."""
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    for path, part in zip(paths, parts):
        for key in ("metric", "target", "world", "samples", "steps"):
            if (part["task"], part["settings"][key]) != (first["task"], first["settings"][key]):
                raise SystemExit(f"{path}: {key} {part['settings'][key]!r} differs from {paths[0]}'s")
    runs = [r for part in parts for r in part["runs"]]
    seen = [(r["arm"], r["batch"], r["lr"], r["seed"]) for r in runs]
    if len(set(seen)) < len(seen):
        twice = sorted({k for k in seen if seen.count(k) > 1})
        raise SystemExit(f"runs present twice (arm, batch, lr, seed): {twice}")
    settings = dict(first["settings"])
    settings["batches"] = sorted({r["batch"] for r in runs})
    settings["lrs"] = {arm: sorted({r["lr"] for r in runs if r["arm"] == arm}) for arm in ARMS}
    settings["seeds"] = sorted({r["seed"] for r in runs})
    best = best_points(runs)
    result = {
        "task": first["task"],
        "command": [part["command"] for part in parts],
        "settings": settings,
        "versions": first["versions"],
        "runs": runs,
        "best": best,
        "ratios": ratios(best),
    }
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the ladder of a task, both arms, each over its learning-rate grid")
    r.add_argument("task", choices=sorted(LADDERS))
    r.add_argument("--batches", type=int, nargs="+", help="global batches (default: the task's ladder)")
    r.add_argument("--lrs", type=float, nargs="+", help="learning-rate grid (default: the task's)")
    r.add_argument("--kfac-lrs", type=float, nargs="+", help="the K-FAC arm's grid (default: --lrs)")
    r.add_argument("--seeds", type=int, nargs="+", default=[0], help="the first runs the grids, the others the best")
    r.add_argument("--samples", type=int, help="training samples per run (default: the task's)")
    r.add_argument("--steps", type=int, help="steps per run, whatever the batch (overrides --samples)")
    r.add_argument("--target", type=float, help="held-out target (default: the task's)")
    r.add_argument("--evaluations", type=int, default=15, help="held-out evaluations per run")
    r.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override in the K-FAC config")
    r.add_argument("--set-base", action="append", default=[], metavar="KEY=JSON", help="override in the base config")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "batch_scaling")
    r.add_argument("--smoke", action="store_true", help="tiny data: checks the machinery, not the optimizers")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    r.add_argument("extra", nargs="*", help="after --: arguments passed to the example")
    t = sub.add_parser("table", help="the Markdown table of a saved result")
    t.add_argument("result", type=Path)
    m = sub.add_parser("merge", help="one result (JSON and PNG) from the runs of several results of a task")
    m.add_argument("out", type=Path)
    m.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        ladder = LADDERS[args.task]
        args.samples = args.samples or ladder.samples
        args.target = ladder.target if args.target is None else args.target
        run(args)
    elif args.command == "merge":
        print(table(merge(args.results, args.out)))
    else:
        result = json.loads(args.result.read_text())
        commands = result["command"] if isinstance(result["command"], list) else [result["command"]]
        print("\n".join(commands) + f"\n\n{table(result)}")


if __name__ == "__main__":
    main()
