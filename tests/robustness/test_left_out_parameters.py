"""Parameters of K-FAC's layers that the optimizer does not hold (issue 62, item 3): one rank, in this process.

At ZeRO stage 0 they stay where they are and the other layers train as if the layer were skipped. ZeRO 1-3 reduce
and partition only the optimizer's parameters' gradients, so K-FAC would find none of theirs: ``initialize`` refuses,
naming them (before: a ``RuntimeError`` at the first step blaming a changed DeepSpeed internal at stages 1 and 2, a
``KeyError`` from DeepSpeed at stage 3, and with only a weight left out, a silently different update of its bias).
"""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
from torch import nn
from workers import problem

import ds_kfac
from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner
from ds_kfac.optimizers import Adam, Lamb, split_groups

pytestmark = pytest.mark.timeout(120)

KFAC = {"damping": 0.01, "kl_clip": None, "factor_update_steps": 1, "inv_update_steps": 2}
"""No KL clip and (below) no gradient clipping: both sum over every layer, so the layer left out would change the
others' steps."""
MOMENTS = {**KFAC, "eigenbasis_moments": True}
Build = Callable[[list, list], torch.optim.Optimizer]
"""An optimizer over ``(kept parameters, kept parameters of K-FAC's layers)``."""
CLIENTS: dict[str, tuple[dict, Build]] = {
    "torch_sgd": (KFAC, lambda kept, _: torch.optim.SGD(kept, lr=0.1, momentum=0.9)),
    "torch_adamw": (KFAC, lambda kept, _: torch.optim.AdamW(kept, lr=0.01)),
    "adam_with_moments": (MOMENTS, lambda kept, layers: Adam(split_groups(kept, layers), lr=0.01, eps=1e-6)),
    "lamb_with_moments": (MOMENTS, lambda kept, layers: Lamb(split_groups(kept, layers), lr=0.01, eps=1e-6)),
}
"""The client optimizers: torch's, and ds_kfac's with ``eigenbasis_moments``' flagged groups."""
LEFT_OUT = {"layer": ("2.weight", "2.bias"), "weight": ("2.weight",)}


def _optimizer(client: str, model: nn.Module, left_out: tuple[str, ...]) -> torch.optim.Optimizer:
    keys, build = CLIENTS[client]
    kept = [p for name, p in model.named_parameters() if name not in left_out]
    layers = ds_kfac.preconditioned_parameters(model, KFACConfig.parse(keys))
    return build(kept, [p for p in layers if any(p is q for q in kept)])


def _engine(engines: list, client: str, stage: int, left_out: tuple[str, ...]):
    model = problem.make_model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "kfac": CLIENTS[client][0],
    }
    engine, *_ = ds_kfac.initialize(model=model, optimizer=_optimizer(client, model, left_out), config=config)
    engines.append(engine)
    return engine


@pytest.mark.parametrize("client", list(CLIENTS))
def test_at_stage_0_they_stay_and_the_rest_trains_as_without_the_layer(engines: list, client: str) -> None:
    """Three steps: the parameters left out are bitwise where they started, and the others equal a single process
    (plain PyTorch) in which the layer is in ``skip_layers`` and the optimizer the same (float32, 1e-6)."""
    engine = _engine(engines, client, 0, LEFT_OUT["layer"])
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    model = problem.make_model()
    keys = {**CLIENTS[client][0], "skip_layers": ["^2$"]}
    kfac = KFACPreconditioner(model, optimizer=_optimizer(client, model, LEFT_OUT["layer"]), **keys)
    for step in range(3):
        x, y = problem.global_batch(step, 4)
        engine.backward(problem.loss_fn(engine(x), y))
        engine.step()
        kfac.optimizer.zero_grad()
        problem.loss_fn(model(x), y).backward()
        kfac.step()
        kfac.optimizer.step()
    for (name, got), want in zip(engine.module.named_parameters(), model.parameters()):
        if name in LEFT_OUT["layer"]:
            assert torch.equal(got, start[name]), name
        else:
            assert not torch.equal(got, start[name]), name  # can fail: these train
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_at_stages_1_to_3_initialize_names_them(engines: list, client: str, stage: int) -> None:
    for left_out in LEFT_OUT.values():
        with pytest.raises(KFACConfigError) as caught:
            _engine(engines, client, stage, left_out)
        message = str(caught.value)
        assert (
            f"parameters of K-FAC's layers that are not in the optimizer at ZeRO stage {stage}: {', '.join(left_out)} "
            f"(ZeRO reduces and partitions only the gradients of the optimizer's parameters" in message
        ), message
        assert re.search(r"pass them to the optimizer, freeze them \(requires_grad=False\), or name", message)


@pytest.mark.parametrize("stage", [1, 2])
def test_json_optimizers_over_model_parameters_without_them(engines: list, stage: int) -> None:
    """The JSON optimizer, built by ds_kfac (SGD) or by DeepSpeed (AdamW without the key), over ``model_parameters``
    that leave the layer out: the same refusal."""
    for optimizer in ({"type": "SGD", "params": {"lr": 0.1}}, {"type": "AdamW", "params": {"lr": 0.01}}):
        model = problem.make_model()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": optimizer,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "kfac": KFAC,
        }
        kept = (p for name, p in model.named_parameters() if name not in LEFT_OUT["layer"])  # a generator, as usual
        with pytest.raises(KFACConfigError, match=f"not in the optimizer at ZeRO stage {stage}: 2.weight, 2.bias"):
            ds_kfac.initialize(model=model, model_parameters=kept, config=config)
