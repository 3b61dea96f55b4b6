"""Unit-wise BatchNorm (``"batchnorm": "unit-wise"``, docs/conventions.md) against an independent float64 reference:
per-example (gamma, beta) gradients from the normalized input and the output gradients, explicit 2x2 inverses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_kfac import KFACPreconditioner

pytestmark = pytest.mark.timeout(120)

FLOAT64 = dict(factor_dtype="float64", inv_dtype="float64", kl_clip=None, factor_decay=0.0, batchnorm="unit-wise")
DAMPING = 0.01

# name -> (layer, input)
CASES = {
    "bn2d": (lambda: nn.BatchNorm2d(3), lambda: torch.randn(6, 3, 4, 5)),
    "bn1d_sequence": (lambda: nn.BatchNorm1d(4), lambda: torch.randn(5, 4, 7)),
    "bn1d_features": (lambda: nn.BatchNorm1d(4), lambda: torch.randn(8, 4)),
    "bn2d_frozen_beta": (lambda: _frozen_beta(nn.BatchNorm2d(3)), lambda: torch.randn(6, 3, 4, 5)),
}


def _frozen_beta(layer: nn.Module) -> nn.Module:
    layer.bias.requires_grad_(False)
    return layer


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean() + out.sin().mean()


def _reference(layer: nn.Module, x: torch.Tensor, target: torch.Tensor, damping: float, relative: bool) -> torch.Tensor:
    """``-(F_c + d I)^-1 g_c`` per channel, ``F_c = (1/B) sum_i u_i u_i^T``, ``u_i`` example ``i``'s ``(gamma, beta)``
    gradient: ``B`` times the output gradient summed over its positions, times ``xhat`` for ``gamma``."""
    layer = copy.deepcopy(layer).double()
    out = layer(x.double())
    out.retain_grad()
    loss_fn(out, target.double()).backward()
    batch, channels = x.shape[0], x.shape[1]
    xd = x.double().reshape(batch, channels, -1)
    mean = xd.mean(dim=(0, 2), keepdim=True)
    var = ((xd - mean) ** 2).mean(dim=(0, 2), keepdim=True)
    xhat = (xd - mean) / torch.sqrt(var + layer.eps)
    g = batch * out.grad.reshape(batch, channels, -1)
    trains_beta = layer.bias.requires_grad
    grads = [layer.weight.grad] + ([layer.bias.grad] if trains_beta else [])
    grad = torch.stack(grads, dim=1)  # C x k
    steps = []
    fishers = []
    for c in range(channels):
        u = torch.stack([(g[:, c] * xhat[:, c]).sum(-1)] + ([g[:, c].sum(-1)] if trains_beta else []), dim=1)
        torch.testing.assert_close(u.sum(0) / batch, grad[c])  # the per-example gradients sum to the gradient
        fishers.append(u.t() @ u / batch)
    block = damping * torch.stack([f.trace() / f.shape[0] for f in fishers]).mean() if relative else damping
    for c, f in enumerate(fishers):
        steps.append(torch.linalg.inv(f + block * torch.eye(f.shape[0], dtype=f.dtype)) @ grad[c])
    return -torch.stack(steps)


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_reference(case: str, relative: bool) -> None:
    torch.manual_seed(0)
    make_layer, make_x = CASES[case]
    layer, x = make_layer(), make_x()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    target = torch.randn_like(x)
    expected = _reference(layer, x, target, DAMPING, relative)

    model = copy.deepcopy(layer).double()
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    kfac = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, relative_damping=relative, **FLOAT64)
    loss_fn(model(x.double()), target.double()).backward()
    kfac.step()
    opt.step()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    delta = torch.stack([a - b for a, b in zip(after, before)], dim=1)
    assert kfac.layer_names == [""] and kfac.blocks[0].method.name == "unit-wise"
    torch.testing.assert_close(delta, expected, rtol=1e-9, atol=1e-12)


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def _train(model: nn.Module, kfac: KFACPreconditioner, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(6, 2, 4, 4, generator=g), torch.randn(6, 3, generator=g)
        opt.zero_grad()
        loss_fn(model(x), target).backward()
        kfac.step()
        opt.step()


def test_blocks_beside_kronecker_blocks_resume_bitwise_and_the_key_is_checked() -> None:
    """A Conv2d, a BatchNorm2d and a Linear: the BatchNorm gets a unit-wise block, the others Kronecker blocks (with
    adaptive refresh, each on its own schedule); resumed from a checkpoint after step 3, the run equals the straight
    one bit for bit; without the key the BatchNorm is not registered and the state is refused."""
    keys = dict(batchnorm="unit-wise", inv_update_steps="adaptive", relative_damping=True)

    def build(model: nn.Module, **extra) -> tuple:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return model, KFACPreconditioner(model, optimizer=opt, **{**keys, **extra}), opt

    straight = build(_model())
    assert [type(b).__name__ for b in straight[1].blocks] == ["KFACBlock", "UnitWiseBlock", "KFACBlock"]
    _train(*straight, range(6))
    first = build(_model())
    _train(*first, range(3))
    state = first[1].state_dict()
    assert state["layers"]["1"]["F"].shape == (4, 2, 2) and set(state["refresh"]) >= {"1.F", "0.A", "4.G"}
    resumed = build(copy.deepcopy(first[0]))
    resumed[1].load_state_dict(state)
    _train(*resumed, range(3, 6))
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)
    plain = build(_model(), batchnorm="none")
    assert plain[1].layer_names == ["0", "4"]
    with pytest.raises(ValueError, match="saved with batchnorm='unit-wise', this run uses 'none'"):
        plain[1].load_state_dict(state)
