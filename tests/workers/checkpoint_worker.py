"""Checkpoint worker for ``test_checkpoints.py``, under the real ``deepspeed`` launcher (2 ranks).

Scenarios (a JSON list, each with ``ds`` and ``kfac`` overrides):

* ``{"gather": ...}``: train 3 steps, then call ``engine.kfac.state_dict()`` (what
  ``save_checkpoint`` gathers) while counting the bytes of every tensor this rank receives
  through ``torch.distributed`` (all of its collective and point-to-point calls, found with a
  ``TorchFunctionMode``, so any way of moving data is counted). Records the state, the bytes,
  and copies of the state tensors this rank held itself.
* ``{"refused": dir}``: train 2 steps, save, train 1 more; rank 0 puts a NaN into layer ``2``'s
  ``A`` in the saved K-FAC file; every rank tries to load it, records the error and its whole
  engine (weights, optimizer state, counters, K-FAC) before and after; then the same with the good file cut
  to each of :data:`CUTS` of its size (a copy interrupted near its end); then the good file is put back and
  loaded.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).parent))
import ds_worker  # noqa: E402
import problem  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac.integration.engine import STATE_FILE  # noqa: E402

MICRO, GA = 2, 2
CUTS = (0.99, 0.9, 0.5, 0.1)
"""Fractions of the K-FAC state file's size that the ``refused`` scenario truncates it to."""


class ReceivedBytes(TorchFunctionMode):
    """Bytes of tensor data that torch.distributed calls deliver to this rank, by ``float`` (floating
    point) and ``other`` dtypes, and the names of the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            self.calls[func.__name__] += 1
            for t in _delivered(func, inspect.signature(func).bind(*args, **kwargs).arguments):
                self.bytes["float" if t.is_floating_point() else "other"] += t.numel() * t.element_size()
        return func(*args, **kwargs)


def _delivered(func: Any, a: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a torch.distributed call writes on this rank with data from other ranks."""
    me, name = dist.get_rank(), func.__name__
    if name in ("recv", "irecv", "all_reduce", "scatter"):
        return [a["tensor"]]
    if name == "broadcast":
        return [a["tensor"]] if a.get("src") != me else []
    if name in ("all_gather", "gather"):
        lists = a.get("tensor_list") or a.get("gather_list") or []
        return [t for i, t in enumerate(lists) if i != dist.get_rank(a.get("group"))]
    if name == "all_gather_into_tensor":
        return [a["output_tensor"]]
    if name in ("send", "isend", "barrier"):
        return []
    raise AssertionError(f"the byte count does not know torch.distributed.{name}")


def config(scenario: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GA,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "kfac": {"damping": 0.01, "kl_clip": 0.01, **scenario.get("kfac", {})},
    }
    cfg.update(scenario.get("ds", {}))
    return cfg


def train(engine: Any, steps: range) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        x, y = problem.global_batch(step, MICRO * GA * world)
        for m in range(GA):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(problem.loss_fn(engine(x[rows]), y[rows]))
            engine.step()


def own(kfac: Any) -> dict[str, dict[str, Any]]:
    """Copies of the state tensors this rank holds itself, per layer and entry (``None`` where it holds none)."""
    out = {b.name: {"A": _copy(b.a.value), "G": _copy(b.g.value), "state": _copy(b.decomposition)} for b in kfac.blocks}
    if kfac.refresh is not None:
        for (name, side), f in kfac.refresh.factors.items():
            out[name][f"{side}_refs"] = [_copy(f.last), _copy(f.before_last)]
    return out


def _copy(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (containers rebuilt, anything else kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def engine_state(engine: Any) -> dict[str, Any]:
    """Everything a load would change, copied: weights, optimizer state, counters, K-FAC."""
    kfac = engine.kfac
    return {
        "params": [p.detach().clone() for p in engine.module.parameters()],
        # The base optimizer's state (momentum) and, under ZeRO, the fp32 partitions it updates.
        "optimizer": _copy(engine.basic_optimizer.state_dict()),
        "fp32_partitions": _copy(getattr(engine.optimizer, "single_partition_of_fp32_groups", [])),
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
        "kfac": {
            "steps": kfac.steps,
            "counters": dict(kfac.counters),
            "layers": {
                b.name: _copy([t for t in (b.a.value, b.g.value, *(b.decomposition or ())) if t is not None])
                for b in kfac.blocks
            },
        },
    }


def gather(scenario: dict) -> dict:
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=config(scenario))
    train(engine, range(3))
    with ReceivedBytes() as received:
        state = engine.kfac.state_dict()
    return {"state": state, "bytes": dict(received.bytes), "calls": dict(received.calls), "own": own(engine.kfac)}


def refused(scenario: dict) -> dict:
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=config(scenario))
    ckpt = scenario["refused"]
    train(engine, range(2))
    engine.save_checkpoint(ckpt, tag="ckpt")
    train(engine, range(2, 3))
    path = os.path.join(ckpt, "ckpt", STATE_FILE)
    good = Path(path).read_bytes() if dist.get_rank() == 0 else None
    if good is not None:
        state = torch.load(path, weights_only=True)
        state["layers"]["2"]["A"][0, 0] = float("nan")
        torch.save(state, path)
    dist.barrier()
    before = engine_state(engine)
    try:
        engine.load_checkpoint(ckpt)
        error = None
    except ValueError as err:
        error = str(err)
    after = engine_state(engine)
    truncated = {}
    for cut in CUTS:
        dist.barrier()
        if good is not None:
            Path(path).write_bytes(good[: int(len(good) * cut)])
        dist.barrier()
        try:
            engine.load_checkpoint(ckpt)
            truncated[cut] = None
        except ValueError as err:
            truncated[cut] = str(err)
    after_truncated = engine_state(engine)
    dist.barrier()
    if good is not None:
        Path(path).write_bytes(good)
    dist.barrier()
    engine.load_checkpoint(ckpt)
    return {
        "error": error,
        "before": before,
        "after": after,
        "truncated": truncated,
        "after_truncated": after_truncated,
        "reloaded": engine_state(engine),
    }


if __name__ == "__main__":
    ds_worker.main(lambda scenario: refused(scenario) if "refused" in scenario else gather(scenario))
