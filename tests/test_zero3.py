"""ZeRO stage 3 on real DeepSpeed engines, 2 CPU ranks over gloo, against single-process references.

One module-scoped launch runs most scenarios; a single rank in this process resumes a 2-rank checkpoint.
"""

from __future__ import annotations

import launch
import pytest
import torch
from test_deepspeed import (
    BF16_TOL,
    FP32_TOL,
    GA,
    KFAC,
    WORLD,
    assert_ranks_identical,
    factor_bytes,
    fp32_tolerance,
    reference,
)
from workers import ds_worker, problem

import ds_kfac

pytestmark = pytest.mark.timeout(420)

STEPS = 6
SAVE_AT = 3
STAGE3 = {"zero_optimization": {"stage": 3}}
MEM_OPT = {**KFAC, "grad_worker_fraction": "mem-opt"}
SCENARIOS = {
    "allreduce": {"ds": STAGE3, "kfac": MEM_OPT},
    "reduce_zero_init": {"ds": STAGE3, "kfac": {**MEM_OPT, "factor_reduction": "reduce"}, "zero_init": True},
    "inverse": {"ds": STAGE3, "kfac": {**MEM_OPT, "compute_method": "inverse"}},
    "outer_product_adaptive": {
        "ds": STAGE3,
        "kfac": {**MEM_OPT, "eigenvalue_outer_product": True, "inv_update_steps": "adaptive"},
    },
    "bf16": {"ds": {**STAGE3, "bf16": {"enabled": True}}, "kfac": MEM_OPT},
    "local": {"ds": STAGE3, "kfac": {**MEM_OPT, "factor_reduction": "local"}},
    "local_stage0": {"kfac": {**MEM_OPT, "factor_reduction": "local"}},
    "corrected": {"ds": STAGE3, "kfac": {**MEM_OPT, "eigenvalue_correction": True}},
    "batchnorm": {"ds": STAGE3, "kfac": {**MEM_OPT, "batchnorm": "unit-wise"}, "model": "batchnorm"},
    # The optimizer built by the script and handed to initialize (a "client_optimizer" section), under ZeRO 3.
    "client": {
        "ds": {
            **STAGE3,
            "client_optimizer": {"class": "torch.optim.SGD", "params": {"lr": 0.1}},
            "zero_allow_untested_optimizer": True,
        },
        "kfac": MEM_OPT,
    },
}
FP32 = ("allreduce", "reduce_zero_init", "inverse", "outer_product_adaptive", "corrected", "batchnorm", "client")
RESUMED = {"allreduce": "resumed", "corrected": "resumed_corrected"}
"""Scenarios saved after step SAVE_AT, and the scenario resuming each."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("zero3")
    scenarios = {name: {**s, "steps": STEPS} for name, s in SCENARIOS.items()}
    for saved, resumed in RESUMED.items():
        scenarios[saved]["save"] = {"dir": str(out / saved), "at": SAVE_AT}
        scenarios[resumed] = {**SCENARIOS[saved], "steps": STEPS, "load": str(out / saved)}
    scenarios["comm_opt"] = {"ds": STAGE3, "kfac": KFAC, "steps": 1, "expect_error": True}
    local_corrected = {**KFAC, "factor_reduction": "local", "eigenvalue_correction": True}
    scenarios["local_corrected_comm_opt"] = {"kfac": local_corrected, "steps": 1, "expect_error": True}
    sampled = {**MEM_OPT, "fisher": "sampled"}
    scenarios["sampled_fisher"] = {"ds": STAGE3, "kfac": sampled, "steps": 1, "expect_error": True}
    results = dict(zip(scenarios, launch.deepspeed_run(WORLD, out, list(scenarios.values()))))
    results["ckpt"] = str(out / "allreduce")
    return results


@pytest.mark.parametrize("variant", FP32 + ("bf16",))
def test_zero3_matches_single_process(runs: dict, variant: str) -> None:
    """Gradient accumulation (2 micro-batches of 2 per rank): the parameters after 6 K-FAC steps equal the
    single-process run on the global batch (fp32 to 1e-5; bf16 to its 8-bit mantissa), with factors reduced
    to every worker or to the decomposing rank only, eigen (with or without the outer product, adaptive
    refresh) or inverse; ranks agree. K-FAC ran once per optimizer step, not per micro-batch."""
    expected, _ = reference(STEPS, model=SCENARIOS[variant].get("model", "mlp"), **SCENARIOS[variant]["kfac"])
    results = runs[variant]
    assert_ranks_identical(results)
    scenario = SCENARIOS[variant]
    tolerance = BF16_TOL if variant == "bf16" else fp32_tolerance(scenario["kfac"], scenario.get("model", "mlp"))
    for got, want in zip(results[0]["params"], expected):
        torch.testing.assert_close(got, want, **tolerance)
    for r in results:
        assert r["kfac_steps"] == STEPS and r["micro_steps"] == STEPS * GA
    assert results[0]["kfac"]["steps"] == STEPS


def test_local_factors_match_stage_0(runs: dict) -> None:
    """``factor_reduction: "local"`` (each layer's factors from its worker's own micro-batches, which no single
    process reproduces) gives the stage 0 run's parameters; ranks agree."""
    assert_ranks_identical(runs["local"])
    for got, want in zip(runs["local"][0]["params"], runs["local_stage0"][0]["params"]):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_zero_init_registers_the_same_layers(runs: dict) -> None:
    """A model built under deepspeed.zero.Init (parameters partitioned from the start, ``param.shape`` empty)
    registers the same layers, with the same factor shapes, as the plain model (single process) and as
    the model DeepSpeed partitions itself at stage 3."""
    _, kfac = reference(1)
    plain = [(b.name, b.adapter.a_dim, b.adapter.g_dim) for b in kfac.blocks]
    engine_partitioned, zero_init = runs["allreduce"][0], runs["reduce_zero_init"][0]
    assert [tuple(layer) for layer in zero_init["layers"]] == plain == [("0", 7, 5), ("2", 6, 4), ("4", 5, 3)]
    assert engine_partitioned["layers"] == zero_init["layers"]
    for name, a, g in plain:
        assert zero_init["kfac"]["layers"][name]["A"].shape == (a, a)
        assert zero_init["kfac"]["layers"][name]["G"].shape == (g, g)
        assert zero_init["kfac"]["layers"][name]["shape"] == (a, g)


def _span(numel: int, rank: int) -> int:
    """How many elements of a parameter's gradient ZeRO 3 puts in ``rank``'s partition."""
    chunk = -(-numel // WORLD)
    return max(0, min(numel, (rank + 1) * chunk) - rank * chunk)


def test_bytes_on_the_wire_match_the_formula(runs: dict) -> None:
    """Per step and rank: factors as at stage 0 (presence flags and A, G, all-reduced), one KL scalar, and two
    all-to-alls: each rank sends its slices of the layers another rank preconditions to that rank, and each
    gradient worker sends every other rank its slices of ``P(g)``. So each layer moves ``4 (n - n_w)`` bytes
    each way, ``n`` its parameters and ``n_w`` those its worker holds; no K-FAC collective has the size of
    the full gradient. The first step also checks, once, that every decomposed layer was preconditioned."""
    _, kfac = reference(1, grad_worker_fraction="mem-opt")
    results = runs["allreduce"]
    plan = results[0]["plan"]
    numel = {b.name: [p.numel() for p in b.adapter.params()] for b in kfac.blocks}
    full_gradient = 4 * sum(p.numel() for p in problem.make_model().parameters())
    per_step = factor_bytes(kfac) + 4
    for rank, result in enumerate(results):
        sent = 0
        for name, (_, _, workers) in plan.items():
            (worker,) = workers
            if worker == rank:  # P(g): every other rank's slices
                sent += sum(4 * (n - _span(n, rank)) for n in numel[name])
            else:  # g: this rank's slices
                sent += sum(4 * _span(n, rank) for n in numel[name])
        comm = result["comm"]
        assert [c["all_reduce"] for c in comm] == [per_step + 8 * len(kfac.blocks)] + [per_step] * (STEPS - 1)
        assert [c["all_to_all"] for c in comm] == [sent] * STEPS
        assert all(c["broadcast"] == 0 and c["reduce"] == 0 for c in comm)
    assert len({w for _, _, w in plan.values()}) == WORLD, "both ranks should precondition a layer"
    each_way = sum(4 * (n - _span(n, w[0])) for name, (_, _, w) in plan.items() for n in numel[name])
    assert sum(r["comm"][0]["all_to_all"] for r in results) == 2 * each_way
    assert each_way < full_gradient  # what one all-to-all moves, over all ranks together


@pytest.mark.parametrize("saved", list(RESUMED))
def test_checkpoint_resume_is_bitwise(runs: dict, saved: str) -> None:
    """Saved after step 3 and resumed on the same 2 ranks: the same parameters, bit for bit, as the run
    that did not stop (with the eigenvalue correction: S saved from each layer's one gradient worker)."""
    straight, resumed = runs[saved], runs[RESUMED[saved]]
    assert resumed[0]["kfac"]["steps"] == STEPS
    for r in range(WORLD):
        for a, b in zip(straight[r]["params"], resumed[r]["params"]):
            assert torch.equal(a, b)


def test_unsupported_combinations_are_refused(runs: dict) -> None:
    for result in runs["comm_opt"]:
        assert "KFACConfigError" in result["error"]
        assert "grad_worker_fraction='comm-opt' (2 gradient workers per layer) at ZeRO stage 3" in result["error"]
    # (at stage 0) with local factors the owner's S is not sent to the layer's other gradient workers
    for result in runs["local_corrected_comm_opt"]:
        assert "KFACConfigError" in result["error"]
        assert 'eigenvalue_correction with kfac.factor_reduction="local" needs one gradient worker' in result["error"]
    # the sampled Fisher's extra backward would run through ZeRO 3's parameter gathering
    for result in runs["sampled_fisher"]:
        assert 'KFACConfigError: K-FAC does not support yet: kfac.fisher="sampled" at ZeRO stage 3' in result["error"]


def test_resume_at_another_world_size(runs: dict, one_rank: None) -> None:
    """The stage 3 checkpoint saved on 2 ranks after step 3 continues on 1 rank (the same global batch, by
    accumulation) as the single-process run does: its weights through DeepSpeed's ``zero_to_fp32`` (DeepSpeed
    refuses ZeRO optimizer states at another world size; SGD keeps none), K-FAC's state from its own file. The
    rank is this process (ds_worker's scenario, as a 1-rank launch runs it, without the launch's start-up)."""
    resume = {**SCENARIOS["allreduce"], "steps": STEPS, "ga": GA * WORLD, "load_consolidated": runs["ckpt"]}
    ds_kfac.init_distributed()
    single = ds_worker.run(resume)
    expected, _ = reference(STEPS, grad_worker_fraction="mem-opt")
    assert single["kfac"]["steps"] == STEPS and single["micro_steps"] == (STEPS - SAVE_AT) * GA * WORLD
    for got, want in zip(single["params"], expected):
        torch.testing.assert_close(got, want, **FP32_TOL)
