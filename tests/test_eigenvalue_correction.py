"""Eigenvalue-corrected K-FAC (docs/conventions.md, "Eigenvalue correction") against independent float64 references:
per-example gradients from one backward per example, eigenbases from ``eigh`` of the reference factors."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from test_conventions import LAYERS, loss_fn, reference_step
from test_conventions import _problem as conventions_problem
from torch import nn

from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner

pytestmark = pytest.mark.timeout(120)

FLOAT64 = dict(factor_dtype="float64", inv_dtype="float64", kl_clip=None, basis_update="eigh")
TOL = dict(rtol=1e-9, atol=1e-12)


def _sgd_steps(
    layer: nn.Module, batches: list, **keys
) -> tuple[list[nn.Module], list[torch.Tensor], KFACPreconditioner]:
    """SGD(lr=1) on K-FAC-preconditioned gradients, one step per ``(x, target)``: the layer before each step
    (a copy), each step's parameter change as a ``d_out x (d_in [+1])`` matrix, and the preconditioner."""
    layer = copy.deepcopy(layer).double()
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    kfac = KFACPreconditioner(layer, optimizer=opt, **{**FLOAT64, **keys})
    before, deltas = [], []
    for x, target in batches:
        before.append(copy.deepcopy(layer))
        opt.zero_grad()
        loss_fn(layer(x.double()), target.double()).backward()
        kfac.step()
        opt.step()
        deltas.append(_matrix([p.detach() - q.detach() for p, q in zip(layer.parameters(), before[-1].parameters())]))
    return before, deltas, kfac


def _matrix(params: list[torch.Tensor]) -> torch.Tensor:
    m = params[0].reshape(params[0].shape[0], -1)
    return torch.cat([m, params[1].reshape(-1, 1)], 1) if len(params) > 1 else m


def _reference(case: str, layer: nn.Module, x: torch.Tensor, target: torch.Tensor, is_conv: bool) -> tuple:
    """The factors ``A``, ``G``, the per-example gradients ``g_i`` of the convention and the batch gradient.
    ``g_i`` are the true ones (rows summed), or for ``conv_factors="reduce"`` the reduce model's ``(c g_n) a_n^T``
    (mean patch ``a_n``, summed output gradient ``c g_n``), whose factors are the second moments of those rows."""
    per_example = ref.per_example_gradients(copy.deepcopy(layer).double(), x, target, loss_fn)
    if case != "conv_reduce":
        _, a, g, _ = reference_step(layer, x, target, is_conv, "eigen", 0.01)
        return a, g, per_example, per_example.mean(0)
    layer = copy.deepcopy(layer).double()
    out = layer(x.double())
    out.retain_grad()
    loss_fn(out, target.double()).backward()
    batch = x.shape[0]
    patches = ref.conv_rows(layer, x).reshape(batch, -1, layer.in_channels * 9 + 1).mean(1)
    sums = batch * out.grad.sum(dim=(2, 3))
    reduced = torch.stack([torch.outer(g, a) for g, a in zip(sums, patches)])
    return ref.second_moment(patches), ref.second_moment(sums), reduced, per_example.mean(0)


CASES = {**{case: {} for case in LAYERS}, "conv_reduce": {"conv_factors": "reduce"}}


def _problem(case: str, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, bool]:
    """test_conventions' layers, and for reduce a conv with more examples than ``A`` has rows (B = 16 > 10), so
    that the eigenbases have no degenerate null space (which ``eigh`` may rotate freely)."""
    if case != "conv_reduce":
        return conventions_problem(case, seed)
    torch.manual_seed(seed)
    layer, x = nn.Conv2d(1, 2, 3, stride=2, padding=1), torch.randn(16, 1, 5, 5)
    return layer, x, torch.randn_like(layer(x)), True


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("rebase", [False, True], ids=["same_basis", "new_basis"])
@pytest.mark.parametrize("case", list(CASES))
def test_corrected_step_matches_reference(case: str, rebase: bool, relative: bool) -> None:
    """Step 0 decomposes (no S yet: plain eigen); step 1 projects its per-example gradients on step 0's basis
    into S. Without a decomposition at step 1, P(g) divides by S + damping in that basis; with one
    (``inv_update_steps=1``) S is re-projected onto step 1's basis first. ``damping * mean(S)`` when relative."""
    layer, x0, t0, is_conv = _problem(case, seed=0)
    _, x1, t1, _ = _problem(case, seed=1)
    damping = 0.01
    keys = dict(damping=damping, factor_decay=0.0, inv_update_steps=1 if rebase else 100, **CASES[case])
    before, deltas, kfac = _sgd_steps(
        layer, [(x0, t0), (x1, t1)], eigenvalue_correction=True, relative_damping=relative, **keys
    )

    a0, g0, *_ = _reference(case, layer, x0, t0, is_conv)
    a1, g1, per_example, grad = _reference(case, before[1], x1, t1, is_conv)
    basis = ref.eigenbasis(a0), ref.eigenbasis(g0)
    s = ref.corrected_scaling(*basis, per_example)
    if rebase:
        old, basis = basis, (ref.eigenbasis(a1), ref.eigenbasis(g1))
        s = ref.rebased(s, old, basis)
    block = damping * s.mean().item() if relative else damping
    expected = ref.precondition_corrected(*basis, s, grad, block)
    torch.testing.assert_close(deltas[1], -expected, **TOL)
    # The test can fail: dividing by the Kronecker eigenvalues in the same basis differs.
    kronecker = ref.precondition_eigen(a1 if rebase else a0, g1 if rebase else g0, grad, damping)
    assert not torch.allclose(expected, kronecker, rtol=1e-3)
    assert kfac.memory_usage()["eigenvalue_corrections"] == 8 * grad.numel()


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_one_example_with_one_row_is_plain_eigen(relative: bool) -> None:
    """One example with one row: its gradient is one Kronecker product, so S = v_G v_A^T exactly and the
    corrected step equals the plain eigen step. The weights stay (lr 0): step 1 sees step 0's factors, basis
    and gradient, and the gradients are read after preconditioning."""
    torch.manual_seed(3)
    layer, x, target = nn.Linear(5, 3).double(), torch.randn(1, 5).double(), torch.randn(1, 3).double()

    def preconditioned(**keys) -> tuple[list[torch.Tensor], KFACPreconditioner]:
        model = copy.deepcopy(layer)
        kfac = KFACPreconditioner(
            model, lr=0.0, factor_decay=0.0, inv_update_steps=100, relative_damping=relative, **FLOAT64, **keys
        )
        out = []
        for _ in range(2):
            model.zero_grad()
            loss_fn(model(x), target).backward()
            kfac.step()
            out.append(_matrix([p.grad for p in model.parameters()]))
        return out, kfac

    plain, _ = preconditioned()
    corrected, kfac = preconditioned(eigenvalue_correction=True)
    _, va, _, vg = kfac.blocks[0].decomposition
    torch.testing.assert_close(kfac.blocks[0].correction.value, torch.outer(vg, va), rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(corrected[0], plain[0], rtol=0, atol=0)  # step 0: no S yet
    torch.testing.assert_close(corrected[1], plain[1], rtol=1e-9, atol=1e-14)


def _train(kfac_model: tuple[nn.Module, KFACPreconditioner, torch.optim.Optimizer], steps: range) -> None:
    model, kfac, opt = kfac_model
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(6, 2, 4, generator=g), torch.randn(6, 2, 3, generator=g)
        opt.zero_grad()
        loss_fn(model(x), target).backward()
        kfac.step()
        opt.step()


def _build(model: nn.Module, **keys) -> tuple[nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, KFACPreconditioner(model, optimizer=opt, **keys), opt


def test_resume_is_bitwise_and_a_mismatch_is_refused() -> None:
    """S is saved with the factors and decompositions: a run resumed from step 3 (a decomposition every 2 steps,
    so S is re-projected after the resume) equals the straight one bit for bit; a run without the correction
    refuses the state, and one with it refuses a state saved without it."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    keys = dict(eigenvalue_correction=True, inv_update_steps=2, factor_decay=0.8, relative_damping=True)
    straight = _build(copy.deepcopy(model), **keys)
    _train(straight, range(6))
    first = _build(copy.deepcopy(model), **keys)
    _train(first, range(3))
    state = first[1].state_dict()
    assert all(entry["S"] is not None for entry in state["layers"].values())
    resumed = _build(copy.deepcopy(first[0]), **keys)
    resumed[1].load_state_dict(state)
    _train(resumed, range(3, 6))
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)
    plain_keys = {**keys, "eigenvalue_correction": False}
    with pytest.raises(ValueError, match="saved with eigenvalue_correction=True, this run uses False"):
        _build(copy.deepcopy(model), **plain_keys)[1].load_state_dict(state)
    plain = _build(copy.deepcopy(model), **plain_keys)
    _train(plain, range(1))
    with pytest.raises(ValueError, match="saved with eigenvalue_correction=False, this run uses True"):
        _build(copy.deepcopy(model), **keys)[1].load_state_dict(plain[1].state_dict())


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"compute_method": "inverse"}, "needs compute_method 'eigen'"),
        ({"eigenvalue_outer_product": True}, "cannot be combined with eigenvalue_outer_product"),
    ],
)
def test_combinations_without_an_eigenbasis_are_refused(keys: dict, message: str) -> None:
    with pytest.raises(KFACConfigError, match=rf"kfac\.eigenvalue_correction: true {message}"):
        KFACConfig.parse({"eigenvalue_correction": True, **keys})
