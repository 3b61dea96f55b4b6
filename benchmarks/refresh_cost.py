"""A refresh's cost with ``eigenbasis_moments``, one process: the key's defaults against other refresh settings.

An MLP of BERT-small's FFN shapes (512 -> 2048 -> 512, twice: ``A`` 513 and 2049 wide, ``G`` 2048 and 512), 2,048
rows a step, factors every step, a refresh every 5, JSON-AdamW-like ``ds_kfac.optimizers.Adam`` with the key's
flagged groups, one thread. Two kinds of data: ``structured`` (inputs with a ``1/i`` spectrum in a random basis, a
fixed tanh teacher: factors with spread spectra, bases that settle) and ``isotropic`` (Gaussian inputs and targets:
flat spectra, bases that keep turning)::

    python benchmarks/refresh_cost.py run --out benchmarks/results/refresh_cost.json
    python benchmarks/refresh_cost.py run --arms defaults --data structured --steps 10   # a quick look
    python benchmarks/refresh_cost.py run --smoke --out /tmp/refresh_cost.json          # tiny shapes (the tests)

Arms (each a ``"kfac"`` section; the key, ``factor_update_steps`` 1 and ``inv_update_steps`` 5 in all):

* ``defaults``: nothing else: the key's defaults (``config/schema.py::MOMENTS_DEFAULTS``);
* ``bert_config``: the refresh keys of ``configs/bert_cpu_phase2_kfac.json`` (``basis_update``, ``refresh_spread``,
  ``basis_keep_drift``, ``basis_max_drift``);
* ``unspread``: ``refresh_spread`` false and ``basis_keep_drift`` 0 (the key's defaults before issue 62: every
  refresh at the cycle's first step, every warm side a subspace step);
* ``eigh``: ``basis_update: "eigh"`` (a full decomposition every refresh, every refresh at the cycle's first step).

Method. The first cycle (steps 0-4: step 0 decomposes every side in full) is a warm-up; ``--steps`` counts the
steps after it (default 15: three cycles). A step is timed end to end (``zero_grad``, forward, backward,
``kfac.step()``, ``optimizer.step()``); a refresh is K-FAC's ``decompose`` and ``stack`` phases
(``kfac.timings``: the decompositions, the moments moved onto new bases, the stacks re-copied), summed over the
measured steps. Its floor is ``torch.linalg.eigh`` in float32 of every factor once per measured cycle (the factors
as they were at each cycle's first step), timed in the same process right after the arm: ``refresh / floor`` is
what the measured cycles' refreshes cost against one float32 ``eigh`` of each factor per cycle. ``slowest /
median`` is over the measured steps.

Output (``--out``, and a Markdown table on stdout)::

    {"benchmark": "refresh_cost", "command", "settings": {arms, data, steps, rows, dims, threads},
     "versions", "load_average": {"before", "after"},
     "arms": {arm: {"kfac": {the section}, "data": {kind: {"step_ms": [...], "median_ms", "slowest_ms",
                    "slowest_over_median", "refresh_ms", "floor_ms", "refresh_over_floor",
                    "refreshes": {"full", "subspace", "kept"} (in the measured steps), "drift_mean", "drift_max"
                    (of every drift test, the warm-up's included)}}}}}
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from time_to_target import versions  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac import KFACConfig, KFACPreconditioner  # noqa: E402
from ds_kfac.curvature import REFRESH_KINDS  # noqa: E402
from ds_kfac.optimizers import Adam, split_groups  # noqa: E402

CADENCE = {"eigenbasis_moments": True, "factor_update_steps": 1, "inv_update_steps": 5}
REFRESH_KEYS = ("basis_update", "refresh_spread", "basis_keep_drift", "basis_max_drift")
SHIPPED = ROOT / "configs/bert_cpu_phase2_kfac.json"
ARMS = ("defaults", "bert_config", "unspread", "eigh")
DATA = ("structured", "isotropic")
FULL = {"dims": (512, 2048), "rows": 2048}
SMOKE = {"dims": (16, 48), "rows": 64}


def kfac_section(arm: str) -> dict[str, Any]:
    """The ``"kfac"`` section of ``arm`` (see the module's docstring)."""
    if arm == "defaults":
        return dict(CADENCE)
    if arm == "bert_config":
        shipped = json.loads(SHIPPED.read_text())["kfac"]
        return {**CADENCE, **{k: shipped[k] for k in REFRESH_KEYS if k in shipped}}
    if arm == "unspread":
        return {**CADENCE, "refresh_spread": False, "basis_keep_drift": 0.0}
    return {**CADENCE, "basis_update": "eigh"}


def mlp(dims: tuple[int, int]) -> nn.Module:
    """``hidden -> inner -> hidden``, twice, with GELUs (BERT's FFN shapes at BERT-small's 512 / 2048)."""
    torch.manual_seed(0)
    hidden, inner = dims
    return nn.Sequential(
        nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden), nn.GELU(),
        nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden),
    )  # fmt: skip


def batches(kind: str, hidden: int, rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's inputs and targets (the same stream for every arm)."""
    g = torch.Generator().manual_seed(1)
    if kind == "isotropic":
        while True:
            yield torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))[0]
    scale = torch.arange(1, hidden + 1).reciprocal().sqrt()
    teacher = torch.randn(hidden, hidden, generator=g) / hidden**0.5
    while True:
        x = (torch.randn(rows, hidden, generator=g) * scale) @ basis.T
        yield x, torch.tanh(x @ teacher)


def measure(arm: str, kind: str, steps: int, dims: tuple[int, int], rows: int) -> dict[str, Any]:
    """One arm on one kind of data: its measured steps, refreshes and their floor."""
    keys = kfac_section(arm)
    warmup = keys["inv_update_steps"]
    model = mlp(dims)
    layers = ds_kfac.preconditioned_parameters(model, KFACConfig.parse(keys))
    optimizer = Adam(split_groups(model.parameters(), layers), lr=1e-3, eps=1e-6, weight_decay=0.01)
    kfac = KFACPreconditioner(model, optimizer=optimizer, **keys)
    step_s, refresh_s, factors = [], 0.0, []
    data = batches(kind, dims[0], rows)
    for step in range(warmup + steps):
        x, y = next(data)
        kfac.timer.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        kfac.step()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step < warmup:
            counted = {how: kfac.metrics()[f"kfac/refresh/{how}"] for how in REFRESH_KINDS}
            continue
        step_s.append(elapsed)
        refresh_s += sum(kfac.timings.get(p, 0.0) for p in ("decompose", "rebase", "stack"))
        if step % warmup == 0:
            factors.append([f.value.clone() for b in kfac.blocks for f in (b.a, b.g)])
    start = time.perf_counter()
    for cycle in factors:
        for factor in cycle:
            torch.linalg.eigh(factor.float())
    floor_s = time.perf_counter() - start
    metrics = kfac.metrics()
    median = statistics.median(step_s)
    return {
        "step_ms": [round(1e3 * s, 3) for s in step_s],
        "median_ms": 1e3 * median,
        "slowest_ms": 1e3 * max(step_s),
        "slowest_over_median": max(step_s) / median,
        "refresh_ms": 1e3 * refresh_s,
        "floor_ms": 1e3 * floor_s,
        "refresh_over_floor": refresh_s / floor_s,
        "refreshes": {how: int(metrics[f"kfac/refresh/{how}"] - counted[how]) for how in REFRESH_KINDS},
        **{k: metrics[f"kfac/refresh/{k}"] for k in ("drift_mean", "drift_max") if f"kfac/refresh/{k}" in metrics},
    }


def table(result: dict[str, Any]) -> str:
    head = "| arm | data | median step ms | slowest / median | refresh / float32-eigh floor | full / subspace / kept |"
    rows = [head, "| --- | --- | --- | --- | --- | --- |"]
    for arm, entry in result["arms"].items():
        for kind, r in entry["data"].items():
            counts = " / ".join(str(r["refreshes"][k]) for k in REFRESH_KINDS)
            rows.append(
                f"| {arm} | {kind} | {r['median_ms']:.0f} | {r['slowest_over_median']:.2f} | "
                f"{r['refresh_over_floor']:.2f} | {counts} |"
            )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    shape = SMOKE if args.smoke else FULL
    load_before = os.getloadavg()
    arms = {
        arm: {
            "kfac": kfac_section(arm),
            "data": {kind: measure(arm, kind, args.steps, shape["dims"], shape["rows"]) for kind in args.data},
        }
        for arm in args.arms
    }
    return {
        "benchmark": "refresh_cost",
        "command": "python benchmarks/refresh_cost.py " + shlex.join(args.argv),
        "settings": {"arms": list(args.arms), "data": list(args.data), "steps": args.steps, "threads": 1, **shape},
        "versions": versions(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "arms": arms,
    }


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python benchmarks/refresh_cost.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    go.add_argument("--data", nargs="+", choices=DATA, default=list(DATA))
    go.add_argument("--steps", type=int, default=15, help="measured steps after the first cycle")
    go.add_argument("--smoke", action="store_true", help="tiny shapes (the tests)")
    go.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = argv
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
