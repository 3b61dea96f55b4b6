"""``"eigenbasis_moments": true`` set up from the JSON as without the key (issue 36, items 1 and 4): DeepSpeed's
default clipping, a model without K-FAC layers, AMSGrad.

Engines are built in this process, on one gloo rank, as the deepspeed launcher would set it up.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from workers import problem

import ds_kfac
from ds_kfac.optimizers import build_optimizer, split_groups

pytestmark = pytest.mark.timeout(120)

STEPS = 3
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True}}
"""Without the key DeepSpeed builds this one itself: ``torch_adam`` makes it ``torch.optim.AdamW``, as the demo configs
do; DeepSpeed's default, its CPU ``FusedAdam``, compiles an extension on first use (45 s on 2 cores, once per clone)."""
KEY = {"eigenbasis_moments": True, "factor_update_steps": 1, "inv_update_steps": 2}
BASE = {"train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW}
TARGET_SCALE = 10.0
"""Targets far from the outputs: the global gradient norm is above 1 at every step, so clipping to 1 acts."""


def _train(engines: list[Any], config: dict) -> tuple[Any, list[torch.Tensor]]:
    """An engine of ``config`` on the problem's MLP and its parameters after :data:`STEPS` steps."""
    model = problem.make_model()
    engine, *_ = ds_kfac.initialize(model=model, model_parameters=problem.param_groups(model), config=config)
    engines.append(engine)
    for step in range(STEPS):
        x, y = problem.global_batch(step, 4)
        engine.backward(problem.loss_fn(engine(x), TARGET_SCALE * y))
        engine.step()
    return engine, [p.detach().clone() for p in engine.module.parameters()]


def _reference() -> list[torch.Tensor]:
    """One process, no DeepSpeed: the raw gradients clipped to norm 1, then K-FAC, then ds_kfac's AdamW (what
    :data:`ADAMW` builds) on the K-FAC layers' flagged groups."""
    model = problem.make_model()
    layers = ds_kfac.preconditioned_parameters(model, ds_kfac.KFACConfig.parse(KEY))
    opt = build_optimizer(ADAMW["type"], split_groups(problem.param_groups(model), layers), ADAMW["params"])
    kfac = ds_kfac.KFACPreconditioner(model, optimizer=opt, **KEY)
    for step in range(STEPS):
        x, y = problem.global_batch(step, 4)
        opt.zero_grad()
        problem.loss_fn(model(x), TARGET_SCALE * y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        kfac.step()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _norm(engine: Any) -> float:
    """The global norm of the raw gradient of one batch (the engine's model, no step)."""
    x, y = problem.global_batch(0, 4)
    engine.module.zero_grad()
    problem.loss_fn(engine.module(x), TARGET_SCALE * y).backward()
    return torch.cat([p.grad.flatten() for p in engine.module.parameters()]).norm().item()


def test_default_clipping_is_deepspeeds_with_the_key(engines: list[Any]) -> None:
    """Item 1: with the key and no ``gradient_clipping`` in the JSON the engine reports and applies DeepSpeed's
    default (1.0 in 0.19.8), as without the key: the run equals the one with ``"gradient_clipping": 1.0`` bitwise and
    differs from the unclipped one; both equal one process clipping the raw gradients once (DeepSpeed clips nothing
    more: its stage 0 clip would act on K-FAC's directions, whose norm is about 5)."""
    default, params = _train(engines, {**BASE, "kfac": KEY})
    explicit, clipped = _train(engines, {**BASE, "gradient_clipping": 1.0, "kfac": KEY})
    _, unclipped = _train(engines, {**BASE, "gradient_clipping": 0.0, "kfac": KEY})
    without_key, _ = _train(engines, {**BASE, "kfac": {}})
    assert without_key.gradient_clipping() == 1.0  # DeepSpeed's default, reported
    assert default.gradient_clipping() == explicit.gradient_clipping() == 1.0
    assert default.raw_gradient_clipping == 1.0
    assert _norm(default) > 2.0  # the clip acts
    assert all(torch.equal(a, b) for a, b in zip(params, clipped))
    assert not any(torch.equal(a, b) for a, b in zip(params, unclipped))
    for got, want in zip(params, _reference()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # fp32, the same operations: rounding only


def test_a_model_without_kfac_layers_trains_as_the_base_optimizer(engines: list[Any]) -> None:
    """Item 4: every layer in ``skip_layers`` under the key: no refusal (before, advice about ``split_groups``), one
    warning naming the key, and the run is bitwise the one without the key (DeepSpeed's AdamW and clipping)."""
    skipped = {"skip_layers": ["^0$", "^2$", "^4$"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, params = _train(engines, {**BASE, "kfac": {**KEY, **skipped}})
    (warning,) = [w for w in caught if "kfac.eigenbasis_moments" in str(w.message)]
    assert "no moments to keep in its eigenbasis: it trains as the base optimizer" in str(warning.message)
    base, expected = _train(engines, {**BASE, "kfac": skipped})
    assert type(engine.basic_optimizer) is type(base.basic_optimizer)
    assert engine.kfac.blocks == [] and engine.gradient_clipping() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    assert not any(torch.equal(a, b) for a, b in zip(params, problem.make_model().parameters()))  # it trained


def test_amsgrad_is_refused_naming_the_key(engines: list[Any]) -> None:
    """Item 4: AdamW's ``amsgrad: true`` with the key is refused naming the key and why (before: "amsgrad=true is
    not supported here")."""
    adamw = {"type": "AdamW", "params": {**ADAMW["params"], "amsgrad": True}}
    with pytest.raises(ds_kfac.KFACConfigError) as error:
        ds_kfac.initialize(model=problem.make_model(), config={**BASE, "optimizer": adamw, "kfac": KEY})
    assert str(error.value).startswith(
        "kfac.eigenbasis_moments with optimizer type 'AdamW' and amsgrad=true: AMSGrad keeps the running maximum of v"
    )
