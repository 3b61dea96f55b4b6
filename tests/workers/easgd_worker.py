"""EASGD worker for ``test_easgd.py``, under the real ``deepspeed`` launcher (2 ranks).

Each scenario trains ``ds_worker``'s problem with ``"easgd"`` (and optionally ``"kfac"``) on ``steps``
optimizer steps of ``ga`` micro-batches of ``micro`` rows each: rank ``r``'s micro-batch ``m`` of step ``s`` is
rows ``(m * world + r) * micro ...`` of ``problem.global_batch(s, ...)``, as in ``ds_worker``. Scenario keys:
``ds`` (DeepSpeed config overrides), ``easgd``, ``kfac``, ``steps``, ``ga``, ``save`` / ``load`` (as in
``ds_worker``). Records this rank's weights, the center, the learning rate of each step and the bytes sent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ds_worker  # noqa: E402
import problem  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac.comm import STATS  # noqa: E402


def train(scenario: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = ds_worker.config(scenario, world)
    cfg["easgd"] = scenario["easgd"]
    if "kfac" not in scenario:
        del cfg["kfac"]
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=cfg)
    micro, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    dtype = next(engine.module.parameters()).dtype
    if "load" in scenario:
        engine.load_checkpoint(scenario["load"])
    lrs, before = [], dict(STATS)
    for step in range(engine.global_steps, scenario["steps"]):
        x, y = problem.global_batch(step, micro * ga * world)
        lrs.append(engine.get_lr()[0])
        for m in range(ga):
            rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            engine.backward(problem.loss_fn(engine(x[rows].to(dtype)), y[rows]))
            engine.step()
        if scenario.get("save") and step + 1 == scenario["save"]["at"]:
            engine.save_checkpoint(scenario["save"]["dir"], tag="ckpt")
    with engine.easgd.center_swapped_in():
        swapped = [p.detach().clone() for p in engine.module.parameters()]
    return {
        "params": [p.detach().float().clone() for p in engine.module.parameters()],
        "center": {n: c.clone() for n, c in engine.easgd.center_state_dict().items()},
        "swapped": swapped,
        "lrs": lrs,
        "bytes": {k: STATS[k] - before.get(k, 0) for k in ("easgd_all_reduce", "all_reduce", "reduce", "broadcast")},
        "engine": type(engine).__name__,
    }


if __name__ == "__main__":
    ds_worker.main(train)
