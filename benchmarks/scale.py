"""What each rank sends, holds and creates at 4, 8 and 16 CPU ranks, against the planner and one process (issue 68,
items 1 and 2).

Per world size, one ``deepspeed --num_gpus N`` job (gloo, one thread a rank) runs ``tests/workers/ds_worker.py`` over
every placement (comm-opt, hybrid-opt, mem-opt) at ZeRO 0 and 2, and mem-opt at ZeRO 3: ``problem.py``'s
``bert_tiny_shapes`` (the BERT demo's 13 K-FAC layers by shape; ``--model``), 2 micro-batches of 2 examples a rank
and step, ``tests/test_plan.py``'s ``KFAC`` (factors every step, a full decomposition at steps 0 and 2). Per rank and
step it records the bytes and calls of each collective kind (``ds_kfac.comm.STATS``), K-FAC's memory
(``memory_usage()``), the process groups ``initialize`` created, and the job's start-up (launcher start to the first
step). It then holds each run to the planner exactly as the suite does (``test_plan.comparisons``, ZeRO 3
included), its parameters to one process on the same global batch, and lists what per rank grows with the world size.
Writes ``--result`` (JSON) and prints the tables::

    python benchmarks/scale.py --worlds 4 8 16 --steps 4 --out runs/scale --result benchmarks/results/scale.json

On a shared machine run it as ``bash -c 'echo 19 > /proc/self/autogroup; exec nice -n 19 python benchmarks/...'``:
each launcher's session gets this process's autogroup nice (:func:`niced`).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from test_plan import KFAC, comparisons  # noqa: E402  (the suite's comparison of the planner with a run)
from time_to_target import free_port, portable, versions  # noqa: E402
from workers import ds_worker, problem  # noqa: E402

from ds_kfac import KFACPreconditioner  # noqa: E402
from ds_kfac.integration.cleanup import run_launcher  # noqa: E402

MODEL, MICRO, GA = "bert_tiny_shapes", 2, 2
PLACEMENTS = ("comm-opt", "hybrid-opt", "mem-opt")
RUNS = [(p, stage) for stage in (0, 2) for p in PLACEMENTS] + [("mem-opt", 3)]
"""(placement, ZeRO stage) of every scenario; ZeRO 3 takes mem-opt only (``initialize`` refuses the others)."""
PARAMS_TARGET = 1e-5
"""Issue 68's bound on the parameters' distance from one process after 4 steps."""


def scenarios(steps: int, model: str = MODEL) -> dict[str, dict[str, Any]]:
    """Each scenario of a job by name (``comm-opt z0``...): ``ds_worker``'s keys."""
    return {
        f"{p} z{stage}": {
            "model": model,
            "ds": {"zero_optimization": {"stage": stage}},
            "kfac": {**KFAC, "grad_worker_fraction": p},
            "steps": steps,
            "micro": MICRO,
            "ga": GA,
        }
        for p, stage in RUNS
    }


def niced(cmd: list[str]) -> list[str]:
    """``cmd`` run at this process's autogroup nice: ``run_launcher`` starts a session of its own, and a new session is
    a new autogroup at nice 0, which would take the machine's cores from whatever this process was niced to leave
    them to."""
    try:
        nice = int(Path("/proc/self/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return cmd
    return cmd if nice <= 0 else ["bash", "-c", f'echo {nice} > /proc/self/autogroup; exec "$@"', "launcher", *cmd]


def launch(world: int, named: dict[str, dict], out: Path, timeout: float) -> dict[str, Any]:
    """One ``deepspeed --num_gpus world`` job of every scenario on a free port (its DeepSpeed shared-memory segments
    removed afterwards, its session killed on a failure or timeout): each scenario's per-rank results, the job's wall
    seconds and its start-up (launcher start to the first scenario's first step on the last rank to reach it)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "scenarios.json"
    spec.write_text(json.dumps(list(named.values())))
    port = str(free_port())
    deepspeed = Path(sys.executable).with_name("deepspeed")
    worker = [str(ROOT / "tests/workers/ds_worker.py"), "--spec", str(spec), "--out", str(out)]
    cmd = [str(deepspeed), "--num_gpus", str(world), "--master_port", port, *worker]
    log = out / "launch.log"
    started = time.time()
    with log.open("w") as f:
        code = run_launcher(niced(cmd), port, timeout, cwd=ROOT, output=f, env={"OMP_NUM_THREADS": "1"})
    wall = time.time() - started
    if code != 0:
        why = f"timed out after {timeout:.0f}s" if code is None else f"failed with exit code {code}"
        raise RuntimeError(f"{world} ranks {why}; see {log}:\n{log.read_text()[-3000:]}")
    results = {
        name: [torch.load(out / f"{i}_rank{r}.pt", map_location="cpu") for r in range(world)]
        for i, name in enumerate(named)
    }
    exits = [json.loads((out / f"exit_rank{r}.json").read_text()) for r in range(world)]
    first = max(r["first_step_at"] for r in next(iter(results.values())))
    return {
        "command": shlex.join(cmd),
        "results": results,
        "wall_seconds": wall,
        "startup_seconds": first - started,
        "segments_left": sum(e["segment_left"] for e in exits),
    }


def one_process(world: int, steps: int, name: str = MODEL) -> list[torch.Tensor]:
    """The same steps on one process: plain PyTorch and standalone K-FAC (``KFAC``; placement has no meaning on
    one rank), SGD at the JSON's rate, each step's whole global batch (``world`` ranks x ``GA`` x ``MICRO``) at once."""
    model = problem.MODELS[name]()
    optimizer = torch.optim.SGD(problem.param_groups(model), lr=0.1)
    kfac = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    return problem.one_process_steps(model, optimizer, kfac, steps, world * GA * MICRO)


def relative(predicted: int, counted: int) -> float:
    """``counted``'s relative distance from ``predicted`` (infinite where the planner predicted nothing)."""
    if predicted == counted:
        return 0.0
    return abs(counted - predicted) / predicted if predicted else math.inf


def planner(world: int, s: dict, results: list[dict]) -> dict[str, Any]:
    """The planner against one run, every row of ``test_plan.comparisons``: the largest relative error of the bytes
    each rank put into each collective kind at each step, of its memory by category (and factor buckets), of
    ``initialize``'s bytes, and the first rows that differ; ``error``, why it could not compare (the planner refused
    the run, or ZeRO laid the gradients out otherwise)."""
    try:
        rows = comparisons(world, s, results)
    except (AssertionError, SystemExit) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    part = {"bytes": " step ", "memory": (" memory ", " buffers "), "start": " start "}
    out: dict[str, Any] = {}
    for name, keys in part.items():
        keys = (keys,) if isinstance(keys, str) else keys
        errors = [relative(p, c) for what, p, c in rows if any(k in what for k in keys)]
        out[f"{name}_max_rel_err"] = max(errors, default=0.0)
    out["rows"] = len(rows)
    out["differing"] = [list(r) for r in rows if r[1] != r[2]][:8]
    return out


def per_rank(results: list[dict]) -> dict[str, Any]:
    """What one run's ranks sent, called, held and created: per step the largest rank's bytes and calls (all kinds);
    by kind, the largest rank's mean per step; the largest rank's K-FAC memory; the groups ``initialize`` created
    (the job's ``new_group`` calls: K-FAC's, DeepSpeed's) and those the largest rank is a member of; ``initialize``'s
    seconds."""
    steps = range(len(results[0]["comm"]))
    kinds = {k: max(sum(s[k] for s in r["comm"]) / len(steps) for r in results) for k in ds_worker.KINDS}
    calls = {k: max(sum(s[k] for s in r["calls"]) / len(steps) for r in results) for k in ds_worker.CALLS}
    memory = [{k: v for k, v in r["memory"].items() if k != "accumulators"} for r in results]
    return {
        "bytes_per_step": [max(sum(r["comm"][i].values()) for r in results) for i in steps],
        "calls_per_step": [max(sum(r["calls"][i].values()) for r in results) for i in steps],
        "bytes_by_kind": {k: v for k, v in kinds.items() if v},
        "calls_by_kind": {k: v for k, v in calls.items() if v},
        "memory": max(sum(m.values()) for m in memory),
        "memory_by_rank": [sum(m.values()) for m in memory],
        "groups_created": max(r["groups"]["created"] for r in results),
        "groups_kfac": max(r["groups"]["ds_kfac"] for r in results),
        "groups_deepspeed": max(r["groups"]["deepspeed"] for r in results),
        "groups_held": max(r["groups"]["held"] for r in results),
        "initialize_seconds": max(r["initialize_seconds"] for r in results),
    }


def parameters(results: list[dict], expected: list[torch.Tensor]) -> dict[str, Any]:
    """The largest distance of any rank's parameters from one process's, and whether the ranks agree bitwise."""
    distance = max(float((g - w).abs().max()) for r in results for g, w in zip(r["params"], expected))
    same = all(torch.equal(a, b) for r in results[1:] for a, b in zip(r["params"], results[0]["params"]))
    return {"max_abs_diff": distance, "within_target": distance <= PARAMS_TARGET, "ranks_identical": same}


RECORDED = ("comm", "calls", "memory_steps", "start", "start_calls", "groups", "initialize_seconds")
"""What the JSON keeps of each rank's ``ds_worker`` result: per step (``comm``, ``calls``, ``memory_steps``), and
``initialize``'s."""
GROWTH = ("bytes", "calls", "memory", "groups_created", "groups_kfac", "groups_held")


def growth(worlds: dict[int, dict]) -> dict[str, dict[str, dict]]:
    """Per scenario and measure, the largest rank's value at each world size (bytes and calls: the mean per step),
    and whether it grows from the smallest world to the largest."""
    out: dict[str, dict[str, dict]] = {}
    for name in next(iter(worlds.values()))["scenarios"]:
        rows = out.setdefault(name, {})
        for measure in GROWTH:
            values = {}
            for world, w in worlds.items():
                rank = w["scenarios"][name]["per_rank"]
                series = rank.get(f"{measure}_per_step")
                values[world] = sum(series) / len(series) if series else rank[measure]
            first, last = values[min(values)], values[max(values)]
            rows[measure] = {"by_world": values, "grows": last > first, "ratio": last / first if first else None}
    return out


def fmt(x: Optional[float], spec: str = ".2g") -> str:
    return "-" if x is None else "inf" if x == math.inf else format(x, spec)


def tables(worlds: dict[int, dict], grows: dict[str, dict[str, dict]]) -> str:
    """The per-run table, then every measure that grows with the world size."""
    lines = [
        "| ranks | scenario | bytes err | memory err | params vs 1 proc | bytes/step | calls/step | memory KiB "
        "| groups made (K-FAC's)/held | init s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for world, w in worlds.items():
        for name, s in w["scenarios"].items():
            plan, rank, params = s["planner"], s["per_rank"], s["params"]
            errors = (fmt(plan.get("bytes_max_rel_err")), fmt(plan.get("memory_max_rel_err")))
            if "error" in plan:
                errors = ("error",) * 2
            steps = len(rank["bytes_per_step"])
            lines.append(
                f"| {world} | {name} | {errors[0]} | {errors[1]} | {params['max_abs_diff']:.1e}"
                f"{'' if params['ranks_identical'] else ' (ranks differ)'} | {sum(rank['bytes_per_step']) / steps:,.0f}"
                f" | {sum(rank['calls_per_step']) / steps:.1f} | {rank['memory'] / 1024:.1f} | {rank['groups_created']}"
                f" ({rank['groups_kfac']})/{rank['groups_held']} | {rank['initialize_seconds']:.2f} |"
            )
    lines += ["", "| launch | wall s | start-up s |", "| --- | --- | --- |"]
    lines += [
        f"| {world} ranks | {w['wall_seconds']:.1f} | {w['startup_seconds']:.1f} |" for world, w in worlds.items()
    ]
    lines += ["", "Per rank, what grows with the world size (the largest rank; bytes and calls: mean per step):", ""]
    lines += ["| scenario | measure | " + " | ".join(f"{n} ranks" for n in worlds) + " | ratio |"]
    lines += ["| --- | --- | " + " | ".join("---" for _ in worlds) + " | --- |"]
    for name, measures in grows.items():
        for measure, m in measures.items():
            if m["grows"]:
                values = " | ".join(f"{m['by_world'][n]:,.4g}" for n in worlds)
                lines.append(f"| {name} | {measure} | {values} | {fmt(m['ratio'], '.2f')} |")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """``value`` with integer keys as strings and infinities as ``"inf"`` (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default=MODEL, choices=sorted(problem.MODELS), help="a model of problem.py")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scale")
    parser.add_argument("--result", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    named = scenarios(args.steps, args.model)
    worlds: dict[int, dict] = {}
    for world in args.worlds:
        job = launch(world, named, args.out.resolve() / f"w{world}", args.timeout)
        expected = one_process(world, args.steps, args.model)
        worlds[world] = {
            "command": job["command"],
            "wall_seconds": job["wall_seconds"],
            "startup_seconds": job["startup_seconds"],
            "segments_left": job["segments_left"],
            "scenarios": {
                name: {
                    "scenario": named[name],
                    "planner": planner(world, named[name], results),
                    "params": parameters(results, expected),
                    "per_rank": per_rank(results),
                    "ranks": [{k: r[k] for k in RECORDED} for r in results],
                }
                for name, results in job["results"].items()
            },
        }
        print(f"{world} ranks: {job['wall_seconds']:.0f} s, start-up {job['startup_seconds']:.1f} s", flush=True)
    grows = growth(worlds)
    result = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "versions": versions(),
        "model": args.model,
        "micro_batch": MICRO,
        "accumulation": GA,
        "kfac": KFAC,
        "params_target": PARAMS_TARGET,
        "worlds": worlds,
        "growth": grows,
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(jsonable(portable(result)), indent=1) + "\n")
    print(tables(worlds, grows))


if __name__ == "__main__":
    main()
