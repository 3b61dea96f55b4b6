"""Layer registration robustness (issue 14): tied weights, frozen biases, channels_last convs, no layer at all.

The frozen-bias scenarios run in the 2-rank job that test_exit.py also checks (conftest.py).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import reference as ref
import torch
from torch import nn
from workers import problem

import ds_kfac.preconditioner
from ds_kfac import KFACPreconditioner

pytestmark = pytest.mark.timeout(300)

DAMPING = 0.01
F64 = dict(factor_dtype="float64", inv_dtype="float64", factor_decay=0.0, damping=DAMPING, kl_clip=None)
# float64 against the explicit Kronecker solve: rounding only.
F64_TOL = dict(rtol=1e-9, atol=1e-12)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def reference_preconditioned(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, names: list[str]
) -> dict[str, torch.Tensor]:
    """Independent float64 ``P(g)`` (``d_out x (d_in [+1])``) of the named ``nn.Linear`` layers for one batch
    of the mean-squared error, each called once per forward: ``A`` from explicit rows, with the ones column
    only for a bias that trains, ``G`` of the per-example output gradients."""
    model = copy.deepcopy(model).double()
    modules = dict(model.named_modules())
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            output.retain_grad()
            seen[name] = (inputs[0].detach(), output)

        return hook

    for name in names:
        modules[name].register_forward_hook(keep(name))
    mse(model(x.double()), target.double()).backward()
    out = {}
    for name in names:
        layer, (inputs, output) = modules[name], seen[name]
        bias = layer.bias is not None and layer.bias.requires_grad
        a = ref.second_moment(ref.linear_rows(inputs, bias))
        g = ref.second_moment(ref.output_grad_rows(output.grad, conv=False), scale=x.shape[0])
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1) if bias else layer.weight.grad
        out[name] = ref.precondition_eigen(a, g, grad, DAMPING)
    return out


def kfac_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, **keys) -> KFACPreconditioner:
    """One float64 K-FAC step on ``model``'s gradients (in place), without the base optimizer."""
    kfac = KFACPreconditioner(model, lr=1.0, **{**F64, **keys})
    mse(model(x), target).backward()
    kfac.step()
    return kfac


def weight_and_bias(layer: nn.Linear) -> torch.Tensor:
    """The layer's gradient matrix (weight, then the bias column if the bias has a gradient)."""
    grad = layer.weight.grad
    return grad if layer.bias is None or layer.bias.grad is None else torch.cat([grad, layer.bias.grad[:, None]], 1)


# ------------------------------------------------------------------ item 3: tied weights
class Tied(nn.Module):
    """``left`` and ``right`` hold one weight Parameter: its gradient sums both uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.left, self.right, self.last = (
            nn.Linear(4, 5),
            nn.Linear(5, 5),
            nn.Linear(5, 5),
            nn.Linear(5, 3),
        )
        self.right.weight = self.left.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.last(torch.tanh(self.left(h)) + torch.tanh(self.right(h)))


def test_layers_sharing_a_weight_are_skipped_and_the_others_preconditioned() -> None:
    """issue 14, item 3: both Linears holding one Parameter are skipped, named in skipped_layers and in one
    UserWarning; the step leaves their gradients as they were, and preconditions the other layers exactly."""
    torch.manual_seed(1)
    model = Tied().double()
    x, target = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    expected = reference_preconditioned(model, x, target, ["first", "last"])
    with pytest.warns(UserWarning) as record:
        kfac = KFACPreconditioner(model, lr=1.0, **F64)
    (warning,) = [str(w.message) for w in record]
    assert "'left'" in warning and "'right'" in warning and "tied" in warning
    assert kfac.layer_names == ["first", "last"]
    reasons = {s.name: s.reason for s in kfac.skipped_layers}
    assert "'left.weight' is shared with module 'right'" in reasons["left"]
    assert "'right.weight' is shared with module 'left'" in reasons["right"]
    mse(model(x), target).backward()
    raw = {name: weight_and_bias(getattr(model, name)).clone() for name in ("left", "right")}
    kfac.step()
    for name in ("left", "right"):
        assert torch.equal(weight_and_bias(getattr(model, name)), raw[name])
    for name in ("first", "last"):
        torch.testing.assert_close(weight_and_bias(getattr(model, name)), expected[name], **F64_TOL)


def test_linear_tied_to_an_embedding_is_skipped_naming_the_embedding() -> None:
    """issue 14, item 3: a decoder Linear tied to an nn.Embedding (as BertForMaskedLM's) is skipped."""
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "hidden": nn.Linear(4, 4), "decoder": nn.Linear(4, 10)})
    model["decoder"].weight = model["embed"].weight
    with pytest.warns(UserWarning, match=r"'decoder' \(tied: parameter 'decoder.weight' is shared with module 'embed'"):
        kfac = KFACPreconditioner(model, lr=1.0)
    assert kfac.layer_names == ["hidden"]
    assert [s.name for s in kfac.skipped_layers] == ["decoder"]


# ------------------------------------------------------------------ item 4: frozen bias
def test_frozen_bias_preconditions_the_weight_without_the_bias_column() -> None:
    """issue 14, item 4: a frozen bias is absent to K-FAC (no column in A, none in the gradient matrix), so the
    weight is preconditioned standalone; a frozen weight with a trainable bias is skipped with a reason and its
    bias gradient left alone. No warning: other layers are registered."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model[0].bias.requires_grad_(False)
    model[4].weight.requires_grad_(False)
    x, target = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    expected = reference_preconditioned(model, x, target, ["0", "2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kfac = KFACPreconditioner(model, lr=1.0, **F64)
    assert kfac.layer_names == ["0", "2"]
    assert "frozen weight with a trainable bias" in kfac.skipped_layers[0].reason
    assert kfac.blocks[0].adapter.a_dim == 4 and kfac.blocks[0].adapter.params() == [model[0].weight]
    mse(model(x), target).backward()
    bias_grad = model[4].bias.grad.clone()
    kfac.step()
    assert kfac.blocks[0].a.value.shape == (4, 4) and model[0].bias.grad is None
    torch.testing.assert_close(model[0].weight.grad, expected["0"], **F64_TOL)
    torch.testing.assert_close(weight_and_bias(model[2]), expected["2"], **F64_TOL)
    assert torch.equal(model[4].bias.grad, bias_grad)


FREEZE = ["0.bias", "4.weight"]
FROZEN_SCENARIOS = [
    {
        "ds": {"zero_optimization": {"stage": stage}},
        "kfac": {"kl_clip": None, "damping": DAMPING, "factor_update_steps": 1, "inv_update_steps": 1},
        "steps": 1,
        "freeze": FREEZE,
    }
    for stage in (0, 2)
]
"""ds_worker scenarios of the frozen-parameter test, run in the 2-rank job of conftest.py."""


def test_frozen_bias_under_deepspeed_zero0_and_zero2(two_rank_job: dict[str, Any]) -> None:
    """issue 14, item 4: the same under DeepSpeed, ZeRO 0 and ZeRO 2 on 2 ranks (micro-batch 2, 2 accumulation
    steps): one SGD step moves each weight by ``-lr P(g)`` of the float64 reference on the global batch, with the
    frozen bias left out of ``A``, and the bias of a frozen weight by ``-lr g``."""
    lr, world, micro, ga, freeze = 0.1, 2, 2, 2, FREEZE
    runs = two_rank_job["frozen"]
    model = problem.make_model()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in freeze)
    x, y = problem.global_batch(0, world * micro * ga)
    expected = reference_preconditioned(model, x, y, ["0", "2"])
    plain = copy.deepcopy(model).double()
    mse(plain(x.double()), y.double()).backward()
    before = [p.detach().double() for p in model.parameters()]
    want = [
        -lr * expected["0"],
        None,
        -lr * expected["2"][:, :-1],
        -lr * expected["2"][:, -1],
        None,
        -lr * plain[4].bias.grad,
    ]
    for stage, results in zip((0, 2), runs):
        after = [p.double() for p in results[0]["params"]]
        for i, (b, a, w) in enumerate(zip(before, after, want)):
            if w is None:  # frozen
                assert torch.equal(a, b), f"ZeRO {stage}: frozen parameter {i} moved"
            else:  # fp32 training against the float64 reference: eigh in single precision
                torch.testing.assert_close(a - b, w, rtol=2e-3, atol=1e-6, msg=f"ZeRO {stage}, parameter {i}")


# ------------------------------------------------------------------ item 8: channels_last
@pytest.mark.parametrize("conv_factors", ["expand", "reduce"])
def test_channels_last_conv_matches_contiguous(conv_factors: str) -> None:
    """issue 14, item 8: a conv net in channels_last (weights and inputs) gets the contiguous model's factors and
    preconditioned gradients (to 1e-6), written into the very gradient tensors the optimizer then reads."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 3, stride=2), nn.Flatten())
    x = torch.randn(4, 2, 7, 7)
    target = torch.randn(4, 3 * 3 * 3)
    keys = dict(lr=0.1, damping=DAMPING, kl_clip=1e-3, conv_factors=conv_factors)

    def run(channels_last: bool) -> tuple[nn.Module, KFACPreconditioner, list]:
        net, inputs = copy.deepcopy(model), x
        if channels_last:
            net, inputs = net.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        kfac = KFACPreconditioner(net, optimizer=opt, **keys)
        mse(net(inputs), target).backward()
        grads = [p.grad for p in net.parameters()]
        raw = [g.clone() for g in grads]
        kfac.step()
        assert all(p.grad is g for p, g in zip(net.parameters(), grads)), "the gradient tensors were replaced"
        assert not any(torch.allclose(p.grad, r) for p, r in zip(net.parameters(), raw)), "not preconditioned"
        opt.step()
        return net, kfac, grads

    dense, dense_kfac, dense_grads = run(channels_last=False)
    last, last_kfac, last_grads = run(channels_last=True)
    for weight_grad in last_grads[::2]:  # the test must exercise non-contiguous gradients
        assert weight_grad.is_contiguous(memory_format=torch.channels_last) and not weight_grad.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-6)
    for b_dense, b_last in zip(dense_kfac.blocks, last_kfac.blocks):
        torch.testing.assert_close(b_last.a.value, b_dense.a.value, **tol)
        torch.testing.assert_close(b_last.g.value, b_dense.g.value, **tol)
    for g_last, g_dense in zip(last_grads, dense_grads):
        torch.testing.assert_close(g_last, g_dense, **tol)
    for p_last, p_dense in zip(last.parameters(), dense.parameters()):
        torch.testing.assert_close(p_last, p_dense, **tol)


# ------------------------------------------------------------------ item 9b: no layer registered
def _warnings_of(make: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


def test_no_supported_layer_type_warns_once_pointing_at_register_adapter() -> None:
    """issue 14, item 9b: a model without a supported module type says so, once, at construction."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    (message,) = _warnings_of(lambda: KFACPreconditioner(model, lr=0.1))
    assert "registered no layer" in message and "no module of a supported type (Linear, Conv2d" in message
    assert "ds_kfac.register_adapter" in message


@pytest.mark.parametrize("skip", [False, True], ids=["no-supported-type", "all-skipped"])
def test_a_model_without_registered_layers_says_so_once_and_its_steps_say_nothing(skip: bool) -> None:
    """Issue 47, item 3: a model with no registered layer is named once, at construction, with the layers K-FAC saw
    and why none registered; its steps (none can follow a backward through a registered layer) neither warn
    "step() called twice?" on every step nor count ``steps_without_backward``."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.LayerNorm(8), *[nn.Linear(8, 1)] * skip)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kfac = KFACPreconditioner(model, lr=0.1, skip_layers=["^3$"])
        for _ in range(3):
            model.zero_grad()
            model(torch.randint(0, 10, (5, 2))).sum().backward()
            kfac.step()
    (message,) = [str(w.message) for w in record]
    assert message.startswith("K-FAC registered no layer, so it preconditions nothing")
    if skip:
        assert "every supported layer was skipped ('3': name matches skip_layers pattern '^3$')" in message
    else:
        assert "only '0' (Embedding), '2' (LayerNorm) with trainable parameters" in message
    assert kfac.steps == 0 and "steps_without_backward" not in kfac.counters


def test_all_layers_skipped_warns_once_with_the_reasons_on_rank_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 14, item 9b: every supported layer skipped: one warning listing each skip and its reason, from
    data-parallel rank 0 only (the other ranks' is the same)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 100))

    def build() -> KFACPreconditioner:
        return KFACPreconditioner(model, lr=0.1, skip_layers=["^0$"], max_factor_dim=64)

    (message,) = _warnings_of(build)
    assert "registered no layer" in message
    assert "'0': name matches skip_layers pattern '^0$'" in message and "'1': " in message
    assert "exceeds max_factor_dim=64" in message
    monkeypatch.setattr(ds_kfac.preconditioner, "data_parallel_rank", lambda group=None: 1)
    assert _warnings_of(build) == []
