"""Issue 14: what the module hooks count, and steps that had no backward.

Items 1 (forwards without backward), 2 (``step()`` twice), 6 (messages),
14 (activation checkpointing) and 15 (``torch.compile``). References are
clean runs of the same model (bitwise where the arithmetic is the same).
"""

from __future__ import annotations

import json
import sys
import warnings

import launch
import pytest
import torch
from torch import nn
from workers import checkpointing

from ds_kfac import KFACPreconditioner
from ds_kfac.integration.cleanup import release_port_segments


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _train_step(model: nn.Module, kfac: KFACPreconditioner) -> None:
    x, y = _batch()
    ((model(x) - y) ** 2).mean().backward()
    kfac.step()


def test_forwards_without_backward_do_not_enter_a() -> None:
    """Item 1: 100 training-mode forwards with grad enabled and no backward leave ``A`` as a clean run's,
    and are counted and reported once per layer."""
    clean, polluted = _mlp(), _mlp()
    k_clean = KFACPreconditioner(clean, lr=0.1, kl_clip=None)
    k_polluted = KFACPreconditioner(polluted, lr=0.1, kl_clip=None)
    _train_step(clean, k_clean)
    for i in range(100):
        polluted(torch.randn(16, 6) * 10)  # e.g. a metric computed without torch.no_grad()
    with pytest.warns(RuntimeWarning, match=r"forward passes in training mode whose outputs got no backward.*'0': 100"):
        _train_step(polluted, k_polluted)
    for a, b in zip(k_clean.blocks, k_polluted.blocks):
        assert torch.equal(a.a.value, b.a.value) and torch.equal(a.g.value, b.g.value)
    assert k_polluted.counters["forwards_without_backward"] == 200
    for p, q in zip(clean.parameters(), polluted.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_step_twice_without_backward_is_a_noop() -> None:
    """Item 2: a second ``step()`` with no backward in between leaves the gradients and the step count alone."""
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None, damping=0.01)
    _train_step(model, kfac)
    once = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(
        RuntimeWarning, match=r"step 1 skipped: no backward pass.*nor a forward \(step\(\) called twice\?\)"
    ):
        kfac.step()
    assert kfac.steps == 1 and kfac.counters["steps_without_backward"] == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), once))
    _train_step(model, kfac)  # a real step afterwards works as usual
    assert kfac.steps == 2


def _step_warnings(kfac: KFACPreconditioner) -> list[str]:
    """The warnings of one ``kfac.step()``, each as often as it is raised."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kfac.step()
    return [str(w.message) for w in record]


def test_a_step_without_backward_blames_step_twice_only_when_nothing_ran_since_the_last() -> None:
    """Issue 47, item 3: "step() called twice?" only for a step after a step with neither a forward nor a backward
    through the layers in between; a first step before any pass, and a step after a forward whose loss does not use
    the layers, say so instead. Each is skipped and counted as before."""
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None)
    (first,) = _step_warnings(kfac)
    assert "K-FAC step 0 skipped: no backward pass through its layers yet (step() before the first forward" in first
    _train_step(model, kfac)
    model(_batch()[0])  # a forward with gradients enabled, then a loss of something else
    torch.zeros(1, requires_grad=True).sum().backward()
    (unused,) = _step_warnings(kfac)
    assert (
        "K-FAC step 1 skipped: no backward pass through its layers since the last step, though they ran forward"
        in unused
    )
    assert "called twice" not in first + unused
    assert kfac.steps == 1 and kfac.counters["steps_without_backward"] == 2


def test_a_step_after_backward_through_an_unsupported_path_still_runs() -> None:
    """Item 2's check does not refuse real steps in which factors are not gathered (``factor_update_steps``)."""
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None, factor_update_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            model.zero_grad()
            _train_step(model, kfac)
    assert kfac.steps == 4


def test_missing_layer_message_says_the_kl_clip_scales_it() -> None:
    """Item 6: a layer without factors is not preconditioned but is scaled by the KL clip's ``nu``: the
    warning says so, and the gradient is exactly ``nu * g``."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.functional = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.used(x), self.functional.weight, self.functional.bias)

    torch.manual_seed(0)
    model = Model()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=1e-6, damping=0.01)
    x, y = _batch()
    ((model(x) - y) ** 2).mean().backward()
    grad = model.functional.weight.grad.clone()
    with pytest.warns(RuntimeWarning, match=r"'functional'.*only scaled by the KL clip's factor nu"):
        kfac.step()
    assert kfac.last_nu < 1
    torch.testing.assert_close(model.functional.weight.grad, grad * kfac.last_nu, rtol=1e-6, atol=0)


def test_float16_factor_overflow_is_named() -> None:
    """Item 6: a float16 factor that overflows in storage is reported as such, naming the factor."""
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None, factor_dtype="float16", inv_update_steps=1)
    x, y = _batch()
    ((model(x * 1000) - y) ** 2).mean().backward()  # A entries ~1e6 > 65504
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac.step()
    messages = [str(w.message) for w in caught]
    assert any("['0/A']" in m and "float16, which overflows above 65504" in m for m in messages), messages
    assert not any("decomposition not finite" in m for m in messages), messages  # what the old message said
    assert kfac.counters["nonfinite_factor_updates"] == 1


@pytest.mark.parametrize("kind", ["torch-reentrant", "torch-non-reentrant", "deepspeed"])
def test_activation_checkpointing_counts_once_and_hands_over_at_backward(kind: str) -> None:
    """Item 14: with recomputation, the factors equal the plain model's (each forward counted once), and each
    layer's statistics are handed to the reduction during the last backward, not delayed to the step."""
    if kind == "deepspeed":  # needs DeepSpeed's distributed backend: one rank in a subprocess
        env = launch.one_rank_env()
        out = launch.run([[sys.executable, str(launch.WORKERS / "checkpointing.py"), kind]], timeout=120, env=env)
        result = json.loads(out[0].split("RESULT ", 1)[1].splitlines()[0])
        release_port_segments(env["MASTER_PORT"])
    else:
        result = checkpointing.run(kind)
    plain = checkpointing.run("none")
    assert result["handed"] == result["layers"] == plain["handed"]
    assert result["counts"] == plain["counts"] == [[2, 2]] * 3
    assert result["A"] == plain["A"]


def _compiled_before_attaching() -> tuple[nn.Module, nn.Module, KFACPreconditioner]:
    warm = _mlp()
    torch.compile(warm)(_batch()[0]).sum().backward()  # fills the compile cache for this class's forward
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None)
    return model, torch.compile(model), kfac


def test_compile_cache_without_hooks_is_refused() -> None:
    """Item 15: a compiled graph built without the hooks (another instance, through the compile cache) runs
    without K-FAC; the first step raises with the fix instead of K-FAC silently doing nothing."""
    torch._dynamo.reset()
    model, compiled, kfac = _compiled_before_attaching()
    x, y = _batch()
    ((compiled(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"never run.*torch.compile graph built before K-FAC attached.*reset"):
        kfac.step()


def test_compile_after_attaching_matches_eager_and_fullgraph_is_refused() -> None:
    """Item 15: attach, then compile: the same factors and gradients as eager; ``fullgraph=True`` fails
    with a message saying why and what to do."""
    torch._dynamo.reset()
    eager, compiled_model = _mlp(), _mlp()
    k_eager = KFACPreconditioner(eager, lr=0.1, kl_clip=None, damping=0.01, inv_update_steps=1)
    k_compiled = KFACPreconditioner(compiled_model, lr=0.1, kl_clip=None, damping=0.01, inv_update_steps=1)
    compiled = torch.compile(compiled_model)
    for model, kfac in ((eager, k_eager), (compiled, k_compiled)):
        x, y = _batch()
        ((model(x) - y) ** 2).mean().backward()
        kfac.step()
    for a, b in zip(k_eager.blocks, k_compiled.blocks):
        torch.testing.assert_close(a.a.value, b.a.value)
        torch.testing.assert_close(a.g.value, b.g.value)
    for p, q in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch._dynamo.reset()
    full = _mlp()
    KFACPreconditioner(full, lr=0.1)
    with pytest.raises(Exception, match=r"fullgraph=True\) cannot compile a model with K-FAC attached"):
        torch.compile(full, fullgraph=True)(_batch()[0])
