"""The public K-FAC contract (docs/conventions.md) against independent float64 references."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from torch import nn

from ds_kfac import KFACPreconditioner

pytestmark = pytest.mark.timeout(120)

# name -> (layer factory, input factory, is_conv)
LAYERS = {
    "linear_bias": (lambda: nn.Linear(5, 3), lambda: torch.randn(8, 5), False),
    "linear_3d_input": (lambda: nn.Linear(4, 3), lambda: torch.randn(3, 5, 4), False),
    "linear_no_bias": (lambda: nn.Linear(4, 3, bias=False), lambda: torch.randn(6, 4), False),
    "conv_stride_padding": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), lambda: torch.randn(4, 2, 7, 7), True),
    "conv_dilation": (
        lambda: nn.Conv2d(2, 2, 3, padding=2, dilation=2, bias=False),
        lambda: torch.randn(2, 2, 6, 6),
        True,
    ),
}

# float64: the library should agree with the explicit Kronecker solve to rounding;
# float32: eigh/inv in single precision on well-damped factors.
TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-12), torch.float32: dict(rtol=2e-3, atol=1e-5)}


def _problem(case: str, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, bool]:
    """One of LAYERS, seeded: the layer, an input, a regression target and whether it is a conv."""
    torch.manual_seed(seed)
    make_layer, make_input, is_conv = LAYERS[case]
    layer, x = make_layer(), make_input()
    return layer, x, torch.randn_like(layer(x)), is_conv


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean() + out.sin().mean()


def reference_step(layer: nn.Module, x: torch.Tensor, target: torch.Tensor, is_conv: bool, method: str, damping: float):
    """Independent float64 P(g), factors A, G and raw gradient matrix for one batch."""
    layer = copy.deepcopy(layer).double()
    out = layer(x.double())
    out.retain_grad()
    loss_fn(out, target.double()).backward()
    batch = x.shape[0]
    rows = ref.conv_rows(layer, x) if is_conv else ref.linear_rows(x, layer.bias is not None)
    a = ref.second_moment(rows)
    g = ref.second_moment(ref.output_grad_rows(out.grad, is_conv), scale=batch)
    grad = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    if layer.bias is not None:
        grad = torch.cat([grad, layer.bias.grad.reshape(-1, 1)], 1)
    precond = ref.precondition_eigen if method == "eigen" else ref.precondition_inverse
    return precond(a, g, grad, damping), a, g, grad


def kfac_sgd_step(layer: nn.Module, x: torch.Tensor, target: torch.Tensor, dtype: torch.dtype, **keys):
    """Parameter change of one SGD(lr=1) step on K-FAC-preconditioned gradients, as a matrix."""
    layer = copy.deepcopy(layer).to(dtype)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    name = "float64" if dtype == torch.float64 else "float32"
    kfac = KFACPreconditioner(layer, optimizer=opt, factor_decay=0.0, factor_dtype=name, inv_dtype=name, **keys)
    loss_fn(layer(x.to(dtype)), target.to(dtype)).backward()
    kfac.step()
    opt.step()
    delta = [(p.detach() - b).double() for p, b in zip(layer.parameters(), before)]
    matrix = delta[0].reshape(delta[0].shape[0], -1)
    if len(delta) > 1:
        matrix = torch.cat([matrix, delta[1].reshape(-1, 1)], 1)
    return matrix, kfac


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_one_step_is_minus_preconditioned_gradient(case: str, method: str, dtype: torch.dtype) -> None:
    layer, x, target, is_conv = _problem(case, seed=0)
    damping = 0.01
    expected, *_ = reference_step(layer, x, target, is_conv, method, damping)
    delta, kfac = kfac_sgd_step(layer, x, target, dtype, damping=damping, compute_method=method, kl_clip=None)
    assert kfac.layer_names == [""]
    torch.testing.assert_close(delta, -expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_eigenvalue_outer_product_step_matches_reference_and_eigen(case: str, dtype: torch.dtype) -> None:
    """Precomputing D = 1 / (v_G v_A^T + damping) changes the arithmetic, not P(g)."""
    layer, x, target, is_conv = _problem(case, seed=0)
    damping = 0.01
    expected, *_ = reference_step(layer, x, target, is_conv, "eigen", damping)
    keys = dict(damping=damping, kl_clip=None)
    outer, kfac = kfac_sgd_step(layer, x, target, dtype, eigenvalue_outer_product=True, **keys)
    eigen, _ = kfac_sgd_step(layer, x, target, dtype, **keys)
    assert kfac.blocks[0].method.name == "eigen-outer"
    torch.testing.assert_close(outer, -expected, **TOLERANCES[dtype])
    torch.testing.assert_close(outer, eigen, **TOLERANCES[dtype])


@pytest.mark.parametrize("case", ["linear_3d_input", "conv_stride_padding"])
def test_factors_match_reference(case: str) -> None:
    layer, x, target, is_conv = _problem(case, seed=1)
    _, a, g, _ = reference_step(layer, x, target, is_conv, "eigen", 0.01)
    _, kfac = kfac_sgd_step(layer, x, target, torch.float64, kl_clip=None)
    block = kfac.blocks[0]
    torch.testing.assert_close(block.a.value, a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(block.g.value, g, rtol=1e-12, atol=1e-14)


def test_kl_clip_scales_by_nu() -> None:
    layer, x, target, is_conv = _problem("linear_bias", seed=2)
    damping, lr, kl = 0.01, 0.5, 1e-4
    precond, _, _, grad = reference_step(layer, x, target, is_conv, "eigen", damping)
    nu = min(1.0, (kl / (lr**2 * abs((precond * grad).sum().item()))) ** 0.5)
    assert nu < 1.0, "test must exercise the clip"
    layer64 = copy.deepcopy(layer).double()
    before = torch.cat([layer64.weight.detach().clone(), layer64.bias.detach().clone()[:, None]], 1)
    opt = torch.optim.SGD(layer64.parameters(), lr=lr)
    kfac = KFACPreconditioner(
        layer64,
        optimizer=opt,
        factor_decay=0.0,
        damping=damping,
        kl_clip=kl,
        factor_dtype="float64",
        inv_dtype="float64",
    )
    loss_fn(layer64(x.double()), target.double()).backward()
    kfac.step()
    opt.step()
    after = torch.cat([layer64.weight.detach(), layer64.bias.detach()[:, None]], 1)
    assert kfac.last_nu.item() == pytest.approx(nu, rel=1e-10)
    torch.testing.assert_close(after - before, -lr * nu * precond, rtol=1e-9, atol=1e-12)


RELATIVE_REFERENCES = {
    "eigen": (ref.precondition_relative, {}),
    "eigen-outer": (ref.precondition_relative, {"eigenvalue_outer_product": True}),
    "inverse": (ref.precondition_inverse_relative, {"compute_method": "inverse"}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("method", list(RELATIVE_REFERENCES))
@pytest.mark.parametrize("case", ["linear_bias", "linear_3d_input", "conv_stride_padding"])
def test_relative_damping_step_matches_reference(case: str, method: str, dtype: torch.dtype) -> None:
    """relative_damping: the block is damped by damping * mean eig(A) * mean eig(G) (per factor for inverse)."""
    layer, x, target, is_conv = _problem(case, seed=6)
    damping = 0.05
    _, a, g, grad = reference_step(layer, x, target, is_conv, "eigen", damping)
    precondition, keys = RELATIVE_REFERENCES[method]
    expected = precondition(a, g, grad, damping)
    # The test must be able to fail: the relative damping differs from the absolute one here.
    assert not torch.allclose(expected, ref.precondition_eigen(a, g, grad, damping), rtol=1e-3)
    delta, _ = kfac_sgd_step(layer, x, target, dtype, damping=damping, relative_damping=True, kl_clip=None, **keys)
    torch.testing.assert_close(delta, -expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_grafting_keeps_the_direction_and_the_gradient_norm(method: str) -> None:
    """grafting='gradient': each layer's step is P(g) rescaled to ||g||."""
    layer, x, target, is_conv = _problem("conv_stride_padding", seed=7)
    precond, _, _, grad = reference_step(layer, x, target, is_conv, method, 0.01)
    expected = precond * (grad.norm() / precond.norm())
    assert not torch.allclose(expected, precond, rtol=1e-3)
    keys = dict(damping=0.01, compute_method=method, grafting="gradient", kl_clip=None)
    delta, _ = kfac_sgd_step(layer, x, target, torch.float64, **keys)
    torch.testing.assert_close(delta, -expected, **TOLERANCES[torch.float64])


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_relative_damping_with_grafting_ignores_the_loss_scale(method: str) -> None:
    """Scaling the loss by s scales G by s^2 and g by s. With relative damping and grafting
    the update is s times the unscaled one (as plain SGD's), whatever the layer's curvature scale;
    with absolute damping it is not."""
    layer, x, target, _ = _problem("linear_bias", seed=8)

    def step(scale: float, **keys) -> torch.Tensor:
        model = copy.deepcopy(layer).double()
        before = model.weight.detach().clone()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        kfac = KFACPreconditioner(model, optimizer=opt, factor_dtype="float64", inv_dtype="float64", **keys)
        (scale * loss_fn(model(x.double()), target.double())).backward()
        kfac.step()
        opt.step()
        return model.weight.detach() - before

    keys = dict(damping=0.01, compute_method=method, kl_clip=None, grafting="gradient")
    torch.testing.assert_close(
        step(1e-3, relative_damping=True, **keys), 1e-3 * step(1.0, relative_damping=True, **keys)
    )
    absolute = step(1e-3, **keys) / 1e-3 - step(1.0, **keys)
    assert absolute.norm() > 1e-3 * step(1.0, **keys).norm()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _factors(model: nn.Module, batches: list[torch.Tensor], targets: list[torch.Tensor], loss_scale: float = 1.0):
    k = len(batches)
    kfac = KFACPreconditioner(
        model,
        kl_clip=None,
        factor_dtype="float64",
        accumulation_steps=k,
        loss_scale=lambda: loss_scale,
    )
    for x, t in zip(batches, targets):
        (loss_fn(model(x), t) / k * loss_scale).backward()
    kfac.update_curvature()
    return [(b.a.value, b.g.value) for b in kfac.blocks]


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_micro_batches_equal_one_big_batch(loss_scale: float) -> None:
    """k micro-batches of size b (accumulation k, any loss scale) give the factors of one batch of k*b."""
    torch.manual_seed(3)
    model = _mlp()
    x, t = torch.randn(12, 6, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    whole = _factors(copy.deepcopy(model), [x], [t])
    split = _factors(copy.deepcopy(model), list(x.chunk(4)), list(t.chunk(4)), loss_scale=loss_scale)
    for (a1, g1), (a2, g2) in zip(whole, split):
        torch.testing.assert_close(a2, a1, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-15)


def test_update_schedule_and_running_average() -> None:
    """Factors update on s % f == 0 (running average, first sets), decompositions on s % m == 0."""
    torch.manual_seed(4)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kfac = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=2, inv_update_steps=3, factor_decay=0.5, factor_dtype="float64"
    )
    block = kfac.blocks[0]
    factor_steps, decomposition_steps = [], []
    expected_a = None
    for s in range(7):
        x = torch.randn(4, 6, dtype=torch.float64)
        step_a = ref.second_moment(ref.linear_rows(x, True))
        old_a, old_state = block.a.value, block.decomposition
        loss_fn(model(x), torch.zeros(4, 3, dtype=torch.float64)).backward()
        kfac.step()
        opt.zero_grad()
        if block.a.value is not old_a:
            factor_steps.append(s)
            expected_a = step_a if expected_a is None else 0.5 * expected_a + 0.5 * step_a
            torch.testing.assert_close(block.a.value, expected_a, rtol=1e-12, atol=1e-15)
        if block.decomposition is not old_state:
            decomposition_steps.append(s)
    assert factor_steps == [0, 2, 4, 6]
    assert decomposition_steps == [0, 3, 6]


def test_schedules_are_callables_of_the_step() -> None:
    torch.manual_seed(5)
    model = _mlp()
    seen = []
    kfac = KFACPreconditioner(model, lr=0.1, damping=lambda s: seen.append(s) or 0.01 * (s + 1))
    for _ in range(3):
        loss_fn(model(torch.randn(4, 6, dtype=torch.float64)), torch.zeros(4, 3, dtype=torch.float64)).backward()
        kfac.step()
    assert sorted(set(seen)) == [0, 1, 2]


def _subset_factors(batches: list[torch.Tensor], targets: list[torch.Tensor], **keys):
    """Factors of one accumulated step of ``len(batches)`` micro-batches through a double ``nn.Linear(6, 3)``,
    the preconditioner told each micro-batch's index."""
    torch.manual_seed(5)
    layer = nn.Linear(6, 3).double()
    index = [0]
    kfac = KFACPreconditioner(
        layer,
        kl_clip=None,
        factor_dtype="float64",
        accumulation_steps=len(batches),
        micro_batch=lambda: index[0],
        **keys,
    )
    for i, (x, t) in enumerate(zip(batches, targets)):
        index[0] = i
        (loss_fn(layer(x), t) / len(batches)).backward()
    kfac.update_curvature()
    return layer, kfac.blocks[0]


def test_factor_micro_batches_take_the_last_k_against_reference() -> None:
    """``factor_micro_batches: 2`` of 4 micro-batches: A and G are the float64 factors of the last two alone, on
    the scale of the per-example gradients of the unscaled loss (the explicit reference of one batch of them)."""
    torch.manual_seed(6)
    x, t = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    layer, block = _subset_factors(list(x.chunk(4)), list(t.chunk(4)), factor_micro_batches=2)
    last = copy.deepcopy(layer)
    out = last(x[8:])
    out.retain_grad()
    loss_fn(out, t[8:]).backward()
    a = ref.second_moment(ref.linear_rows(x[8:], True))
    g = ref.second_moment(ref.output_grad_rows(out.grad, conv=False), scale=8)
    torch.testing.assert_close(block.a.value, a, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(block.g.value, g, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("k", [4, 9])
def test_factor_micro_batches_of_the_whole_step_is_todays_behaviour(k: int) -> None:
    """``factor_micro_batches`` >= the accumulation gathers every micro-batch: bitwise today's factors."""
    torch.manual_seed(7)
    x, t = torch.randn(12, 6, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    _, every = _subset_factors(list(x.chunk(4)), list(t.chunk(4)))
    _, subset = _subset_factors(list(x.chunk(4)), list(t.chunk(4)), factor_micro_batches=k)
    assert torch.equal(subset.a.value, every.a.value) and torch.equal(subset.g.value, every.g.value)


def test_factor_micro_batches_without_the_index_is_refused() -> None:
    from ds_kfac import KFACConfigError

    with pytest.raises(KFACConfigError, match=r"factor_micro_batches=2 with accumulation_steps=4: pass micro_batch="):
        KFACPreconditioner(nn.Linear(3, 2), kl_clip=None, accumulation_steps=4, factor_micro_batches=2)
