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
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
import ladder as sizes  # noqa: E402
import peers  # noqa: E402
from time_to_target import ROOT, TASKS, Task, apply_overrides, crossing, launch, portable, read_curve, versions  # noqa: E402

WORLD = 2
KFAC = "kfac"
"""The arm whose ratios the table reports; every ladder has it."""


@dataclass(frozen=True)
class Arm:
    """One optimizer of a ladder: its config file and the keys its learning rate is set at."""

    config: str
    lr_keys: tuple[str, ...]


@dataclass(frozen=True)
class Ladder:
    """How a task's configs take a batch, a learning rate and a step budget."""

    task: Task
    arms: dict[str, Arm]  # the first is the reference the ratios divide by
    steps_keys: tuple[str, ...]
    warmup_key: Optional[str]  # a step count set to ``warmup`` of the budget (``None``: the example's own proportion)
    max_micro: int  # the largest per-rank micro-batch: beyond it the batch grows by accumulation
    samples: int
    target: float
    batches: tuple[int, ...]
    lrs: tuple[float, ...]
    smoke_args: tuple[str, ...]
    budgets: Optional[dict[int, int]] = None
    """Steps per global batch, where they replace ``samples / batch`` (a batch not listed: ``samples / batch``)."""
    targets: Optional[dict[str, float]] = None
    """The target per ``--size`` (a ladder of phase 2 at the sizes of ``benchmarks/ladder.py``)."""

    @property
    def reference(self) -> str:
        return next(iter(self.arms))


def _pair(task: Task, lr_keys: tuple[str, ...]) -> dict[str, Arm]:
    """The base optimizer and the same with K-FAC, their rates at the same keys."""
    return {"base": Arm(task.base_config, lr_keys), KFAC: Arm(task.kfac_config, lr_keys)}


RESNET_RATE = ("optimizer.params.lr", "scheduler.params.warmup_max_lr")
LADDERS = {
    "resnet": Ladder(
        TASKS["resnet"],
        _pair(TASKS["resnet"], RESNET_RATE),
        ("resnet.steps", "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_num_steps",
        128,
        122_880,
        0.95,
        (256, 1024, 4096),
        (0.2, 0.4, 0.8),
        ("--train-size", "2048", "--held-out-size", "256"),
    ),
    "resnet-peers": Ladder(
        TASKS["resnet"],
        {
            "sgd": Arm(TASKS["resnet"].base_config, RESNET_RATE),
            "soap": Arm(
                "configs/resnet_soap_cpu.json", ("client_optimizer.params.lr", "scheduler.params.warmup_max_lr")
            ),
            KFAC: Arm(TASKS["resnet"].kfac_config, RESNET_RATE),
        },
        ("resnet.steps", "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_num_steps",
        128,
        122_880,
        0.95,
        (1024, 4096),
        (0.2, 0.4, 0.8),
        ("--train-size", "2048", "--held-out-size", "256"),
        budgets={1024: 120, 4096: 60},  # the demo's 120 steps; at 4,096 its 30 (the samples) reached nothing
    ),
    "bert": Ladder(
        TASKS["bert-phase1"],
        _pair(TASKS["bert-phase1"], ("optimizer.params.lr",)),
        ("bert.max_steps",),
        None,
        32,
        64_000,
        5.75,
        (64, 256, 1024),
        (0.01, 0.02, 0.04),
        ("--eval-batches", "1"),
    ),
    "bert-phase2": Ladder(
        TASKS["bert"],
        {
            "adamw": Arm("configs/bert_cpu_phase2_base.json", ("optimizer.params.lr",)),
            "soap": Arm("configs/bert_cpu_phase2_soap.json", ("client_optimizer.params.lr",)),
            "muon": Arm("configs/bert_cpu_phase2_muon.json", ("optimizer.params.muon_lr",)),
            KFAC: Arm("configs/bert_cpu_phase2_kfac.json", ("optimizer.params.adam_lr",)),
        },
        ("bert.max_steps",),
        None,
        32,
        38_400,  # the demo's 150 steps of 256
        4.3,
        (256, 1024, 2048),
        (0.004, 0.008, 0.016),
        ("--eval-batches", "1"),
        budgets={256: 150, 1024: 75, 2048: 50, 4096: 40},
        targets={"2x128": 4.3, "2x256": 3.15, "4x256": 3.27},  # above tuned AdamW's final at 256 (ladder.json)
    ),
}
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


def budget(
    ladder: Ladder, batch: int, samples: int, steps: Optional[int], budgets: Optional[dict[int, int]] = None
) -> int:
    """A run's steps at ``batch``: ``steps`` when given, else its entry in ``budgets`` (``--budget``), else the
    ladder's budget for the batch, else ``samples / batch``."""
    if steps:
        return steps
    for given in (budgets, ladder.budgets):
        if given and batch in given:
            return given[batch]
    return max(1, samples // batch)


def parse_budgets(specs: Sequence[str]) -> dict[int, int]:
    """``--budget BATCH=STEPS`` values as a dict; a malformed one is refused, named."""
    out = {}
    for spec in specs:
        batch, _, steps = spec.partition("=")
        if not (batch.isdigit() and steps.isdigit() and int(batch) > 0 and int(steps) > 0):
            raise SystemExit(f"--budget {spec!r}: expected BATCH=STEPS, both positive integers")
        out[int(batch)] = int(steps)
    return out


def configure(base: dict[str, Any], ladder: Ladder, arm: str, batch: int, lr: float, steps: int) -> dict[str, Any]:
    """``base``, the config of ``arm``, at global ``batch`` with learning rate ``lr`` and a budget of ``steps``."""
    micro, accumulation = shape(batch, ladder.max_micro)
    sets = [f"train_micro_batch_size_per_gpu={micro}", f"gradient_accumulation_steps={accumulation}"]
    sets += [f"{key}={lr}" for key in ladder.arms[arm].lr_keys] + [f"{key}={steps}" for key in ladder.steps_keys]
    if ladder.warmup_key:
        sets.append(f"{ladder.warmup_key}={max(1, round(WARMUP * steps))}")
    config = apply_overrides(base, sets)
    config.pop("train_batch_size", None)
    return config


def to_target(curve: list, target: float, higher_is_better: bool) -> Optional[dict[str, float]]:
    hit = crossing(curve, target, higher_is_better)
    return None if hit is None else {"steps": hit[0], "seconds": hit[1]}


def _arms(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The arms of ``runs`` in their first appearance's order."""
    return list(dict.fromkeys(r["arm"] for r in runs))


def best_points(runs: Sequence[dict[str, Any]], arms: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
    """Per arm (``arms``, default: those of ``runs``) and batch: the learning rate whose seed-0 run reached the
    target in the fewest steps, and the medians over that point's seeds (``None`` where a seed never reached it,
    or no learning rate did)."""
    arms = list(arms or _arms(runs))
    best: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    for arm in arms:
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


def again(grid: Sequence[float], best: Optional[float]) -> Optional[float]:
    """The rate ``--seeds`` beyond the first re-run: a one-rate grid's rate whether or not the first seed reached
    the target (the rate was chosen on seed 0 before, so a miss on seed 1 is a result for seed 2 as well), else the
    first seed's best (``None``: no rate of the grid reached it, nothing to re-run)."""
    return grid[0] if len(grid) == 1 else best


def _ratio(num: dict[str, Any], den: dict[str, Any]) -> dict[str, Optional[float]]:
    return {key: None if den[key] is None or num[key] is None else num[key] / den[key] for key in ("steps", "seconds")}


def ratios(best: dict[str, dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """K-FAC / the reference arm (the first of ``best``) in steps and wall seconds to the target at each batch
    (``None`` where either never reached it)."""
    reference = next(iter(best))
    return {batch: _ratio(best[KFAC][batch], point) for batch, point in best[reference].items()}


def peer_ratios(best: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """At each batch, K-FAC / the other arm that reached the target in the fewest steps (``"peer"``: its name;
    ``None`` where no other arm reached it)."""
    out = {}
    for batch in best[KFAC]:
        reached = [arm for arm in best if arm != KFAC and best[arm][batch]["steps"] is not None]
        peer = min(reached, key=lambda arm: best[arm][batch]["steps"], default=None)
        none = {"steps": None, "seconds": None}
        out[batch] = {"peer": peer, **(none if peer is None else _ratio(best[KFAC][batch], best[peer][batch]))}
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def table(result: dict[str, Any]) -> str:
    """The Markdown table of a result: per batch, each arm's best learning rate, steps and seconds to target, and,
    where K-FAC ran beside another arm, K-FAC against the reference arm (and, with more than two arms, against the
    best other one)."""
    best, rat = result["best"], result.get("ratios")
    arms = list(best)
    reference = arms[0]
    names = {arm: "K-FAC" if arm == KFAC else arm for arm in arms}
    with_peers = "peer_ratios" in result
    header = f"| global batch (micro x accumulation x {WORLD}) | "
    header += " | ".join(f"{names[a]} lr | {names[a]} steps | {names[a]} s" for a in arms) + " |"
    header += f" K-FAC/{reference} steps | K-FAC/{reference} wall |" if rat is not None else ""
    header += " K-FAC/best other steps | K-FAC/best other wall | best other |" if with_peers else ""
    lines = [header + " seeds |", "|" + " --- |" * header.count("|")]  # one column per "|" of the header so far
    ladder = LADDERS[result["task"]]
    for batch in sorted(best[reference], key=int):
        micro, accumulation = shape(int(batch), ladder.max_micro)
        cells = [f"{batch} ({micro} x {accumulation} x {WORLD})"]
        for arm in arms:
            p = best[arm][batch]
            cells += [_fmt(p["lr"], "g"), _fmt(p["steps"], ".0f"), _fmt(p["seconds"], ".1f")]
        if rat is not None:
            cells += [_fmt(rat[batch]["steps"], ".2f"), _fmt(rat[batch]["seconds"], ".2f")]
        if with_peers:
            q = result["peer_ratios"][batch]
            cells += [_fmt(q["steps"], ".2f"), _fmt(q["seconds"], ".2f"), q["peer"] or "none"]
        cells.append(str(min((best[arm][batch]["seeds"] for arm in arms if best[arm][batch]["seeds"]), default=0)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Log-log steps to target against the global batch, one line per arm (with the perfect-scaling line through
    the reference arm's smallest batch), and wall seconds to target against the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    best = result["best"]
    for arm in best:
        points = sorted((int(b), p) for b, p in best[arm].items() if p["steps"] is not None)
        if not points:
            continue
        color = "tab:red" if arm == KFAC else None
        for ax, key in zip(axes, ("steps", "seconds")):
            ax.plot([b for b, _ in points], [p[key] for _, p in points], "o-", color=color, label=arm)
    reference = next(iter(best))
    base = sorted((int(b), p["steps"]) for b, p in best[reference].items() if p["steps"] is not None)
    if base:
        b0, s0 = base[0]
        batches = sorted(int(b) for b in best[reference])
        axes[0].plot(batches, [s0 * b0 / b for b in batches], "k--", lw=1, label="perfect scaling")
    target = result["settings"]["target"]
    for ax, ylabel in zip(axes, ("optimizer steps to target", "training seconds to target")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    size = result["settings"].get("size")
    task = result["task"] + (f" {size}" if size else "")
    fig.suptitle(f"batch scaling: {task}, steps to {result['settings']['metric']} {target}, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grids(ladder: Ladder, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each arm's learning-rate grid: ``--arm-lrs ARM=...`` (``--kfac-lrs`` for K-FAC), else ``--lrs``, else the
    ladder's."""
    grids = {arm: list(args.lrs or ladder.lrs) for arm in ladder.arms}
    if args.kfac_lrs:
        grids[KFAC] = list(args.kfac_lrs)
    for spec in args.arm_lrs:
        arm, _, values = spec.partition("=")
        if arm not in ladder.arms or not values:
            raise SystemExit(f"--arm-lrs {spec!r}: expected ARM=LR[,LR...] with ARM one of {sorted(ladder.arms)}")
        grids[arm] = [float(v) for v in values.split(",")]
    return grids


def _sets(ladder: Ladder, args: argparse.Namespace) -> dict[str, list[str]]:
    """Each arm's config overrides: ``--set`` (K-FAC's), ``--set-base`` (the reference's), ``--set-arm ARM:KEY=JSON``."""
    sets = peers.parse_sets(args.set_arm, list(ladder.arms), "--set-arm")
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
        arm: apply_overrides(json.loads((ROOT / spec.config).read_text()), model + sets[arm])
        for arm, spec in ladder.arms.items()
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
            "arms": {arm: ladder.arms[arm].config for arm in arms},
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


def summary(best: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A result's best points and, where K-FAC ran beside another arm, its ratios (``peer_ratios`` with more than
    two arms)."""
    out: dict[str, Any] = {"best": best}
    if KFAC in best and len(best) > 1:
        out["ratios"] = ratios(best)
    if KFAC in best and len(best) > 2:
        out["peer_ratios"] = peer_ratios(best)
    return out


def _ladder_arms(task: str, runs: Sequence[dict[str, Any]]) -> list[str]:
    """The arms of ``runs`` in their ladder's order (the reference first)."""
    return [arm for arm in LADDERS[task].arms if arm in _arms(runs)]


def rescore(result: dict[str, Any], target: float) -> dict[str, Any]:
    """``result`` scored at another held-out ``target`` from its stored curves: another horizon, nothing re-run
    (each arm's best learning rate is picked again at that target)."""
    higher_is_better = result["settings"]["higher_is_better"]
    runs = [r | {"to_target": to_target(r["curve"], target, higher_is_better)} for r in result["runs"]]
    kept = {key: value for key, value in result.items() if key not in ("best", "ratios", "peer_ratios")}
    settings = result["settings"] | {"target": target}
    return kept | {"settings": settings, "runs": runs} | summary(best_points(runs, _ladder_arms(result["task"], runs)))


def merge(paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """One result from the runs of several results of the same task, metric, target and size (``settings`` are
    those of the first, with the union of batches, grids, seeds and per-batch budgets; the commands are kept in a
    list)."""
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    for path, part in zip(paths, parts):
        for key in ("metric", "target", "world", "samples", "steps", "size"):
            if (part["task"], part["settings"].get(key)) != (first["task"], first["settings"].get(key)):
                raise SystemExit(f"{path}: {key} {part['settings'].get(key)!r} differs from {paths[0]}'s")
    runs = [r for part in parts for r in part["runs"]]
    seen = [(r["arm"], r["batch"], r["lr"], r["seed"]) for r in runs]
    if len(set(seen)) < len(seen):
        twice = sorted({k for k in seen if seen.count(k) > 1})
        raise SystemExit(f"runs present twice (arm, batch, lr, seed): {twice}")
    arms = _ladder_arms(first["task"], runs)
    settings = dict(first["settings"])
    settings["batches"] = sorted({r["batch"] for r in runs})
    settings["lrs"] = {arm: sorted({r["lr"] for r in runs if r["arm"] == arm}) for arm in arms}
    settings["arms"] = {arm: LADDERS[first["task"]].arms[arm].config for arm in arms}
    settings["seeds"] = sorted({r["seed"] for r in runs})
    budgets: dict[str, int] = {}
    for path, part in zip(paths, parts):
        for batch, steps in (part["settings"].get("budgets") or {}).items():
            if budgets.setdefault(batch, steps) != steps:
                raise SystemExit(
                    f"{path}: budget {steps} at batch {batch} differs from an earlier part's {budgets[batch]}"
                )
    if budgets:
        settings["budgets"] = dict(sorted(budgets.items(), key=lambda item: int(item[0])))
    result = {
        "task": first["task"],
        "command": [part["command"] for part in parts],
        "settings": settings,
        "versions": first["versions"],
        "runs": runs,
        **summary(best_points(runs, arms)),
    }
    result = portable(result)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result)
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
    r.add_argument("--arms", nargs="+", help="the arms to run, in the ladder's order (default: all): one grid's edge")
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
            unknown = sorted(set(args.arms) - set(ladder.arms))
            if unknown:
                parser.error(f"--arms: {unknown} not arms of {args.task} ({list(ladder.arms)})")
            args.arms = [arm for arm in ladder.arms if arm in args.arms]
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
