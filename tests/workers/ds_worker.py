"""Distributed worker: runs the scenarios of a JSON spec under the deepspeed launcher.

Each scenario builds a fresh ``ds_kfac.initialize`` engine on the shared
problem, trains it, and saves per-rank results to ``<out>/<index>_rank<r>.pt``.
Scenario keys: ``ds`` (DeepSpeed config overrides), ``kfac`` (the section),
``steps``, ``micro``, ``ga``, ``loss_scale`` (injected into ZeRO's static
scaler), ``nan_step`` (a NaN loss in that step), ``skip_steps`` (data steps
left out), ``save`` / ``load`` (checkpoint dir, step to save after),
``expect_error`` (record the exception's message instead of failing), ``freeze`` (names of parameters
set to ``requires_grad=False`` before ``initialize``), ``zero_init`` (build the model under
``deepspeed.zero.Init``), ``model`` (a name of ``problem.MODELS``; default ``"mlp"``), ``load_consolidated`` (a checkpoint dir saved with tag ``ckpt`` at any world size: the
weights through DeepSpeed's ``zero_to_fp32``, K-FAC's state from its file). Parameters are read whole at every
ZeRO stage (gathered under stage 3).
Besides each step's bytes by collective kind (``comm``) the result has its calls (``calls``: ``<kind>_calls``), K-FAC's
memory after each step (``memory_steps``), the process groups ``initialize`` created (``groups``), its seconds
(``initialize_seconds``) and the wall-clock time the first step began (``first_step_at``): benchmarks/scale.py.
After the scenarios, ``ds_kfac.shutdown()`` ends the job; ``<out>/exit_rank<r>.json`` records what it left
(whether this rank's DeepSpeed shared-memory segment existed before and after, and ``dist.is_initialized()``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import problem  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac.comm import STATS  # noqa: E402
from ds_kfac.integration.cleanup import shm_segment  # noqa: E402
from ds_kfac.integration.engine import STATE_FILE  # noqa: E402
from ds_kfac.optimizers.client import SECTION as CLIENT  # noqa: E402
from ds_kfac.optimizers.client import pop_client_optimizer  # noqa: E402

KINDS = ("all_reduce", "reduce", "broadcast", "all_to_all")
"""The collective kinds of :data:`ds_kfac.comm.STATS` a step counts (``"start"``: those ``initialize`` counted)."""
CALLS = tuple(f"{kind}_calls" for kind in KINDS)
"""Their call counts in :data:`ds_kfac.comm.STATS`."""


@contextlib.contextmanager
def counted_groups() -> Iterator[dict[str, int]]:
    """The process groups made meanwhile: ``created``, ``new_group`` calls (every rank makes every group of the job,
    member or not), of them ``ds_kfac``'s and ``deepspeed``'s (by the module calling ``torch.distributed.new_group``),
    and ``held``, those this rank is a member of (torch's registry of live groups)."""
    registry, counts = dist.distributed_c10d._world, {"created": 0, "held": 0, "ds_kfac": 0, "deepspeed": 0}
    original, before = dist.new_group, (registry.group_count, len(registry.pg_map))

    def new_group(*args: Any, **kwargs: Any) -> Any:
        package = sys._getframe(1).f_globals.get("__name__", "").split(".")[0]
        if package in counts:
            counts[package] += 1
        return original(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield counts
    finally:
        dist.new_group = original
        counts.update(created=registry.group_count - before[0], held=len(registry.pg_map) - before[1])


def config(scenario: dict, world: int) -> dict:
    micro, ga = scenario.get("micro", 2), scenario.get("ga", 2)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "train_batch_size": micro * ga * world,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "kfac": scenario.get("kfac", {}),
    }
    cfg.update(scenario.get("ds", {}))
    if CLIENT in cfg:  # the examples' client optimizer section replaces the JSON one
        del cfg["optimizer"]
    return cfg


def run(scenario: dict) -> dict:
    return run_with(train, scenario)


def run_with(train_scenario: Callable[[dict], dict], scenario: dict) -> dict:
    """``train_scenario(scenario)``'s result, or with ``expect_error`` the error it raised (the test asserts on
    the message; ``None`` when it raised none)."""
    if scenario.get("expect_error"):
        try:
            train_scenario(scenario)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
        return {"error": None}
    return train_scenario(scenario)


def train(scenario: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = config(scenario, world)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=scenario.get("zero_init", False)):
        model = problem.MODELS[scenario.get("model", "mlp")]()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in scenario.get("freeze", ()))
    consolidated = scenario.get("load_consolidated")
    if consolidated:
        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(consolidated, tag="ckpt"))
    before, started = dict(STATS), time.perf_counter()
    groups = problem.param_groups(model)
    optimizer = pop_client_optimizer(cfg, groups, seed=0)  # built as the examples build it, or None
    with counted_groups() as created:
        engine, *_ = ds_kfac.initialize(
            model=model, optimizer=optimizer, model_parameters=None if optimizer else groups, config=cfg
        )
    initialize_seconds = time.perf_counter() - started
    initialize_bytes = {k: STATS[k] - before.get(k, 0) for k in KINDS}
    initialize_calls = {k: STATS[k] - before.get(k, 0) for k in CALLS}
    if "loss_scale" in scenario:
        engine.optimizer.loss_scaler.cur_scale = float(scenario["loss_scale"])
    dtype = next(engine.module.parameters()).dtype
    micro, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    kfac = getattr(engine, "kfac", None)
    start = 0
    if "load" in scenario:
        engine.load_checkpoint(scenario["load"])
        start = kfac.steps if kfac else engine.global_steps
    if consolidated:
        kfac.load_state_dict(torch.load(Path(consolidated) / "ckpt" / STATE_FILE, weights_only=True))
        start = kfac.steps
    comm, calls, memory_steps, first_step_at = [], [], [], None
    for step in range(start, scenario["steps"]):
        if step in scenario.get("skip_steps", []):
            continue
        x, y = problem.global_batch(step, micro * ga * world, model)
        first_step_at = first_step_at or time.time()
        before = dict(STATS)
        for m in range(ga):
            rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            out = engine(x[rows].to(engine.device, dtype))
            if kfac is not None:  # does nothing unless the config says fisher: "sampled"
                kfac.sample_fisher(out, "mse", generator=problem.sampling_generator(step, m, rank))
            loss = problem.loss_fn(out, y[rows].to(engine.device))
            if step == scenario.get("nan_step"):
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        comm.append({k: STATS[k] - before.get(k, 0) for k in KINDS})
        calls.append({k: STATS[k] - before.get(k, 0) for k in CALLS})
        memory_steps.append(kfac.memory_usage() if kfac else None)
        if scenario.get("save") and step + 1 == scenario["save"]["at"]:
            engine.save_checkpoint(scenario["save"]["dir"], tag="ckpt")
    layout = kfac.layout if kfac else None
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        whole = [p.detach().float().cpu().clone() for p in params]
    return {
        "params": whole,
        "layers": [(b.name, b.adapter.a_dim, b.adapter.g_dim) for b in kfac.blocks] if kfac else None,
        "kfac_steps": kfac.steps if kfac else None,
        "micro_steps": engine.micro_steps,
        "plan": {n: (p.a_worker, p.g_worker, p.grad_workers) for n, p in kfac.distributor.plan.layers.items()}
        if kfac
        else None,
        "holders": layout.block_holders(kfac.blocks) if kfac else None,
        "kfac": kfac.state_dict() if kfac else None,
        "metrics": kfac.metrics() if kfac else None,
        "comm": comm,
        "start": initialize_bytes,
        "calls": calls,
        "start_calls": initialize_calls,
        "memory_steps": memory_steps,
        "groups": created,
        "initialize_seconds": initialize_seconds,
        "first_step_at": first_step_at,
        "memory": kfac.memory_usage() if kfac else None,
        "factor_buckets": bucket_bytes(kfac),
        "overlapped": kfac.distributor.factor_buckets.overlapped if kfac and kfac.distributor.factor_buckets else 0,
        "split": getattr(layout, "split", None),
        "skipped_steps": engine.skipped_steps,
        "engine": type(engine).__name__,
        "optimizer": type(engine.basic_optimizer).__name__,
        "node": {key: os.environ.get(key) for key in ("LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")},
        "device": str(engine.device),
    }


def bucket_bytes(kfac: Any) -> int:
    """Bytes of the factor reduction's static buckets, allocated during every factor-update step (0: none)."""
    buckets = kfac.distributor.factor_buckets if kfac else None
    return 0 if buckets is None else sum(b.numel for b in buckets.buckets) * buckets.dtype.itemsize


def launched() -> argparse.Namespace:
    """A worker's start under the launcher: its ``--spec`` and ``--out``, one thread, the process group joined."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds_kfac.init_distributed()  # deepspeed.init_distributed, refusing a stale build lock instead of hanging
    return args


def main(run_scenario: Callable[[dict[str, Any]], dict[str, Any]] = run) -> None:
    """The launcher's entry: each scenario of ``--spec`` through ``run_scenario``, saved to ``--out``."""
    args = launched()
    out = Path(args.out)
    for i, scenario in enumerate(json.loads(Path(args.spec).read_text())):
        result = run_scenario(scenario)
        torch.save(result, out / f"{i}_rank{dist.get_rank()}.pt")
    rank, segment = dist.get_rank(), shm_segment(dist.get_rank())
    had_segment = segment.exists()
    ds_kfac.shutdown()
    exit_state = {"had_segment": had_segment, "segment_left": segment.exists(), "initialized": dist.is_initialized()}
    (out / f"exit_rank{rank}.json").write_text(json.dumps(exit_state))


if __name__ == "__main__":
    main()
