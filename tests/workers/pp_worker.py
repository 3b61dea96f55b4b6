"""Pipeline-parallel worker for ``test_pipeline.py``, under the real ``deepspeed`` launcher.

Each scenario wraps ``problem.make_model()``'s layers (the same seeded weights on every rank) in a
``PipelineModule`` of ``stages`` stages (data-parallel degree: world / stages), built by ``ds_kfac.initialize``,
and trains ``steps`` optimizer steps with ``engine.train_batch()`` on ``ga`` micro-batches of ``micro`` rows per
data-parallel rank: data-parallel rank ``d``'s micro-batch ``m`` of step ``s`` is rows ``(m * dp + d) * micro ...``
of ``problem.global_batch(s, ...)``, as in ``ds_worker``. Scenario keys: ``stages``, ``ds`` (DeepSpeed config
overrides), ``kfac``, ``steps``, ``micro``, ``ga``, ``save`` / ``load`` (as in ``ds_worker``), ``tied`` (a model
whose first and last Linear are one ``TiedLayerSpec``), ``checkpoint_interval`` (``PipelineModule``'s
``activation_checkpoint_interval``), ``corrupt`` (a file of the checkpoint to load, overwritten first),
``expect_error``. Records this rank's stage weights,
K-FAC's layers and ``nu``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import ds_worker  # noqa: E402
import problem  # noqa: E402

import ds_kfac  # noqa: E402


def pipeline_model(scenario: dict) -> PipelineModule:
    if scenario.get("tied"):
        tied = TiedLayerSpec("ends", nn.Linear, problem.IN, problem.IN)
        layers: list[Any] = [tied, nn.Tanh(), nn.Linear(problem.IN, problem.IN), nn.Tanh(), tied]
        pad = nn.Linear(problem.IN, problem.OUT)  # the loss compares OUT columns
        layers.append(pad)
    else:
        layers = list(problem.make_model())
    interval = scenario.get("checkpoint_interval", 0)
    return PipelineModule(
        layers=layers, num_stages=scenario["stages"], loss_fn=problem.loss_fn, activation_checkpoint_interval=interval
    )


def batches(
    step: int, micro: int, ga: int, dp: int, dp_rank: int, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y = problem.global_batch(step, micro * ga * dp)
    for m in range(ga):
        rows = slice((m * dp + dp_rank) * micro, (m * dp + dp_rank + 1) * micro)
        yield x[rows].to(dtype), y[rows]


def run(scenario: dict) -> dict:
    return ds_worker.run_with(train, scenario)


def train(scenario: dict) -> dict:
    world = dist.get_world_size()
    dp = world // scenario["stages"]
    cfg = ds_worker.config(scenario, dp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = ds_kfac.initialize(model=pipeline_model(scenario), config=cfg)
    micro, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    if "load" in scenario:
        if "corrupt" in scenario and dist.get_rank() == 0:  # one stage's K-FAC state file, overwritten
            (Path(scenario["load"]) / "ckpt" / scenario["corrupt"]).write_bytes(b"not a state")
        dist.barrier()
        engine.load_checkpoint(scenario["load"])
    kfac, dp_rank = engine.kfac, engine.grid.get_data_parallel_rank()
    dtype = next(engine.module.parameters()).dtype
    nus = []
    for step in range(kfac.steps, scenario["steps"]):
        engine.train_batch(data_iter=batches(step, micro, ga, dp, dp_rank, dtype))
        nus.append(None if kfac.last_nu is None else float(kfac.last_nu))
        if scenario.get("save") and step + 1 == scenario["save"]["at"]:
            engine.save_checkpoint(scenario["save"]["dir"], tag="ckpt")
    return {
        "engine": type(engine).__name__,
        "stage": engine.stage_id,
        "dp_rank": dp_rank,
        "params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "layers": kfac.layer_names,
        "skipped": [(s.name, s.reason) for s in kfac.skipped_layers],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        "nus": nus,
        "kfac_steps": kfac.steps,
        "kfac": kfac.state_dict(),
        "grad_workers": {n: p.grad_workers for n, p in kfac.distributor.plan.layers.items()},
        "overlapped": kfac.distributor.factor_buckets.overlapped if kfac.distributor.factor_buckets else 0,
    }


if __name__ == "__main__":
    ds_worker.main(run)
