"""The sampled Fisher (``fisher: "sampled"``, docs/conventions.md) against independent float64 references: targets
drawn with a generator of the same seed, output gradients of the sampled loss written out by hand."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from torch import nn

from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner

pytestmark = pytest.mark.timeout(120)

FLOAT64 = dict(factor_dtype="float64", inv_dtype="float64", kl_clip=None, factor_decay=0.0)
DAMPING = 0.01
SEED = 7

# name -> (input, training targets (class indices, -100 ignored; or regression targets), loss)
CASES = {
    "classifier": (lambda: torch.randn(8, 5), lambda: torch.randint(0, 4, (8,)), "cross_entropy"),
    "sequence_with_ignored_positions": (
        lambda: torch.randn(3, 6, 5),
        lambda: torch.where(torch.rand(3, 6) < 0.5, torch.randint(0, 4, (3, 6)), -100),
        "cross_entropy",
    ),
    "regression": (lambda: torch.randn(8, 5), lambda: torch.randn(8, 4), "mse"),
}


def _training_loss(out: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    if loss == "mse":
        return F.mse_loss(out, targets)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _sampled_output_grads(out: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """d(sampled loss)/d(output), by hand: ``(softmax - onehot(y)) / (valid positions)`` at the valid positions, or
    ``-2 e / numel`` for ``y = output + e``, with the random numbers of a generator seeded ``SEED``."""
    generator = torch.Generator().manual_seed(SEED)
    if loss == "mse":
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype)
        return -2 * noise / out.numel()
    logits = out.reshape(-1, out.shape[-1])
    probs = logits.softmax(-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    valid = targets.reshape(-1) != -100
    grads = (probs - F.one_hot(sampled, logits.shape[-1]).double()) * valid[:, None] / valid.sum()
    return grads.reshape(out.shape)


@pytest.mark.parametrize("case", list(CASES))
def test_step_preconditions_with_the_sampled_g(case: str) -> None:
    """One step: A from the inputs, G from the sampled loss's output gradients (scaled by B, as any G), and P(g)
    of the training loss's gradient, which is what .grad held."""
    torch.manual_seed(0)
    make_x, make_targets, loss = CASES[case]
    layer, x, targets = nn.Linear(5, 4).double(), make_x().double(), make_targets()
    model = copy.deepcopy(layer)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kfac = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, fisher="sampled", **FLOAT64)
    out = model(x)
    assert kfac.sample_fisher(out, loss, labels=targets, generator=torch.Generator().manual_seed(SEED))
    _training_loss(out, targets, loss).backward()
    kfac.step()
    opt.step()
    delta = torch.cat([(model.weight - layer.weight).detach(), (model.bias - layer.bias).detach()[:, None]], 1)

    out = layer(x)
    _training_loss(out, targets, loss).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    a = ref.second_moment(ref.linear_rows(x, bias=True))
    g = ref.second_moment(ref.output_grad_rows(_sampled_output_grads(out.detach(), targets, loss), False), x.shape[0])
    expected = ref.precondition_eigen(a, g, grad, DAMPING)
    torch.testing.assert_close(delta, -expected, rtol=1e-9, atol=1e-12)
    # The test can fail: the empirical G (the training loss's output gradients) gives another step.
    empirical = ref.second_moment(
        ref.output_grad_rows(torch.func.grad(lambda o: _training_loss(o, targets, loss))(out.detach()), False),
        x.shape[0],
    )
    assert not torch.allclose(expected, ref.precondition_eigen(a, empirical, grad, DAMPING), rtol=1e-3)


@pytest.mark.parametrize("linear", ["torch", "autograd_function"])
@pytest.mark.parametrize("shape", [(8,), (3, 4)], ids=["batch", "sequence"])
def test_inner_layers_get_the_sampled_g_through_the_network(
    shape: tuple[int, ...], linear: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two layers: the first layer's G comes from the sampled output gradients back-propagated by hand through the
    second layer and the tanh (the pass starts below the output's own backward node: an addmm, or for a sequence
    the view after it). ``autograd_function``: ``F.linear`` is DeepSpeed's ZeRO 3 linear, a custom autograd
    Function whose backward node is not callable (a ZeRO 3 engine built in the process installs it for good)."""
    if linear == "autograd_function":
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    x, targets = torch.randn(*shape, 5).double(), torch.randint(0, 4, shape)
    first, second = copy.deepcopy(model[0]), copy.deepcopy(model[2])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kfac = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, fisher="sampled", **FLOAT64)
    out = model(x)
    kfac.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(SEED))
    _training_loss(out, targets, "cross_entropy").backward()
    kfac.step()
    opt.step()

    h = first(x)
    _training_loss(second(torch.tanh(h)), targets, "cross_entropy").backward()
    grad = torch.cat([first.weight.grad, first.bias.grad[:, None]], 1)
    out_grads = _sampled_output_grads(second(torch.tanh(h)).detach(), targets, "cross_entropy")
    h_grads = (out_grads @ second.weight.detach()) * (1 - torch.tanh(h.detach()) ** 2)
    a = ref.second_moment(ref.linear_rows(x, bias=True))
    g = ref.second_moment(h_grads.reshape(-1, 6), x.shape[0])
    expected = ref.precondition_eigen(a, g, grad, DAMPING)
    delta = torch.cat([(model[0].weight - first.weight).detach(), (model[0].bias - first.bias).detach()[:, None]], 1)
    torch.testing.assert_close(delta, -expected, rtol=1e-9, atol=1e-12)


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))


def test_the_sampled_backward_leaves_grad_as_the_training_loss_makes_it() -> None:
    """No .grad exists after the sampled pass, and after the training loss's backward every .grad equals, bit for
    bit, that of the same backward without the sampled pass (before K-FAC's step rewrites it)."""
    x, targets = torch.randn(8, 5), torch.randint(0, 4, (8,))
    plain, sampled = _mlp(), _mlp()
    kfac = KFACPreconditioner(sampled, lr=0.1, fisher="sampled")
    F.cross_entropy(plain(x), targets).backward()
    out = sampled(x)
    assert kfac.sample_fisher(out, "cross_entropy")
    assert all(p.grad is None for p in sampled.parameters())
    F.cross_entropy(out, targets).backward()
    for p, q in zip(plain.parameters(), sampled.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(b.g.pending == 1 for b in kfac.blocks)  # G counted once: in the sampled pass


def test_a_factor_step_without_the_sampled_pass_is_an_error_and_other_steps_skip_it() -> None:
    """Factors every 2 steps: the helper does nothing at step 1 (no factor update), and a factor-update step whose
    loop did not call it stops with a message naming the call."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFACPreconditioner(model, optimizer=opt, fisher="sampled", factor_update_steps=2)
    x, targets = torch.randn(8, 5), torch.randint(0, 4, (8,))
    for step, call in ((0, True), (1, True), (2, False)):
        opt.zero_grad()
        out = model(x)
        if call:
            assert kfac.sample_fisher(out, "cross_entropy") == (step == 0)
        F.cross_entropy(out, targets).backward()
        if step == 2:
            with pytest.raises(RuntimeError, match=r"call kfac\.sample_fisher\(logits, loss\)"):
                kfac.step()
        else:
            kfac.step()
            opt.step()
    with torch.no_grad():
        assert not kfac.sample_fisher(model(x), "cross_entropy")  # evaluation: nothing awaits a backward


@pytest.mark.parametrize(
    "loss, spoil", [("cross_entropy", float("nan")), ("cross_entropy", float("inf")), ("mse", float("inf"))]
)
def test_non_finite_outputs_are_discarded_like_the_empirical_path(loss: str, spoil: float) -> None:
    """issue 30, item 1: a micro-batch whose outputs are not finite (one example's logits NaN or infinite) used to
    stop the run with torch's sampling error from inside ds_kfac. Now its sampled ``G`` is non-finite and discarded as
    the empirical path discards one: the layers keep the previous ``G``, counted, and the next step goes on."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFACPreconditioner(model, optimizer=opt, fisher="sampled", kl_clip=None)
    history = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, targets = torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        out = model(x)
        sampled_from = out.clone()
        if step == 1:
            sampled_from = torch.cat([sampled_from[:1] * spoil, sampled_from[1:]])
        assert kfac.sample_fisher(sampled_from if loss == "cross_entropy" else sampled_from.sin(), loss)
        F.cross_entropy(out, targets).backward()
        if step == 1:
            with pytest.warns(RuntimeWarning, match=r"skipped non-finite factor updates of \['0/G', '2/G'\]"):
                kfac.step()
        else:
            kfac.step()
        opt.step()
        history.append([b.g.value.clone() for b in kfac.blocks])
    assert kfac.counters["nonfinite_factor_updates"] == len(kfac.blocks)
    assert all(torch.equal(a, b) for a, b in zip(history[0], history[1]))  # kept at the spoiled step
    assert all(b.isfinite().all() and not torch.equal(a, b) for a, b in zip(history[1], history[2]))
    assert all(p.isfinite().all() for p in model.parameters())


def _train(model: nn.Module, kfac: KFACPreconditioner, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, targets = torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        out = model(x)
        kfac.sample_fisher(out, "cross_entropy")
        F.cross_entropy(out, targets).backward()
        kfac.step()
        opt.step()


def test_resume_is_bitwise_and_a_mismatch_is_refused() -> None:
    """The default sampling generator is seeded from the step: a run resumed from a checkpoint samples the same
    targets, so it equals the straight run bit for bit. The key is recorded in the state."""

    def build(model: nn.Module, fisher: str = "sampled") -> tuple:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, KFACPreconditioner(model, optimizer=opt, fisher=fisher, inv_update_steps=2), opt

    straight = build(_mlp())
    _train(*straight, range(5))
    first = build(_mlp())
    _train(*first, range(2))
    resumed = build(copy.deepcopy(first[0]))
    resumed[1].load_state_dict(first[1].state_dict())
    _train(*resumed, range(2, 5))
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)
    # The counts of metrics() continue from the checkpoint: 5 factor steps of one sampled pass each.
    for kfac in (straight[1], resumed[1]):
        assert (kfac.counters["sampled_factor_steps"], kfac.counters["sampled_passes"]) == (5, 5)
    with pytest.raises(ValueError, match="saved with fisher='sampled', this run uses 'empirical'"):
        build(_mlp(), fisher="empirical")[1].load_state_dict(first[1].state_dict())


def test_the_key_is_validated() -> None:
    with pytest.raises(KFACConfigError, match=r"kfac\.fisher: Input should be 'empirical' or 'sampled'"):
        KFACConfig.parse({"fisher": "true"})
