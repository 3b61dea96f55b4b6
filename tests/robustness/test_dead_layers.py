"""Dead and nearly dead layers under ``relative_damping``, and grafting of tiny or huge gradients (issue 22, item 1).

A block whose mean curvature ``mean(eig A) * mean(eig G)`` is below ``finfo.tiny / finfo.eps`` when it is decomposed
passes its gradient through unchanged until a decomposition finds curvature, warned once per layer and counted in
``counters["uncurved_decompositions"]`` (before: the damping was floored at ``finfo.tiny`` and the layer's
``P(g)`` reached 1e33 once it came alive). Single process, float32, milliseconds per case.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ds_kfac import KFACPreconditioner

METHODS = {
    "eigen": {},
    "eigen-outer": {"eigenvalue_outer_product": True},
    "inverse": {"compute_method": "inverse"},
}
FLOOR = torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps  # 9.86e-32, the documented floor
INPUT_SCALES = {"dead": 0.0, "nearly dead": 1e-17}  # layer 0's input at step 0: A = 0, or A ~ 1e-34 (a normal float32)


def _steps(input_scale: float, **keys) -> tuple[KFACPreconditioner, list[tuple[torch.Tensor, torch.Tensor]], list]:
    """Three steps of a two-layer model whose first layer (no bias) sees ``input_scale`` times its input at step 0
    and the whole input after; decompositions at steps 0 and 2. Returns the preconditioner, layer 0's weight gradient
    before and after ``kfac.step()`` at each step, and the RuntimeWarnings raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 2))
    kfac = KFACPreconditioner(model, damping=0.01, relative_damping=True, kl_clip=None, inv_update_steps=2, **keys)
    data = torch.Generator().manual_seed(1)
    grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            model.zero_grad()
            ((model(x * (input_scale if step == 0 else 1.0)) - y) ** 2).mean().backward()
            raw = model[0].weight.grad.clone()
            kfac.step()
            grads.append((raw, model[0].weight.grad.clone()))
    return kfac, grads, [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("graft", ["none", "gradient"])
@pytest.mark.parametrize("scale", list(INPUT_SCALES))
@pytest.mark.parametrize("method", list(METHODS))
def test_a_layer_dead_at_its_decomposition_passes_its_gradient_through_until_it_has_curvature(
    method: str, scale: str, graft: str
) -> None:
    """issue 22, item 1: layer 0's input is 0 (or 1e-17) at step 0, whose factors are decomposed; at step 1 it is
    alive with that decomposition: its gradient is passed through bitwise (before: multiplied by up to 1e37). Step 2
    decomposes factors with curvature: preconditioned again, finite and of the gradient's order. One warning names
    the layer and layer 2, whose input ``tanh(layer 0's output)`` is (nearly) 0 too (issue 36, item 6), and the
    counter counts their two decompositions."""
    kfac, grads, caught = _steps(INPUT_SCALES[scale], grafting=graft, **METHODS[method])
    (raw0, out0), (raw1, out1), (raw2, out2) = grads
    assert torch.equal(out0, raw0) and torch.equal(out1, raw1) and raw1.abs().max() > 1e-3
    assert not torch.allclose(out2, raw2, rtol=1e-2) and out2.isfinite().all()
    assert out2.norm() < 1e3 * raw2.norm()
    assert kfac.counters["uncurved_decompositions"] == 2
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith("K-FAC layers ['0', '2'] have no usable curvature"), messages
    assert f"below {FLOOR:.3g}" in messages[0] and f"{FLOOR:.3g}" == "9.86e-32"
    assert kfac.metrics()["kfac/count/uncurved_decompositions"] == 2.0


@pytest.mark.parametrize("scale", [1e-24, 1e20])
@pytest.mark.parametrize("relative", [False, True])
def test_grafting_keeps_tiny_and_huge_gradients(scale: float, relative: bool) -> None:
    """issue 22, item 1: with ``grafting: "gradient"``, step 1 (decomposed and factored at step 0 only, so ``P`` is
    the same linear map in both runs) with its loss scaled by 1e-24 (or 1e20) gives ``scale`` times the update of
    the unscaled loss, up to float32's rounding. Before, ``||g||`` underflowed to 0 in float32 and the layers were
    never updated, or overflowed (NaN)."""

    def update(s: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        keys = dict(factor_update_steps=2, inv_update_steps=10, kl_clip=None, relative_damping=relative)
        kfac = KFACPreconditioner(model, damping=0.01, grafting="gradient", **keys)
        data = torch.Generator().manual_seed(1)
        for loss_scale in (1.0, s):
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            model.zero_grad()
            (loss_scale * ((model(x) - y) ** 2).mean()).backward()
            kfac.step()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(update(scale), update(1.0)):
        assert got.abs().max() > 0
        torch.testing.assert_close(got / scale, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def _largest_parameter(dead: bool, inv_update_steps: int, **keys) -> float:
    """SGD (lr 0.1) on K-FAC's gradients for 4 steps of the model above, layer 0's input 0 at step 0 when ``dead``,
    relative damping 0.01, no KL clip, ``factor_decay`` 0.95: the largest parameter magnitude at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFACPreconditioner(
        model,
        optimizer=opt,
        damping=0.01,
        relative_damping=True,
        kl_clip=None,
        inv_update_steps=inv_update_steps,
        **keys,
    )
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the dead layer's warning (tested above)
        for step in range(4):
            x, y = torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data)
            opt.zero_grad()
            ((model(x * (0.0 if dead and step == 0 else 1.0)) - y) ** 2).mean().backward()
            kfac.step()
            opt.step()
    return max(p.abs().max().item() for p in model.parameters())


@pytest.mark.parametrize("inv_update_steps", [1, 2])
@pytest.mark.parametrize("method", list(METHODS))
def test_a_dead_step_does_not_shrink_the_factors_that_follow(method: str, inv_update_steps: int) -> None:
    """issue 30, item 1: a zero ``A`` (an all-zero input batch into a bias-free layer) averaged into the running
    factor shrank the next ones by ``1 - factor_decay`` and scaled ``P(g)`` up 20x once the layer came alive (the
    largest parameter 2.1-4.6x the run's without the dead batch after 4 steps here). Now the
    next step's factor replaces a running factor without curvature: the dead run stays within 2x of the live one."""
    dead = _largest_parameter(True, inv_update_steps, **METHODS[method])
    alive = _largest_parameter(False, inv_update_steps, **METHODS[method])
    assert dead < 2 * alive, (dead, alive)


def test_a_factor_without_curvature_restarts_from_the_next_step() -> None:
    """The running factor after a zero step factor is the next step's factor itself, not ``(1 - decay)`` of it; a
    factor with curvature is averaged as before."""
    from ds_kfac.curvature.factors import KroneckerFactor

    factor = KroneckerFactor(2)
    factor.value = factor.blend(torch.zeros(2, 2), 0.95)
    step = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    factor.value = factor.blend(step, 0.95)
    assert torch.equal(factor.value, step)
    factor.value = factor.blend(torch.eye(2), 0.95)
    torch.testing.assert_close(factor.value, 0.95 * step + 0.05 * torch.eye(2))


PROBE_METHODS = {**METHODS, "eigen-corrected": {"eigenvalue_correction": True}}


def _probe(skip_layers: list[str], **keys) -> tuple[list[torch.Tensor], int]:
    """Issue 36's probe: SGD (lr 0.1), relative damping 0.1, factors every step, decompositions every 10, no KL clip,
    4 steps of a bias-free ``Linear(6, 8)`` (then Tanh, ``Linear(8, 8)``, Tanh, ``Linear(8, 2)``) whose input is all
    zeros at step 0: the parameters at the end, and the decompositions without usable curvature."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = dict(damping=0.1, relative_damping=True, kl_clip=None, factor_update_steps=1, inv_update_steps=10, **keys)
    kfac = KFACPreconditioner(model, optimizer=opt, skip_layers=skip_layers, **keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uncurved layers' warning (tested above), the skipped layers'
        for step in range(4):
            x, y = torch.randn(16, 6), torch.randn(16, 2)
            opt.zero_grad()
            ((model(x * (0.0 if step == 0 else 1.0)) - y) ** 2).mean().backward()
            kfac.step()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], kfac.counters["uncurved_decompositions"]


@pytest.mark.parametrize("method", list(PROBE_METHODS))
def test_a_layer_dead_at_the_first_decomposition_and_the_layer_after_it_pass_through(method: str) -> None:
    """issue 36, item 6: layer 0's ``A`` is exactly 0 at the step-0 decomposition, and layer 2's has only its bias
    entry (its input is ``tanh(0)``); both decompositions are used until step 10. Both layers' gradients now pass
    through (layer 2's ``A`` has no curvature over its input rows, so it is decomposed as 0), which is the run with
    both layers in ``skip_layers``; layer 4 is preconditioned in both. Before, layer 2's weights were divided by its
    damping alone once alive: the largest parameter reached 4.6e3 (eigen, with or without the outer product), 3.6
    (inverse) and 2.6 (eigenvalue correction), against 0.40-0.45 here."""
    got, uncurved = _probe([], **PROBE_METHODS[method])
    want, _ = _probe(["0", "2"], **PROBE_METHODS[method])
    assert max(p.abs().max().item() for p in got) < 2.0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert uncurved == 2
