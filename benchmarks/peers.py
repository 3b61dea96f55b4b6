"""Peers: ds_kfac's shipped config against the optimizers a DeepSpeed user switches to, each tuned.

Every arm is a config file the ``deepspeed`` launcher runs as it is (``configs/bert_cpu_phase2_<peer>.json``,
``configs/resnet_<peer>_cpu.json``): DeepSpeed's own optimizers from the JSON ``"optimizer"`` section (AdamW,
LAMB, Muon, SGD) and maintained packages' optimizers (SOAP, PSGD-Kron) from a ``"client_optimizer"`` section,
passed to ``ds_kfac.initialize`` by the examples. Same checkpoint, batch and step budget for all::

    python benchmarks/peers.py run bert --seeds 0 1 2                  # every BERT arm, 3 seeds, arms rotating
    python benchmarks/peers.py run resnet --seeds 0 1 2
    python benchmarks/peers.py run bert --arms adamw muon kfac --seeds 0 --name bert_600 -- --max-steps 600
    python benchmarks/peers.py grid bert muon --vary optimizer.params.muon_lr=0.01,0.02,0.04 \\
        --vary optimizer.params.adam_lr=0.004,0.008                    # a peer's tuning grid, seed 0
    python benchmarks/peers.py table benchmarks/results/peers_bert.json

Per arm, ``run`` reports the final held-out metric (median over seeds), seconds per step, the one-time cost of
its first step (``torch.compile`` of Muon's kernels, a first decomposition), and the steps and training seconds
it needed to reach every other arm's median final (first crossing, interpolated between evaluations; an arm's
time to its own median final is its full budget). Training seconds exclude every arm's one-time first-step
cost: the first step's duration less the run's median step duration is taken off every later time, and
reported apart. Arms run in an order rotated by one per seed, so machine noise hits all alike. ``grid`` runs
one arm over the product of ``--vary`` values and ranks them by final metric. Both write JSON (with the
command) and a plot of the held-out metric against steps and against training seconds.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
import time_to_target as ttt  # noqa: E402

ROOT = ttt.ROOT
KFAC = "kfac"
"""The arm holding ds_kfac's shipped config; every other arm is a peer."""

ARMS: dict[str, dict[str, str]] = {
    "bert": {
        "adamw": "configs/bert_cpu_phase2_base.json",
        "lamb": "configs/bert_cpu_phase2_lamb.json",
        "muon": "configs/bert_cpu_phase2_muon.json",
        "soap": "configs/bert_cpu_phase2_soap.json",
        "psgd": "configs/bert_cpu_phase2_psgd.json",
        KFAC: "configs/bert_cpu_phase2_kfac.json",
    },
    "resnet": {
        "sgd": "configs/resnet_sgd_cpu.json",
        "adamw": "configs/resnet_adamw_cpu.json",
        "muon": "configs/resnet_muon_cpu.json",
        "soap": "configs/resnet_soap_cpu.json",
        KFAC: "configs/resnet_kfac_cpu.json",
    },
}
"""Each task's arms: name -> config file."""


# ---------------------------------------------------------------- analysis
def one_time_seconds(step_seconds: Sequence[float]) -> float:
    """What the first step cost beyond a typical step (compilation, first decompositions): its duration less
    the median duration of the others, at least 0. ``step_seconds`` is the cumulative training time per step."""
    durations = [b - a for a, b in zip([0.0, *step_seconds], step_seconds)]
    if len(durations) < 2:
        return 0.0
    return max(0.0, durations[0] - statistics.median(durations[1:]))


def without_one_time(curve: ttt.Curve, one_time: float) -> ttt.Curve:
    """``curve`` with the one-time first-step cost taken off its training seconds."""
    return [(step, seconds - one_time, value) for step, seconds, value in curve]


def summarize(curves: dict[str, Sequence[ttt.Curve]], higher_is_better: bool) -> dict[str, Any]:
    """Per arm: finals, the median final, s/step, and steps and seconds to each arm's median final.

    ``curves[arm][i]`` is seed ``i``'s held-out curve, one-time cost already removed. Times to an arm's own
    median final are its full budget (the convention of ``time_to_target.summarize``); a run that never reaches
    a target counts as infinitely late, so a median over runs half of which miss is ``None``."""
    inf = float("inf")
    finals = {arm: statistics.median(c[-1][2] for c in runs) for arm, runs in curves.items()}
    out: dict[str, Any] = {}
    for arm, runs in curves.items():
        to: dict[str, Any] = {}
        for other, target in finals.items():
            if other == arm:
                hits: list[Optional[tuple[float, float]]] = [(c[-1][0], c[-1][1]) for c in runs]
            else:
                hits = [ttt.crossing(c, target, higher_is_better) for c in runs]
            steps = statistics.median(h[0] if h else inf for h in hits)
            seconds = statistics.median(h[1] if h else inf for h in hits)
            to[other] = {
                "target": target,
                "steps": None if steps == inf else steps,
                "seconds": None if seconds == inf else seconds,
                "reached": sum(h is not None for h in hits),
            }
        out[arm] = {
            "final": [c[-1][2] for c in runs],
            "median_final": finals[arm],
            "seconds_per_step": statistics.median(c[-1][1] / c[-1][0] for c in runs),
            "to": to,
        }
    return out


def best_peer(summary: dict[str, Any], higher_is_better: bool) -> Optional[str]:
    """The peer (any arm but ``kfac``) with the best median final, or ``None`` without peers."""
    peers = [arm for arm in summary if arm != KFAC]
    if not peers:
        return None
    key = lambda arm: summary[arm]["median_final"]  # noqa: E731
    return max(peers, key=key) if higher_is_better else min(peers, key=key)


def ratios(summary: dict[str, Any], arm: str, peer: str) -> dict[str, Optional[float]]:
    """``arm``'s steps and seconds to ``peer``'s median final, over ``peer``'s own (its full budget)."""
    mine, theirs = summary[arm]["to"][peer], summary[peer]["to"][peer]
    return {key: None if mine[key] is None else mine[key] / theirs[key] for key in ("steps", "seconds")}


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def table(result: dict[str, Any]) -> str:
    """Markdown: per arm its median final, s/step, one-time seconds, and steps / seconds to each arm's final."""
    summary, higher = result["summary"], result["settings"]["higher_is_better"]
    arms = list(summary)
    best = best_peer(summary, higher)
    head = "| arm | median final (seeds) | s/step | one-time s | " + " | ".join(f"to {a}'s final" for a in arms)
    lines = [head + " |", "|" + " --- |" * (4 + len(arms))]
    for arm in arms:
        s = summary[arm]
        finals = ", ".join(f"{v:.4f}" for v in s["final"])
        one_time = statistics.median(r["one_time_seconds"] for r in result["runs"] if r["arm"] == arm)
        cells = []
        for other in arms:
            t = s["to"][other]
            cells.append(
                f"{_fmt(t['steps'], '.0f')} st, {_fmt(t['seconds'], '.1f')} s ({t['reached']}/{len(s['final'])})"
            )
        lines.append(
            f"| {arm} | {s['median_final']:.4f} ({finals}) | {s['seconds_per_step']:.3f} | {one_time:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    if best is not None and KFAC in summary:
        r = ratios(summary, KFAC, best)
        lines.append(
            f"\nK-FAC to the best peer's ({best}) median final {summary[best]['median_final']:.4f}: "
            f"{_fmt(r['steps'], '.2f')}x its steps, {_fmt(r['seconds'], '.2f')}x its training seconds"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- runs
def read_steps(metrics_csv: Path) -> list[float]:
    """The cumulative training seconds of every step of a run's ``metrics.csv``."""
    with metrics_csv.open(newline="") as f:
        return [float(row["seconds"]) for row in csv.DictReader(f)]


def parse_sets(assignments: Sequence[str], arms: Sequence[str], flag: str = "--set") -> dict[str, list[str]]:
    """``ARM:KEY=JSON`` assignments (of the option ``flag``) grouped by arm, each arm named checked."""
    out: dict[str, list[str]] = {arm: [] for arm in arms}
    for assignment in assignments:
        arm, sep, rest = assignment.partition(":")
        if not sep or arm not in out:
            raise ValueError(f"{flag} expects ARM:KEY=JSON with ARM one of {list(arms)}, got {assignment!r}")
        out[arm].append(rest)
    return out


LAUNCHED = "launched.json"
"""Written into a run's directory when its launch succeeded: its config, seed and arguments, and the load before."""


def finished(out: Path, launched: dict[str, Any]) -> Optional[Path]:
    """A run directory of ``out`` or of its siblings (other grids and runs under one ``--out``) whose successful
    launch had exactly ``launched``'s config, seed and arguments."""
    for record in sorted(out.parent.glob(f"*/*/{LAUNCHED}")):
        saved = json.loads(record.read_text())
        if all(saved.get(key) == value for key, value in launched.items()):
            return record.parent
    return None


def run_arms(
    task_name: str,
    configs: dict[str, dict[str, Any]],
    labels: dict[str, str],
    seeds: Sequence[int],
    out: Path,
    extra: Sequence[str],
    timeout: float,
    phase1: Optional[Path],
    reuse: bool = False,
) -> list[dict[str, Any]]:
    """Every arm on every seed through the launcher, the arms' order rotated by one per seed; with ``reuse``, a run
    finished earlier under ``out``'s parent with the same config, seed and arguments is read instead of run again."""
    task = ttt.TASKS[task_name]
    (out / "configs").mkdir(parents=True, exist_ok=True)
    extra = list(extra)
    if task.phase1:
        phase1 = phase1 or ttt.build_phase1(timeout)
        extra += ["--init-checkpoint", str(phase1), "--cache-dir", str(ROOT / "runs" / "bert-cache")]
    names = list(configs)
    runs = []
    for i, seed in enumerate(seeds):
        for arm in names[i % len(names) :] + names[: i % len(names)]:
            name = f"{arm}-seed{seed}"
            launched = {"config": configs[arm], "seed": seed, "extra": extra}
            done = finished(out, launched) if reuse else None
            reused = done is not None
            if done is None:
                path = out / "configs" / f"{name}.json"
                path.write_text(json.dumps(configs[arm], indent=1))
                load = os.getloadavg()[0]
                ttt.launch(task, path, seed, out, name, extra, timeout)
                (out / name / LAUNCHED).write_text(json.dumps({**launched, "load_before": load}, indent=1))
                done = out / name
            load = json.loads((done / LAUNCHED).read_text())["load_before"]
            metrics = done / "metrics.csv"
            one_time = one_time_seconds(read_steps(metrics))
            curve = without_one_time(ttt.read_curve(metrics, task.metric), one_time)
            runs.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "label": labels[arm],
                    "load_before": load,
                    "reused": reused,
                    "one_time_seconds": one_time,
                    "curve": curve,
                }
            )
            print(
                f"{name}: final {task.metric} {curve[-1][2]:.4f} at step {curve[-1][0]:.0f}, "
                f"{curve[-1][1]:.1f}s (+{one_time:.1f}s one-time)",
                flush=True,
            )
    return runs


def launch_all(
    args: argparse.Namespace, configs: dict[str, dict[str, Any]], labels: dict[str, str], name: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`run_arms` with the command line's seeds, output, timeout and phase 1; also the example's arguments."""
    extra = list(ttt.TASKS[args.task].smoke_args if args.smoke else ()) + list(args.extra)
    runs = run_arms(
        args.task, configs, labels, args.seeds, args.out / name, extra, args.timeout, args.phase1, args.reuse
    )
    return runs, extra


def save(result: dict[str, Any], out: Path, title: str, target: Optional[float]) -> None:
    """``<out>.json`` and ``<out>.png`` (held-out metric against steps and training seconds, every run). ``result``
    is made :func:`time_to_target.portable` in place first, so the caller holds what was written."""
    result.update(ttt.portable(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    ttt.plot(out.with_suffix(".png"), title, result["settings"]["metric"], result["runs"], target)


def settings(args: argparse.Namespace, extra: Sequence[str], arms: dict[str, str]) -> dict[str, Any]:
    task = ttt.TASKS[args.task]
    return {
        "world": 2,
        "seeds": args.seeds,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "arms": arms,
        "extra_args": list(extra),
        "order": "the arms' order rotated by one per seed",
        "one_time": "first step's duration less the run's median step duration, taken off its training seconds",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = {arm: ARMS[args.task][arm] for arm in (args.arms or ARMS[args.task])}
    sets = parse_sets(args.set, list(arms))
    configs = {arm: ttt.apply_overrides(json.loads((ROOT / path).read_text()), sets[arm]) for arm, path in arms.items()}
    name = args.name or f"peers_{args.task}"
    runs, extra = launch_all(args, configs, {arm: f"{arm} ({Path(path).stem})" for arm, path in arms.items()}, name)
    task = ttt.TASKS[args.task]
    summary = summarize({arm: [r["curve"] for r in runs if r["arm"] == arm] for arm in arms}, task.higher_is_better)
    result = {
        "task": args.task,
        "command": shlex.join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
        "settings": {**settings(args, extra, arms), "set": args.set},
        "configs": configs,
        "versions": ttt.versions(),
        "runs": runs,
        "summary": summary,
    }
    best = best_peer(summary, task.higher_is_better)
    save(
        result,
        args.out / name,
        f"peers: {args.task}, {len(args.seeds)} seed(s), 2 ranks",
        None if best is None else summary[best]["median_final"],
    )
    print(table(result))
    return result


def grid_points(vary: Sequence[str]) -> list[list[str]]:
    """The product of ``KEY=V1,V2,...`` value lists, each point a list of ``KEY=V`` assignments."""
    axes = []
    for item in vary:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--vary expects KEY=V1,V2,..., got {item!r}")
        axes.append([f"{key}={v}" for v in _top_level_split(values)])
    return [list(point) for point in itertools.product(*axes)]


def _top_level_split(values: str) -> list[str]:
    """``values`` split at the commas outside brackets, so a value may be a JSON list (``[0.01,0.004],[0.02,0.004]``:
    DeepSpeed's ``WarmupDecayLR`` takes one rate per parameter group)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(values):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(values[start:i])
            start = i + 1
    return parts + [values[start:]]


def grid(args: argparse.Namespace) -> dict[str, Any]:
    path = ARMS[args.task][args.arm]
    base = ttt.apply_overrides(json.loads((ROOT / path).read_text()), args.set)
    points = grid_points(args.vary)
    configs = {"/".join(point) or "as committed": ttt.apply_overrides(base, point) for point in points}
    keys = {name: f"{args.arm}{i}" for i, name in enumerate(configs)}
    name = args.name or f"grid_{args.task}_{args.arm}"
    runs, extra = launch_all(args, {keys[n]: c for n, c in configs.items()}, {keys[n]: n for n in configs}, name)
    task = ttt.TASKS[args.task]
    finals = {n: statistics.median(r["curve"][-1][2] for r in runs if r["arm"] == keys[n]) for n in configs}
    ranked = sorted(finals, key=finals.__getitem__, reverse=task.higher_is_better)
    result = {
        "task": args.task,
        "arm": args.arm,
        "command": shlex.join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
        "settings": {**settings(args, extra, {args.arm: path}), "set": args.set, "vary": args.vary},
        "points": {n: {"key": keys[n], "median_final": finals[n]} for n in configs},
        "ranked": ranked,
        "versions": ttt.versions(),
        "runs": runs,
    }
    save(result, args.out / name, f"grid: {args.task} {args.arm}", finals[ranked[0]])
    for n in ranked:
        print(f"{finals[n]:.4f}  {n}")
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in ("run", "grid"):
        p = sub.add_parser(verb)
        p.add_argument("task", choices=sorted(ARMS))
        if verb == "run":
            p.add_argument("--arms", nargs="+", help="a subset of the task's arms (default: all)")
            p.add_argument("--set", action="append", default=[], metavar="ARM:KEY=JSON", help="override in an arm")
        else:
            p.add_argument("arm", help="the arm whose config the grid varies")
            p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis")
            p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="fixed override")
        p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2] if verb == "run" else [0])
        p.add_argument("--name", help="the result's file name (default: peers_<task> / grid_<task>_<arm>)")
        p.add_argument("--out", type=Path, default=ROOT / "runs" / "peers")
        p.add_argument("--smoke", action="store_true", help="a few steps per run: checks the machinery only")
        p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
        p.add_argument("--phase1", type=Path, help="bert: the phase-1 run directory (default: phase1.py's)")
        p.add_argument(
            "--reuse",
            action="store_true",
            help="read runs finished earlier under --out with the same config, seed and arguments instead "
            "of running them again (resumes an interrupted grid; not for timing comparisons, which run side by side)",
        )
        p.add_argument("extra", nargs="*", help="after --: arguments passed to the example")
    t = sub.add_parser("table", help="the Markdown table of a saved run")
    t.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "grid":
        grid(args)
    else:
        for path in args.results:
            result = json.loads(path.read_text())
            print(f"{result['command']}\n\n{table(result)}\n")


if __name__ == "__main__":
    main()
