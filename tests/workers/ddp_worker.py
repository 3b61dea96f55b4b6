"""Standalone (no DeepSpeed) distributed worker: DDP + KFACPreconditioner under torchrun.

Runs the scenarios of a JSON spec (``kfac`` keys, ``steps``, ``model``, ``passes``:
forward/backward passes per step, ``expect_error``: record a RuntimeError's message
instead of failing; with ``fisher: "sampled"`` each pass samples with the rank's
generator of ``problem.sampling_generator``) and saves, per rank, the parameters after every step, K-FAC's
per-rank memory, the bytes of each collective kind per step, and the placement plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
import problem  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac import KFACPreconditioner  # noqa: E402
from ds_kfac.comm import STATS  # noqa: E402

KINDS = ("all_reduce", "reduce", "broadcast")


def run(scenario: dict) -> dict:
    if scenario.get("expect_error"):
        try:
            train(scenario)
        except RuntimeError as err:  # the test asserts on the message
            return {"error": str(err)}
        return {"error": None}
    return train(scenario)


def train(scenario: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = problem.MODELS[scenario.get("model", "mlp")]()
    ddp = DistributedDataParallel(model)
    opt = problem.make_optimizer(model, scenario["kfac"])
    kfac = KFACPreconditioner(model, optimizer=opt, **scenario["kfac"])
    per_rank = scenario.get("per_rank", 2)
    params, comm = [], []
    for step in range(scenario["steps"]):
        x, y = problem.global_batch(step, per_rank * world, model)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        before = {k: STATS[k] for k in KINDS}
        opt.zero_grad()
        for _ in range(scenario.get("passes", 1)):
            out = ddp(x[rows])
            kfac.sample_fisher(out, "mse", generator=problem.sampling_generator(step, 0, rank))  # fisher: "sampled"
            problem.loss_fn(out, y[rows]).backward()
        kfac.step()
        opt.step()
        comm.append({k: STATS[k] - before[k] for k in KINDS})
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    plan = kfac.distributor.plan
    buckets = kfac.distributor.factor_buckets
    return {
        "params": params,
        "comm": comm,
        "memory": kfac.memory_usage(),
        "overlapped": buckets.overlapped if buckets is not None else 0,
        "buckets": len(buckets.buckets) if buckets is not None else 0,
        "layers": {name: (p.a_worker, p.g_worker, p.grad_workers) for name, p in plan.layers.items()},
        "shapes": {b.name: (b.adapter.a_dim, b.adapter.g_dim) for b in kfac.blocks},
        "sides": {b.name: b.sides for b in kfac.blocks},
        "kfac": kfac.state_dict(),  # the whole state on rank 0, None on the others
        "refresh": kfac.refresh.state_dict() if kfac.refresh is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.out)
    for i, scenario in enumerate(json.loads(Path(args.spec).read_text())):
        torch.save(run(scenario), out / f"{i}_rank{dist.get_rank()}.pt")
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
