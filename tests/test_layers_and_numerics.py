"""Layer registration rules, numerical fallbacks and preconditioner state."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from torch import nn

from ds_kfac import KFACConfigError, KFACPreconditioner, UnsupportedLayerError
from ds_kfac.curvature import EigenDecomposition

pytestmark = pytest.mark.timeout(120)


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def test_skip_by_name_and_by_factor_size() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 100))
    kfac = KFACPreconditioner(model, lr=0.1, skip_layers=[r"^2$"], max_factor_dim=64)
    assert kfac.layer_names == ["0"]
    reasons = {s.name: s.reason for s in kfac.skipped_layers}
    assert "skip_layers" in reasons["2"] and "max_factor_dim=64" in reasons["3"]


def test_frozen_layers_are_skipped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    assert KFACPreconditioner(model, lr=0.1).layer_names == ["1"]


def test_grouped_conv_refused_with_layer_name() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(UnsupportedLayerError, match=r"layer '0'.*groups=2.*skip_layers"):
        KFACPreconditioner(model, lr=0.1)
    with pytest.warns(UserWarning, match=r"registered no layer.*'0': name matches skip_layers"):
        assert KFACPreconditioner(model, lr=0.1, skip_layers=["0"]).layer_names == []


def test_reflect_padding_refused() -> None:
    with pytest.raises(UnsupportedLayerError, match="padding_mode='reflect'"):
        KFACPreconditioner(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), lr=0.1)


def test_same_padding_matches_explicit_padding() -> None:
    """padding='same' (asymmetric for even kernels) gives the factors of the explicitly padded input."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, (2, 3), padding="same").double()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    kfac = KFACPreconditioner(conv, kl_clip=None, factor_dtype="float64")
    _backward(conv, x)
    kfac.update_curvature()
    # kernel (2, 3) with 'same': rows pad (0 top, 1 bottom), cols pad (1, 1), as PyTorch's own conv does.
    padded = nn.functional.pad(x, (1, 1, 0, 1))
    torch.testing.assert_close(conv(x), nn.functional.conv2d(padded, conv.weight, conv.bias))
    plain = nn.Conv2d(2, 3, (2, 3)).double()
    rows = ref.conv_rows(plain, padded)
    torch.testing.assert_close(kfac.blocks[0].a.value, ref.second_moment(rows), rtol=1e-12, atol=1e-14)


class _AttentionThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attention(x, x, x)[0])


def test_functional_path_reported_by_name() -> None:
    """nn.MultiheadAttention calls out_proj through F.linear: its hooks never fire."""
    torch.manual_seed(0)
    model = _AttentionThenLinear()
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None)
    x = torch.randn(2, 3, 8)
    model(x).square().mean().backward()
    grad = model.attention.out_proj.weight.grad.clone()
    with pytest.warns(RuntimeWarning, match=r"did not fire.*'attention.out_proj'.*not preconditioned$"):
        kfac.step()
    assert kfac.counters["missing_layer_updates"] == 1
    assert kfac.blocks[0].decomposition is None  # passed through, not crashed
    assert torch.equal(model.attention.out_proj.weight.grad, grad)


def test_no_hook_ever_fired_is_refused() -> None:
    """Every registered layer called functionally: K-FAC would do nothing, silently; it raises naming the layers."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(8, 2, batch_first=True)
    kfac = KFACPreconditioner(model, lr=0.1)
    x = torch.randn(2, 3, 8)
    model(x, x, x)[0].square().mean().backward()
    with pytest.raises(RuntimeError, match=r"never run, yet its layers \['out_proj'\].*skip_layers"):
        kfac.step()


def test_nonfinite_factor_update_is_skipped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    kfac = KFACPreconditioner(model, lr=0.1, inv_update_steps=1, factor_dtype="float64")
    _backward(model, torch.randn(4, 3, dtype=torch.float64))
    kfac.step()
    good_a = kfac.blocks[0].a.value.clone()
    model.zero_grad()
    bad = torch.randn(4, 3, dtype=torch.float64)
    bad[0, 0] = float("inf")
    _backward(model, bad)
    with pytest.warns(RuntimeWarning, match="non-finite factor"):
        kfac.step()
    assert kfac.counters["nonfinite_factor_updates"] >= 1
    torch.testing.assert_close(kfac.blocks[0].a.value, good_a, rtol=0, atol=0)


def _second_decomposition_with(monkeypatch: pytest.MonkeyPatch, eigh, **keys) -> None:
    """Decompose once, then again with ``torch.linalg.eigh`` replaced: the candidate must be
    rejected (warning, counter) and the first decomposition kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    kfac = KFACPreconditioner(model, lr=0.1, inv_update_steps=1, basis_update="eigh", **keys)
    _backward(model, torch.randn(4, 3))
    kfac.step()
    previous = kfac.blocks[0].decomposition
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    model.zero_grad()
    _backward(model, torch.randn(4, 3))
    with pytest.warns(RuntimeWarning, match=r"could not decompose \['0'\]"):
        kfac.step()
    assert kfac.blocks[0].decomposition is previous
    assert kfac.counters["failed_decompositions"] == 1


def test_failed_decomposition_keeps_previous(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_eigh(matrix: torch.Tensor) -> None:
        raise torch.linalg.LinAlgError("injected")

    _second_decomposition_with(monkeypatch, failing_eigh)


def test_nonfinite_eigenvalue_outer_product_keeps_previous(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN eigenvalues with finite eigenvectors leave only D non-finite: the candidate is still rejected."""
    real = torch.linalg.eigh

    def eigh_nan_values(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, vectors = real(matrix)
        return torch.full_like(values, float("nan")), vectors

    _second_decomposition_with(monkeypatch, eigh_nan_values, eigenvalue_outer_product=True)


def test_float64_retry_when_float32_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.linalg.eigh
    calls = []

    def eigh_failing_in_float32(matrix: torch.Tensor):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected")
        return real(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", eigh_failing_in_float32)
    a = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    a_side, g_side = EigenDecomposition().compute(a, a, 0.1, torch.float32)
    state = a_side + g_side
    assert calls == [torch.float32, torch.float64] * 2
    assert all(t.dtype == torch.float32 for t in state)
    torch.testing.assert_close(state[1], torch.tensor([1.0, 3.0]))


def test_eigenvalues_clamped_at_zero() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, -1e-3]])  # slightly indefinite, as rounding can make a factor
    (_, values), _ = EigenDecomposition().compute(a, None, 0.1, torch.float32)
    assert values.min().item() == 0.0


def test_bf16_model_keeps_fp32_factors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(torch.bfloat16)
    kfac = KFACPreconditioner(model, lr=0.1)
    _backward(model, torch.randn(5, 4, dtype=torch.bfloat16))
    kfac.step()
    assert kfac.blocks[0].a.value.dtype == torch.float32
    assert model[0].weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(model[0].weight.grad.float()).all()


@pytest.mark.parametrize("inv_update_steps", [2, "adaptive"])
def test_state_dict_round_trip_is_bitwise(inv_update_steps) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    data = [torch.randn(6, 4) for _ in range(10)]

    def run(kfac: KFACPreconditioner, m: nn.Module, opt: torch.optim.Optimizer, batches) -> None:
        for x in batches:
            opt.zero_grad()
            _backward(m, x)
            kfac.step()
            opt.step()

    m1 = copy.deepcopy(model)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    k1 = KFACPreconditioner(m1, optimizer=o1, inv_update_steps=inv_update_steps, factor_update_steps=1)
    run(k1, m1, o1, data)

    m2 = copy.deepcopy(model)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    k2 = KFACPreconditioner(m2, optimizer=o2, inv_update_steps=inv_update_steps, factor_update_steps=1)
    run(k2, m2, o2, data[:5])
    saved = copy.deepcopy((k2.state_dict(), m2.state_dict()))
    m3 = copy.deepcopy(model)
    o3 = torch.optim.SGD(m3.parameters(), lr=0.1)
    k3 = KFACPreconditioner(m3, optimizer=o3, inv_update_steps=inv_update_steps, factor_update_steps=1)
    k3.load_state_dict(saved[0])
    m3.load_state_dict(saved[1])
    run(k3, m3, o3, data[5:])
    for p1, p3 in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(p1, p3)


def test_state_dict_mismatch_names_the_difference() -> None:
    state = KFACPreconditioner(nn.Sequential(nn.Linear(4, 3)), lr=0.1).state_dict()
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['1'\].*not in this model \['0'\]"):
        KFACPreconditioner(nn.Sequential(nn.ReLU(), nn.Linear(4, 3)), lr=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"layer '0'.*\(5, 3\).*\(6, 3\)"):
        KFACPreconditioner(nn.Sequential(nn.Linear(5, 3)), lr=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match="compute_method='eigen'"):
        KFACPreconditioner(nn.Sequential(nn.Linear(4, 3)), lr=0.1, compute_method="inverse").load_state_dict(state)


@pytest.mark.parametrize(
    "key, value",
    [("eigenvalue_outer_product", True), ("relative_damping", True), ("conv_factors", "reduce")],
)
def test_state_dict_refuses_another_method_key(key: str, value: object) -> None:
    """Keys that change what a factor or decomposition holds or what damping means must match on
    load; a checkpoint from before a key existed counts as saved with its default."""
    model = nn.Sequential(nn.Linear(4, 3))
    default = KFACPreconditioner(model, lr=0.1)
    other = KFACPreconditioner(copy.deepcopy(model), lr=0.1, **{key: value})
    was = getattr(default.config, key)
    _backward(model, torch.randn(2, 4))
    default.step()
    with pytest.raises(ValueError, match=f"saved with {key}={was!r}, this run uses {value!r}"):
        other.load_state_dict(default.state_dict())
    with pytest.raises(ValueError, match=f"saved with {key}={value!r}, this run uses {was!r}"):
        default.load_state_dict(other.state_dict())
    older = default.state_dict()
    del older[key]
    default.load_state_dict(older)
    with pytest.raises(ValueError, match=f"saved with {key}={was!r}"):
        other.load_state_dict(older)


def test_kl_clip_needs_a_learning_rate() -> None:
    with pytest.raises(KFACConfigError, match="kl_clip needs the learning rate"):
        KFACPreconditioner(nn.Linear(2, 2))


def test_memory_usage_counts_factor_and_decomposition_bytes() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    kfac = KFACPreconditioner(model, lr=0.1)
    _backward(model, torch.randn(2, 4))
    kfac.step()
    # A is 5x5, G 3x3 in float32; eigen keeps Q and v of each.
    assert kfac.memory_usage() == {
        "factors": (25 + 9) * 4,
        "decompositions": (25 + 5 + 9 + 3) * 4,
        "accumulators": 0,
        "refresh_references": 0,
        "preconditioning_cache": 0,
    }


def test_eigenvalue_outer_product_keeps_d_beside_the_eigen_state() -> None:
    """Eigen's state (Q_A 5x5, v_A, Q_G 3x3, v_G) plus D (3x5) kept by the gradient worker,
    recomputed when the damping changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    kfac = KFACPreconditioner(
        model, lr=0.1, damping=lambda step: 0.01 if step < 1 else 0.1, eigenvalue_outer_product=True
    )
    block = kfac.blocks[0]
    for step, damping in enumerate((0.01, 0.1)):
        _backward(model, torch.randn(2, 4))
        kfac.step()
        assert kfac.memory_usage()["decompositions"] == (25 + 5 + 9 + 3) * 4
        assert kfac.memory_usage()["preconditioning_cache"] == 15 * 4
        va, vg = (torch.linalg.eigvalsh(f.value).clamp(min=0) for f in (block.a, block.g))
        if step == 0:
            cached = kfac._stacks._groups[0].cached[0]
            torch.testing.assert_close(cached, 1 / (torch.outer(vg, va) + damping), rtol=1e-4, atol=1e-6)
    _, v_a, _, v_g = block.decomposition
    torch.testing.assert_close(kfac._stacks._groups[0].cached[0], 1 / (torch.outer(v_g, v_a) + 0.1))


@pytest.mark.parametrize("micro_batches", [1, 64])
def test_accumulation_memory_does_not_grow(micro_batches: int) -> None:
    """Factors are accumulated in place: one A and one G buffer per layer, however many micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 8))
    kfac = KFACPreconditioner(model, lr=0.1, accumulation_steps=micro_batches)
    for _ in range(micro_batches):
        (model(torch.randn(4, 16)).square().mean() / micro_batches).backward()
    assert kfac.memory_usage()["accumulators"] == 4 * (17**2 + 12**2 + 13**2 + 8**2)
    assert kfac.blocks[0].a.pending == micro_batches


def test_a_decomposition_of_another_layout_is_refused_at_load() -> None:
    """E.g. an eigen-outer state saved before D moved to the gradient workers: (Q_A, Q_G, D)."""
    model = nn.Sequential(nn.Linear(4, 3))
    kfac = KFACPreconditioner(model, lr=0.1, eigenvalue_outer_product=True)
    _backward(model, torch.randn(2, 4))
    kfac.step()
    state = kfac.state_dict()
    q_a, _, q_g, v_g = state["layers"]["0"]["state"]
    state["layers"]["0"]["state"] = [q_a, q_g, torch.outer(v_g, torch.ones(5))]
    with pytest.raises(
        ValueError, match=r"layer '0': checkpoint decomposition has tensors of shapes \[\(5, 5\), \(3, 3\), \(3, 5\)\]"
    ):
        KFACPreconditioner(nn.Sequential(nn.Linear(4, 3)), lr=0.1, eigenvalue_outer_product=True).load_state_dict(state)
