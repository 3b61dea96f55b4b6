"""Time to target: does base+K-FAC reach the base optimizer's final held-out metric sooner?

Runs the real examples through the ``deepspeed`` launcher (2 ranks, as the
examples run), for several seeds, alternating base and K-FAC runs so machine
noise hits both arms alike::

    python benchmarks/time_to_target.py run bert --seeds 0 1 2            # BERT phase 2 from the demo's phase 1
    python benchmarks/time_to_target.py run bert-phase1 --seeds 0         # BERT phase 1 from scratch
    python benchmarks/time_to_target.py run resnet --seeds 0 1 2          # ResNet, embedded digits
    python benchmarks/time_to_target.py run bert --set kfac.damping=0.01  # a study point
    python benchmarks/time_to_target.py compare runs/demo/bert_cpu_phase2_base runs/demo/bert_cpu_phase2_kfac
    python benchmarks/time_to_target.py table benchmarks/results/{resnet,bert}.json  # benchmarks/README.md's rows

The target is the median over seeds of the base optimizer's final held-out
metric at its full budget. A run's time to target is the first crossing of the
target by its held-out curve, linearly interpolated between evaluation points
(steps and training seconds; evaluation is not timed). The base arm's time is
its full budget. ``run`` writes ``<out>/<task>.json`` (settings, seeds,
versions, every curve, the summary) and ``<out>/<task>.png`` and prints a
Markdown table; ``compare`` does the same for two finished runs (``make demo``). The ``bert`` task is phase 2:
both arms start from the demo's phase-1 checkpoint, which ``examples/bert/phase1.py`` builds once (or
``--phase1 DIR`` names).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def portable(value: Any) -> Any:
    """``value`` (a result, or any string, list or dict in it) without this machine's absolute paths.

    A committed result names no machine's directories: paths in the checkout become relative to its root
    (``runs/...``), the interpreter's prefix becomes ``$VENV``, the temporary directory ``$TMPDIR`` and a device
    machine's output folder (the environment's ``OUT``, when set) ``$OUT``.
    """
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [portable(item) for item in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str):
        return value
    value = re.sub(re.escape(str(ROOT)) + r"(/|(?=[\s'\"]|$))", lambda m: "" if m.group(1) else ".", value)
    named = [(sys.prefix, "$VENV"), (tempfile.gettempdir(), "$TMPDIR"), (os.environ.get("OUT", ""), "$OUT")]
    for prefix, name in named:
        if prefix.startswith("/") and prefix.rstrip("/"):
            value = re.sub(re.escape(prefix.rstrip("/")) + r"(?=[/\s'\"]|$)", lambda m: name, value)
    return value


Curve = list[tuple[float, float, float]]
"""Held-out evaluations of one run: ``(step, training seconds, metric)``, in step order."""


@dataclass(frozen=True)
class Task:
    """One example as the benchmark runs it."""

    script: str
    base_config: str
    kfac_config: str
    metric: str
    higher_is_better: bool
    smoke_args: tuple[str, ...]
    phase1: bool = False
    """Whether both arms start from the BERT demo's phase-1 run (``--init-checkpoint``, its caches)."""


BERT_SMOKE = ("--max-steps", "4", "--eval-every", "2", "--eval-batches", "1")
TASKS = {
    "bert": Task(
        "examples/bert/pretrain.py",
        "configs/bert_cpu_phase2_base.json",
        "configs/bert_cpu_phase2_kfac.json",
        "held_out_mlm_loss",
        False,
        BERT_SMOKE,
        phase1=True,
    ),
    "bert-phase1": Task(
        "examples/bert/pretrain.py",
        "configs/bert_cpu_phase1_lamb.json",
        "configs/bert_cpu_phase1_kfac.json",
        "held_out_mlm_loss",
        False,
        BERT_SMOKE,
    ),
    "resnet": Task(
        "examples/resnet/train.py",
        "configs/resnet_sgd_cpu.json",
        "configs/resnet_kfac_cpu.json",
        "held_out_accuracy",
        True,
        ("--steps", "4", "--eval-every", "2", "--train-size", "4096", "--held-out-size", "256"),
    ),
}
ARMS = ("base", "kfac")


# ---------------------------------------------------------------- analysis
def reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def crossing(curve: Curve, target: float, higher_is_better: bool) -> Optional[tuple[float, float]]:
    """``(step, seconds)`` where ``curve`` first reaches ``target``, linearly interpolated
    between the evaluation before and the one that reaches it; ``None`` if it never does."""
    previous = None
    for step, seconds, value in curve:
        if reached(value, target, higher_is_better):
            if previous is None:
                return step, seconds
            p_step, p_seconds, p_value = previous
            frac = (target - p_value) / (value - p_value)
            return p_step + frac * (step - p_step), p_seconds + frac * (seconds - p_seconds)
        previous = step, seconds, value
    return None


def summarize(base: Sequence[Curve], kfac: Sequence[Curve], higher_is_better: bool) -> dict[str, Any]:
    """Target, per-run times and the median ratios K-FAC / base.

    ``base[i]`` and ``kfac[i]`` are the same seed, run side by side. A K-FAC run
    that never reaches the target counts as infinitely late, so a median over
    runs half of which miss is infinite (reported as ``None``)."""
    if not base or len(base) != len(kfac) or not all(base) or not all(kfac):
        raise ValueError("summarize needs one non-empty base and K-FAC curve per seed")
    target = statistics.median(curve[-1][2] for curve in base)
    budget = [(curve[-1][0], curve[-1][1]) for curve in base]
    hits = [crossing(curve, target, higher_is_better) for curve in kfac]
    inf = float("inf")
    k_steps = statistics.median(h[0] if h else inf for h in hits)
    k_seconds = statistics.median(h[1] if h else inf for h in hits)
    b_steps = statistics.median(b[0] for b in budget)
    b_seconds = statistics.median(b[1] for b in budget)
    paired = [h[1] / b[1] if h else inf for h, b in zip(hits, budget)]
    per_step = [(k[-1][1] / k[-1][0]) / (b[-1][1] / b[-1][0]) for k, b in zip(kfac, base)]

    def finite(x: float) -> Optional[float]:
        return None if x == inf else x

    return {
        "target": target,
        "base_final": [curve[-1][2] for curve in base],
        "kfac_final": [curve[-1][2] for curve in kfac],
        "base_budget": [{"steps": s, "seconds": t} for s, t in budget],
        "base_own_crossing": [
            None if c is None else {"steps": c[0], "seconds": c[1]}
            for c in (crossing(curve, target, higher_is_better) for curve in base)
        ],
        "kfac_reached": [None if h is None else {"steps": h[0], "seconds": h[1]} for h in hits],
        "base_steps": b_steps,
        "base_seconds": b_seconds,
        "kfac_steps": finite(k_steps),
        "kfac_seconds": finite(k_seconds),
        "steps_ratio": finite(k_steps / b_steps),
        "seconds_ratio": finite(k_seconds / b_seconds),
        "paired_seconds_ratios": [finite(r) for r in paired],
        "seconds_per_step_ratio": statistics.median(per_step),
    }


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def table(name: str, metric: str, summary: dict[str, Any]) -> str:
    """A Markdown table of one task's summary."""
    s = summary
    paired = s["paired_seconds_ratios"]
    spread = "-" if any(r is None for r in paired) else f"{min(paired):.2f}-{max(paired):.2f}"
    reached_count = sum(r is not None for r in s["kfac_reached"])
    return "\n".join(
        [
            f"| {name} | target {metric} | steps | wall s | K-FAC/base steps | K-FAC/base wall (per-seed range) "
            f"| s/step K-FAC/base | K-FAC reached |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| base (full budget) | {s['target']:.4f} | {s['base_steps']:.0f} | {s['base_seconds']:.1f} | | | | |",
            f"| K-FAC (to target) | | {_fmt(s['kfac_steps'], '.0f')} | {_fmt(s['kfac_seconds'], '.1f')} "
            f"| {_fmt(s['steps_ratio'], '.2f')} | {_fmt(s['seconds_ratio'], '.2f')} ({spread}) "
            f"| {s['seconds_per_step_ratio']:.2f} | {reached_count}/{len(paired)} |",
        ]
    )


def plot(path: Path, title: str, metric: str, runs: Sequence[dict[str, Any]], target: Optional[float]) -> Path:
    """Held-out metric against steps and against training seconds, every run, with the target line (if any).
    Runs of one arm share a colour: the base arm blue, K-FAC red, other arms (peers) the rest of a palette."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"base": "tab:blue", "kfac": "tab:red"}
    taken = {to_rgb(c) for c in colors.values()}
    palette = iter(c for c in plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors if to_rgb(c) not in taken)
    labelled: set[str] = set()
    for run in runs:
        steps, seconds, values = zip(*run["curve"])
        label = None if run["arm"] in labelled else run["label"]
        labelled.add(run["arm"])
        color = colors.setdefault(run["arm"], next(palette))
        for ax, x in zip(axes, (steps, seconds)):
            ax.plot(x, values, "o-", ms=3, color=color, alpha=0.7, label=label)
    for ax, xlabel in zip(axes, ("optimizer step", "training wall time (s)")):
        if target is not None:
            ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.4f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- runs
def read_curve(metrics_csv: Path, metric: str) -> Curve:
    """The held-out evaluations of a run's ``metrics.csv`` (rows with ``metric`` filled)."""
    with metrics_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and metric not in rows[0]:
        raise ValueError(f"{metrics_csv}: no column {metric!r} (columns: {sorted(rows[0])})")
    return [(float(r["step"]), float(r["seconds"]), float(r[metric])) for r in rows if r.get(metric)]


def apply_overrides(config: dict[str, Any], assignments: Sequence[str], new_top_keys: bool = False) -> dict[str, Any]:
    """``config`` with each ``a.b.c=JSON`` assignment applied (a value that is not JSON is a string). Unless
    ``new_top_keys``, a new key needs a path below the top (``kfac.eigenvalue_correction``, not
    ``eigenvalue_correction``): DeepSpeed ignores unknown top-level keys, so a forgotten prefix would do nothing."""
    out = copy.deepcopy(config)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY.PATH=VALUE, got {assignment!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        if not parents and leaf not in out and not new_top_keys:
            raise ValueError(
                f"--set {assignment!r}: the config has no top-level key {leaf!r}; keys are paths from the top "
                f"(a K-FAC key is kfac.{leaf}=...)"
            )
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {assignment!r}: {part!r} is not a JSON object in the config")
        node[leaf] = value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_args(task: Task, config: Path, seed: int, out: Path, run_name: str, extra: Sequence[str]) -> list[str]:
    """The example's script and its arguments for one run, as :func:`launch` hands them to the launcher."""
    args = [str(ROOT / task.script), "--deepspeed_config", str(config), "--seed", str(seed)]
    return [*args, "--output-dir", str(out), "--run-name", run_name, *extra]


def launch(task: Task, config: Path, seed: int, out: Path, run_name: str, extra: Sequence[str], timeout: float) -> None:
    """One run through the ``deepspeed`` launcher on 2 local ranks, in its own process session:
    on failure or timeout the whole group is killed and its DeepSpeed shm segments removed."""
    from ds_kfac.integration.cleanup import run_launcher

    port = str(free_port())
    deepspeed = Path(sys.executable).with_name("deepspeed")
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", port]
    log = out / f"{run_name}.log"
    with log.open("w") as f:
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        code = run_launcher(
            [*cmd, *script_args(task, config, seed, out, run_name, extra)], port, timeout, cwd=ROOT, output=f, env=env
        )
    if code != 0:
        why = f"timed out after {timeout:.0f}s" if code is None else f"failed with exit code {code}"
        raise RuntimeError(f"run {run_name} {why}; see {log}")


def build_phase1(timeout: float, config: Optional[Path] = None) -> Path:
    """The phase-1 run directory of ``config`` (default: the BERT demo's; ``examples/bert/phase1.py``: trained
    once, then reused)."""
    cmd = [sys.executable, str(ROOT / "examples/bert/phase1.py"), "--timeout", str(timeout)]
    cmd += [] if config is None else ["--config", str(config)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def versions() -> dict[str, str]:
    import deepspeed
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "ds_kfac_commit": commit + ("+dirty" if dirty else ""),
        "cpus": str(os.cpu_count()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    task = TASKS[args.task]
    out = args.out / args.task
    (out / "configs").mkdir(parents=True, exist_ok=True)
    base = apply_overrides(json.loads((ROOT / task.base_config).read_text()), args.set_base)
    kfac = apply_overrides(json.loads((ROOT / task.kfac_config).read_text()), args.set)
    configs = {"base": base, "kfac": kfac}
    extra = list(task.smoke_args if args.smoke else ()) + list(args.extra)
    if task.phase1:
        phase1 = args.phase1 or build_phase1(args.timeout)
        extra += ["--init-checkpoint", str(phase1), "--cache-dir", str(ROOT / "runs" / "bert-cache")]
    runs, curves = [], {}
    for i, seed in enumerate(args.seeds):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            name = f"{arm}-seed{seed}"
            path = out / "configs" / f"{name}.json"
            path.write_text(json.dumps(configs[arm], indent=1))
            load = os.getloadavg()[0]
            launch(task, path, seed, out, name, extra, args.timeout)
            curve = curves[arm, seed] = read_curve(out / name / "metrics.csv", task.metric)
            runs.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "label": f"{arm} ({Path(task.base_config if arm == 'base' else task.kfac_config).stem})",
                    "load_before": load,
                    "curve": curve,
                }
            )
            print(
                f"{name}: final {task.metric} {curve[-1][2]:.4f} at step {curve[-1][0]:.0f}, {curve[-1][1]:.1f}s",
                flush=True,
            )
    summary = summarize(
        [curves["base", s] for s in args.seeds], [curves["kfac", s] for s in args.seeds], task.higher_is_better
    )
    result = {
        "task": args.task,
        "command": shlex.join(["python", "benchmarks/time_to_target.py", *sys.argv[1:]]),
        "settings": {
            "world": 2,
            "seeds": args.seeds,
            "metric": task.metric,
            "higher_is_better": task.higher_is_better,
            "base_config": task.base_config,
            "kfac_config": task.kfac_config,
            "set_base": args.set_base,
            "set_kfac": args.set,
            "extra_args": extra,
            "order": "alternating: base first on even seed positions, K-FAC first on odd",
        },
        "configs": configs,
        "versions": versions(),
        "runs": runs,
        "summary": summary,
    }
    result = portable(result)
    (args.out / f"{args.task}.json").write_text(json.dumps(result, indent=1))
    plot(
        args.out / f"{args.task}.png",
        f"time to target: {args.task}, {len(args.seeds)} seeds, 2 ranks",
        task.metric,
        runs,
        summary["target"],
    )
    print(table(args.task, task.metric, summary))
    return result


def compare_runs(base_dir: Path, kfac_dir: Path, metric: str, higher_is_better: bool) -> dict[str, Any]:
    """Time to target of one finished base run and one finished K-FAC run (``make demo``):
    prints the table and writes ``time_to_target.png`` beside the runs."""
    base, kfac = (read_curve(d / "metrics.csv", metric) for d in (base_dir, kfac_dir))
    summary = summarize([base], [kfac], higher_is_better)
    runs = [
        {"arm": "base", "label": base_dir.name, "curve": base},
        {"arm": "kfac", "label": kfac_dir.name, "curve": kfac},
    ]
    title = f"{kfac_dir.name} vs {base_dir.name}"
    png = plot(base_dir.parent / "time_to_target.png", title, metric, runs, summary["target"])
    print(table(title, metric, summary))
    print(f"plot: {png}")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="base and K-FAC runs of a task over seeds, alternating")
    r.add_argument("task", choices=sorted(TASKS))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override in the K-FAC config")
    r.add_argument("--set-base", action="append", default=[], metavar="KEY=JSON", help="override in the base config")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "time_to_target")
    r.add_argument("--smoke", action="store_true", help="a few steps per run: checks the machinery, not the optimizers")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    r.add_argument("--phase1", type=Path, help="bert: the phase-1 run directory (default: examples/bert/phase1.py's)")
    r.add_argument("extra", nargs="*", help="after --: arguments passed to the example")
    t = sub.add_parser("table", help="the Markdown table of saved results")
    t.add_argument("results", type=Path, nargs="+")
    c = sub.add_parser("compare", help="time to target of two finished runs")
    c.add_argument("base_dir", type=Path)
    c.add_argument("kfac_dir", type=Path)
    c.add_argument("--metric", default="held_out_mlm_loss")
    c.add_argument("--higher-is-better", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "table":
        for path in args.results:
            result = json.loads(path.read_text())
            print(f"{result['command']}\n")
            print(table(result["task"], result["settings"]["metric"], result["summary"]) + "\n")
    else:
        compare_runs(args.base_dir, args.kfac_dir, args.metric, args.higher_is_better)


if __name__ == "__main__":
    main()
