"""ds_kfac.shutdown(): the one call that ends a distributed job cleanly (issue 14, item 13)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import launch
import pytest
import torch
import torch.distributed as dist

import ds_kfac

pytestmark = pytest.mark.timeout(120)


def test_shutdown_is_a_no_op_without_distributed_and_idempotent_with_it(tmp_path: Path) -> None:
    """Issue 14, item 13: safe to call where torch.distributed is not initialized, and twice.
    With it initialized (one gloo rank, a subgroup as K-FAC creates), the first call ends it."""
    assert not dist.is_initialized()
    ds_kfac.shutdown()
    ds_kfac.shutdown()
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    dist.new_group([0])
    ds_kfac.shutdown()
    assert not dist.is_initialized()
    ds_kfac.shutdown()
    assert not dist.is_initialized()


EXIT_SCENARIO = {"ds": {"zero_optimization": {"stage": 2}}, "kfac": {"grad_worker_fraction": 0.5}, "steps": 1}
"""The last scenario of the 2-rank job: ZeRO 2, with K-FAC's own groups."""


def test_two_rank_job_ends_with_no_segment_and_no_process_group(two_rank_job: dict[str, Any]) -> None:
    """Issue 14, item 13: a 2-rank K-FAC job under ZeRO 2 (DeepSpeed's groups and K-FAC's own) that
    ends with ds_kfac.shutdown() exits 0 on both ranks (launch.run raises otherwise), leaves no
    /dev/shm segment behind (checked before the launcher's own clean-up), and neither rank is still
    initialized after the call (the job: conftest.py's, which ends with :data:`EXIT_SCENARIO`)."""
    exits = two_rank_job["exits"]
    assert two_rank_job["left"] == []
    assert [e["initialized"] for e in exits] == [False, False]
    assert [e["segment_left"] for e in exits] == [False, False]
    # The segments existed until shutdown (on CPU: GPU jobs create none), so the checks above are not vacuous.
    assert [e["had_segment"] for e in exits] == [not torch.cuda.is_available()] * 2


ENGINE_FREED_AT_EXIT = """
import atexit, weakref
import torch
import ds_kfac

engine_ref = []
# Registered first, so it runs last among the exit handlers: after the collection shutdown() registered.
atexit.register(lambda: print("engine freed before teardown:", engine_ref[0]() is None, flush=True))


def main():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "kfac": {"kl_clip": None}}
    engine, *_ = ds_kfac.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    engine_ref.append(weakref.ref(engine))
    ds_kfac.shutdown()


main()
"""


def test_the_engine_and_its_process_groups_are_freed_before_the_interpreter_tears_down() -> None:
    """A DeepSpeed engine sits in reference cycles, so without a collection it and the gloo groups it references are
    freed only once the interpreter's teardown has begun, where gloo can abort ("terminate called without an active
    exception"; seen about once in two full test runs, in the batch-scaling smoke launch). ``shutdown()`` registers
    a collection at exit: by the last exit handler the engine is gone."""
    (out,) = launch.run([[sys.executable, "-c", ENGINE_FREED_AT_EXIT]], timeout=120, env=launch.one_rank_env())
    assert "engine freed before teardown: True" in out
