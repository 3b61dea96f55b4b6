"""What K-FAC's hooks cost on the micro-batches that do not gather factors (issue 45, item 5).

Most micro-batches gather nothing (the recipes gather from the last micro-batch of every 5th step), yet every
registered layer's forward hook runs on them to see that. This measures that cost alone, in one process and one
thread: two copies of a step-cost workload's model with the same weights, one with a
:class:`ds_kfac.KFACPreconditioner` attached (its section as the workload's config ships it; one step taken, so
factors, bases and the key's moments exist), the other bare; then ``--repeats`` rounds, each one plain micro-batch's
forward and backward on either model, in alternating order, the same batch for both::

    python benchmarks/hook_cost.py --workloads bert-base-l2 bert-demo --repeats 30 --out benchmarks/results/issue45/hook_cost.json
    python benchmarks/hook_cost.py --device cuda --workloads bert-base --repeats 30   # on a GPU (benchmarks/gpu/)

Output: per workload the median milliseconds of each model's micro-batch, the median of the per-round ratios
K-FAC/bare with its range, and the added milliseconds per micro-batch and per registered layer.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_cost  # noqa: E402
from time_to_target import portable, versions  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac import KFACPreconditioner  # noqa: E402

ROOT = step_cost.ROOT


def measure(name: str, repeats: int, device: torch.device, smoke: bool) -> dict[str, Any]:
    """One workload: both models' plain micro-batch, ``repeats`` alternating rounds (see the module docstring)."""
    workload = step_cost.WORKLOADS[name]
    torch.manual_seed(0)
    bare = workload.build(smoke).to(device).train()
    hooked = copy.deepcopy(bare)
    section = {**step_cost.shipped_section(name), "factor_update_steps": 10**6, "inv_update_steps": 10**6}
    optimizer = step_cost.kfac_optimizer(hooked, section, workload.optimizer)
    kfac = KFACPreconditioner(hooked, section, optimizer=optimizer, accumulation_steps=1)
    generator = torch.Generator().manual_seed(0)
    batch = {k: v.to(device) for k, v in workload.batch(smoke, generator).items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def micro_batch(model: torch.nn.Module) -> float:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        workload.forward(model, batch).loss.backward()
        sync()
        return (time.perf_counter() - start) * 1e3

    micro_batch(hooked)  # step 0 gathers factors and decomposes; every later step of this section gathers nothing
    kfac.step()
    times: dict[str, list[float]] = {"bare": [], "kfac": []}
    for round_ in range(repeats + 1):
        order = (("bare", bare), ("kfac", hooked)) if round_ % 2 else (("kfac", hooked), ("bare", bare))
        for arm, model in order:
            ms = micro_batch(model)
            if round_:  # the first round warms both up
                times[arm].append(ms)
    ratios = [k / b for k, b in zip(times["kfac"], times["bare"])]
    added = statistics.median(k - b for k, b in zip(times["kfac"], times["bare"]))
    layers = len(kfac.layer_names)
    return {
        "workload": name,
        "registered_layers": layers,
        "median_ms": {arm: statistics.median(t) for arm, t in times.items()},
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "added_ms": {"per_micro_batch": added, "per_layer": added / layers},
        "times_ms": times,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads", nargs="+", default=["bert-base-l2", "bert-demo"], choices=list(step_cost.WORKLOADS)
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (step_cost's ranks use one)")
    parser.add_argument("--smoke", action="store_true", help="the workloads' smoke sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "hook_cost.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    try:
        results = [measure(name, args.repeats, device, args.smoke) for name in args.workloads]
    finally:
        ds_kfac.shutdown()
    out = {
        "benchmark": "hook_cost",
        "command": shlex.join(["python", "benchmarks/hook_cost.py", *sys.argv[1:]]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": versions(),
        "workloads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = portable(out)
    args.out.write_text(json.dumps(out, indent=1))
    for r in results:
        print(
            f"{r['workload']}: bare {r['median_ms']['bare']:.2f} ms, K-FAC {r['median_ms']['kfac']:.2f} ms a plain "
            f"micro-batch; ratio {r['ratio']['median']:.4f} ({r['ratio']['min']:.3f}-{r['ratio']['max']:.3f}), "
            f"+{r['added_ms']['per_micro_batch']:.3f} ms ({1e3 * r['added_ms']['per_layer']:.1f} us a layer)"
        )


if __name__ == "__main__":
    main()
