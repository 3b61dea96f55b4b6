"""Fixtures shared by the test modules."""

from __future__ import annotations

from typing import Any, Iterator

import launch
import pytest
import torch

import ds_kfac


@pytest.fixture(autouse=True)
def _torch_linear_restored() -> Iterator[None]:
    """``torch.nn.functional.linear`` as it was before the test: a ZeRO 3 engine built in this process replaces it
    for good with DeepSpeed's autograd Function (DeepSpeed says so: "This will persist unless manually reset")."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The launcher's environment for one rank in this process; the process group is shut down afterwards."""
    for key, value in launch.one_rank_env().items():
        monkeypatch.setenv(key, value)
    # TrainingArguments(deepspeed=...) sets this in os.environ for good; restored (unset) after the test, so a later
    # Trainer built without DeepSpeed is not taken for a DeepSpeed one.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    yield
    ds_kfac.shutdown()


@pytest.fixture
def engines(one_rank: None) -> Iterator[list[Any]]:
    """Engines a test builds on one rank, destroyed afterwards (which restores Python's GC if they disabled it)."""
    built: list[Any] = []
    yield built
    for engine in built:
        engine.destroy()
