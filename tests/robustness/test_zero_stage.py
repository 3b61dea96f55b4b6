"""Resuming at another ZeRO stage (issue 22, item 4): one rank, in this process.

DeepSpeed 0.19.8 loads ZeRO 1 and 2 checkpoints into each other; across 3 and 0-2 it fails with a bare
``AssertionError`` (and from 0 to 1-2 or back with optimizer states, with a ``FileNotFoundError`` or an
``AttributeError`` after loading the weights). ``engine.load_checkpoint`` now reads the stage from DeepSpeed's files
first and refuses, naming both stages and the supported path, with nothing loaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from workers import problem

import ds_kfac
from ds_kfac.integration.engine import STATE_FILE

pytestmark = pytest.mark.timeout(120)


def _engine(stage: int, model: torch.nn.Module | None = None):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "kfac": {"damping": 0.01, "grad_worker_fraction": "mem-opt"},
    }
    engine, *_ = ds_kfac.initialize(model=model or problem.make_model(), config=config)
    x, y = problem.global_batch(0, 4)
    engine.backward(problem.loss_fn(engine(x), y))
    engine.step()
    return engine


def _weights(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _refused(engine, path: Path, saved: int, **kwargs) -> str:
    """The ``ValueError`` of loading ``path`` (tag ``ckpt``), after checking it changed nothing."""
    before = (_weights(engine), engine.global_steps, engine.kfac.steps)
    with pytest.raises(ValueError) as caught:
        engine.load_checkpoint(str(path), tag="ckpt", **kwargs)
    after = (_weights(engine), engine.global_steps, engine.kfac.steps)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]
    message = str(caught.value)
    current = engine.zero_optimization_stage()
    assert message.startswith(
        f"checkpoint {path}{os.sep}ckpt was saved at ZeRO stage {saved} and this engine runs ZeRO stage {current}: "
        f"DeepSpeed cannot load it across that change (nothing was loaded). Resume at stage {saved}, or restore "
        f"the weights with "
    ), message
    assert "engine.kfac.load_state_dict(torch.load(<its kfac_state.pt>))" in message
    return message


def test_a_checkpoint_of_another_zero_stage_is_refused_naming_both(one_rank: None, tmp_path: Path) -> None:
    """Saved at 0, 2 and 3: 2 -> 3, 3 -> 2 and 0 -> 2 are refused, and 2 -> 0 with optimizer states; 2 -> 0 with
    ``load_optimizer_states=False`` loads (DeepSpeed can). The path the message gives works: the weights through
    ``zero_to_fp32`` before ``initialize`` at stage 3, K-FAC's state through ``kfac.load_state_dict``."""
    saved = {}
    for stage in (0, 2):
        saved[stage] = _engine(stage)
        saved[stage].save_checkpoint(str(tmp_path / f"zero{stage}"), tag="ckpt")
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "zero2"), tag="ckpt")
    model = problem.make_model()
    model.load_state_dict(weights)
    zero3 = _engine(3, model)  # one step past the stage-2 checkpoint
    zero3.save_checkpoint(str(tmp_path / "zero3"), tag="ckpt")

    message = _refused(zero3, tmp_path / "zero2", saved=2)
    assert "get_fp32_state_dict_from_zero_checkpoint(load_dir, tag)" in message
    assert "load_optimizer_states=False" not in message
    _refused(saved[2], tmp_path / "zero3", saved=3)
    message = _refused(saved[2], tmp_path / "zero0", saved=0)
    assert re.search(r"with torch\.load\('.*zero0/ckpt/mp_rank_00_model_states\.pt'\)\['module'\] \(", message)
    message = _refused(saved[0], tmp_path / "zero2", saved=2)
    assert message.endswith("the optimizer starting fresh; or pass load_optimizer_states=False (weights only)")
    saved[0].load_checkpoint(str(tmp_path / "zero2"), tag="ckpt", load_optimizer_states=False)
    for a, b in zip(_weights(saved[0]), weights.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    zero3.kfac.load_state_dict(torch.load(tmp_path / "zero2" / "ckpt" / STATE_FILE, weights_only=True))
    assert zero3.kfac.steps == saved[2].kfac.steps == 1
    for engine in (*saved.values(), zero3):
        engine.destroy()
