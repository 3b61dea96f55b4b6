"""The Gauss-Newton oracle (``benchmarks/gn_oracle.py``) against float64 references built explicitly: the
Gauss-Newton matrix ``J^T H J`` from the full Jacobian and each position's softmax Hessian, its damped solve and its
diagonal blocks' solves by ``torch.linalg.solve``, and the quadratic model's report on updates whose answer is
known."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import gn_oracle  # noqa: E402

B, T, D, H, V = 3, 4, 5, 6, 7


class TwoHeads(torch.nn.Module):
    """Token logits and a sequence classifier, as BERT's masked-LM and next-sentence heads."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(D, H)
        self.tokens = torch.nn.Linear(H, V)
        self.pair = torch.nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.inner(x))
        return self.tokens(hidden), self.pair(hidden.mean(1))


@pytest.fixture
def problem():
    torch.manual_seed(0)
    model = TwoHeads().double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    labelled = torch.rand(B, T) < 0.6
    labelled[0, 0] = True
    weights = (labelled.double() / labelled.sum(), torch.full((B,), 1.0 / B, dtype=torch.float64))
    params = dict(model.named_parameters())

    def f(p):
        return torch.func.functional_call(model, p, (x,))

    curvature = gn_oracle.GaussNewton(f, params, gn_oracle.cross_entropy_hessian(weights))
    flat = curvature.flat(params).detach()

    def outputs_of(vector):
        return torch.cat([o.reshape(-1) for o in f(curvature.split(vector))])

    jacobian = torch.autograd.functional.jacobian(outputs_of, flat)  # [outputs, parameters]
    blocks = []
    for logits, weight in zip(f(params), weights):
        p = torch.softmax(logits.detach(), -1).reshape(-1, logits.shape[-1])
        for row, w in zip(p, weight.reshape(-1)):
            blocks.append(w * (torch.diag(row) - torch.outer(row, row)))
    hessian = torch.block_diag(*blocks)
    explicit = jacobian.T @ hessian @ jacobian
    gradient = torch.randn(len(flat), dtype=torch.float64)
    return curvature, explicit, gradient


def test_products_are_the_explicit_gauss_newton_matrix_times_the_vector(problem) -> None:
    curvature, explicit, _ = problem
    for seed in range(3):
        v = torch.randn(explicit.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(curvature.product(v), explicit @ v, rtol=1e-10, atol=1e-12)
    assert torch.allclose(explicit, explicit.T, atol=1e-12) and torch.linalg.eigvalsh(explicit).min() > -1e-12


def test_the_step_is_the_damped_solve_whole_and_block_by_block(problem) -> None:
    curvature, explicit, gradient = problem
    damping = 1e-3
    eye = torch.eye(len(gradient), dtype=torch.float64)
    step, (solved,) = gn_oracle.gauss_newton_step(curvature, gradient, damping, 500, 1e-12)
    assert torch.allclose(step, torch.linalg.solve(explicit + damping * eye, -gradient), rtol=1e-7, atol=1e-9)
    assert solved.residual <= 1e-12
    groups = [["inner.weight", "inner.bias"], ["tokens.weight", "tokens.bias"], ["pair.weight", "pair.bias"]]
    blocked, solves = gn_oracle.gauss_newton_step(curvature, gradient, damping, 500, 1e-12, groups)
    for index, solved in zip(curvature.blocks(groups), solves):
        block = explicit[index][:, index] + damping * torch.eye(len(index), dtype=torch.float64)
        assert torch.allclose(blocked[index], torch.linalg.solve(block, -gradient[index]), rtol=1e-7, atol=1e-9)
    assert len(solves) == 3 and not torch.allclose(blocked, step)  # the cross-layer terms matter


def test_the_quadratic_report_splits_direction_and_scale(problem) -> None:
    """The oracle scores 1; twice the oracle has its direction (1) but no reduction at that scale (0, best scale
    1/2); another direction at its best scale scores its direction's share."""
    curvature, explicit, gradient = problem
    damping = 1e-2
    oracle, _ = gn_oracle.gauss_newton_step(curvature, gradient, damping, 500, 1e-12)
    same = gn_oracle.quadratic_report(curvature, gradient, damping, oracle, oracle)
    assert same["fraction"] == pytest.approx(1, abs=1e-9) and same["best_scale"] == pytest.approx(1, abs=1e-9)
    double = gn_oracle.quadratic_report(curvature, gradient, damping, 2 * oracle, oracle)
    assert double["fraction"] == pytest.approx(0, abs=1e-9) and double["direction"] == pytest.approx(1, abs=1e-9)
    assert double["best_scale"] == pytest.approx(0.5, abs=1e-9)
    sgd = gn_oracle.quadratic_report(curvature, gradient, damping, -gradient, oracle)
    a = explicit + damping * torch.eye(len(gradient), dtype=torch.float64)
    expected = (gradient @ gradient) ** 2 / (gradient @ a @ gradient) / (gradient @ torch.linalg.solve(a, gradient))
    assert sgd["direction"] == pytest.approx(float(expected), rel=1e-7) and 0 < sgd["direction"] < 1
    assert sgd["fraction"] == pytest.approx(sgd["direction"] * sgd["scale"], rel=1e-9)


def test_bert_blocks_cover_every_parameter_once_and_batches_join_padded() -> None:
    """The layerwise oracle's blocks on BERT: every parameter in exactly one block, the tied decoder weight in the
    word embedding's; micro-batches of different lengths joined padded as the collation pads."""
    transformers = pytest.importorskip("transformers")
    import gn_oracle_bert

    config = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16)  # fmt: skip
    model = transformers.BertForPreTraining(config)
    groups = gn_oracle_bert.layer_groups(model)
    names = [name for group in groups for name in group]
    assert sorted(names) == sorted(dict(model.named_parameters())) and len(names) == len(set(names))
    assert ["bert.embeddings.word_embeddings.weight"] in groups
    short = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 7)}
    long = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.full((2, 5), 7)}
    joined = gn_oracle_bert.joined([short, long], 3)
    assert joined["input_ids"].shape == (3, 5) and joined["input_ids"][0].tolist() == [1, 1, 1, 0, 0]
    assert joined["labels"][1].tolist() == [7, 7, 7, -100, -100] and joined["labels"][2].tolist() == [7] * 5


def test_forms_and_the_rescaled_step_solve_the_explicit_two_by_two_model(problem) -> None:
    curvature, explicit, gradient = problem
    damping = 1e-2
    generator = torch.Generator().manual_seed(7)
    update = -gradient + 0.3 * torch.randn(len(gradient), dtype=torch.float64, generator=generator)
    previous = torch.randn(len(gradient), dtype=torch.float64, generator=generator)
    vectors = torch.stack([update, previous], 1)
    assert torch.allclose(curvature.forms([update, previous]), vectors.T @ explicit @ vectors, rtol=1e-10)
    damped = explicit + damping * torch.eye(len(gradient), dtype=torch.float64)
    expected = torch.linalg.solve(vectors.T @ damped @ vectors, -(vectors.T @ gradient))
    alpha, mu = gn_oracle.rescaled(curvature, gradient, damping, update, previous, max_scale=1e6)
    assert alpha == pytest.approx(float(expected[0]), rel=1e-9) and mu == pytest.approx(float(expected[1]), rel=1e-9)
    # the model is no lower anywhere along either vector than at the solution
    model = lambda v: float(gradient @ v + 0.5 * v @ damped @ v)  # noqa: E731
    best = model(alpha * update + mu * previous)
    for da, dm in [(1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3)]:
        assert model((alpha + da) * update + (mu + dm) * previous) > best
    alone, none = gn_oracle.rescaled(curvature, gradient, damping, update, None, max_scale=1e6)
    assert none == 0.0 and alone == pytest.approx(float(-(update @ gradient) / (update @ damped @ update)), rel=1e-9)
    assert gn_oracle.rescaled(curvature, gradient, damping, update, None, max_scale=0.5)[0] == 0.5
    assert gn_oracle.rescaled(curvature, gradient, damping, -update, previous, max_scale=2.0) == (1.0, 0.0)


def test_two_sided_factors_are_the_documented_weighted_moments() -> None:
    """``benchmarks/two_sided.py`` (issue 66's prototype): after a decomposition, a factor step adds to ``A`` the
    rows' second moment weighted by ``g^T G^-1 g / d_g`` and to ``G`` weighted by ``a^T A^-1 a / d_a`` (``A`` with
    its bias column, ``g`` the per-example gradients), each inverse floored at 0.01 of its mean eigenvalue: against
    a float64 recomputation from the rows the layer saw."""
    import two_sided

    from ds_kfac import KFACPreconditioner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None, factor_update_steps=1, inv_update_steps=1)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    seen = {}

    def record(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen["a"] = inputs[0].detach()
        output.register_hook(lambda grad: seen.update(g=grad.detach()))

    model[0].register_forward_hook(record)

    def step() -> None:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        kfac.step()

    step()
    assert two_sided.make_two_sided(kfac.blocks, 0.01) == ["0", "2"]
    block = kfac.blocks[0]
    qa, va, qg, vg = (t.double() for t in block.decomposition)
    before = block.a.value.double(), block.g.value.double()
    step()
    a = torch.cat([seen["a"].double(), torch.ones(16, 1, dtype=torch.float64)], dim=1)
    g = seen["g"].double() * 16  # the mean loss's per-example gradients

    def inverse(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q @ torch.diag(1 / (v.clamp_min(0) + 0.01 * v.clamp_min(0).mean())) @ q.t()

    weight_a = torch.einsum("ni,ij,nj->n", g, inverse(qg, vg), g) / 4
    weight_g = torch.einsum("ni,ij,nj->n", a, inverse(qa, va), a) / 6
    for value, old, rows, weights in zip((block.a.value, block.g.value), before, (a, g), (weight_a, weight_g)):
        expected = 0.95 * old + 0.05 * (rows * weights[:, None]).t() @ rows / 16
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7)
    assert 0.5 < float(weight_a.mean()) < 1.5 and 0.5 < float(weight_g.mean()) < 1.5  # about 1: the scale kept
