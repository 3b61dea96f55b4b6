"""K-FAC under DeepSpeed pipeline parallelism (issue 11, items 2 and 3): ``ds_kfac.initialize`` of a
``PipelineModule`` trained with ``engine.train_batch()`` on 2 stages x 1 and 2 stages x 2 data-parallel CPU
ranks (gloo, the real launcher), against the same model trained non-pipelined by ``ds_kfac.initialize`` on
one rank (in this process) with the same global batch of micro-batches and K-FAC config."""

from __future__ import annotations

from typing import Any

import deepspeed
import launch
import pytest
import torch
from deepspeed.pipe import PipelineModule
from workers import ds_worker, problem

import ds_kfac

pytestmark = pytest.mark.timeout(300)

MICRO = 2
KFAC = {"damping": 0.01, "kl_clip": 0.01, "factor_update_steps": 1, "inv_update_steps": 2, "basis_update": "eigh"}
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, summation orders differ

BF16_ZERO1 = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}

TWO_RANKS: dict[str, dict[str, Any]] = {
    "pp2": {"stages": 2, "ga": 2, "steps": 3},
    "tied": {"stages": 2, "ga": 2, "steps": 2, "tied": True},
    "pp2_bf16_zero1": {"stages": 2, "ga": 2, "steps": 3, "ds": BF16_ZERO1},
    "pp2_last_micro_batch": {"stages": 2, "ga": 2, "steps": 3, "kfac": {**KFAC, "factor_micro_batches": 1}},
    "stage_1_state_corrupt": {"stages": 2, "ga": 2, "steps": 3, "corrupt": "kfac_state_pp1.pt", "expect_error": True},
}
FOUR_RANKS: dict[str, dict[str, Any]] = {
    "pp2_dp2": {"stages": 2, "ga": 2, "steps": 4},  # saved after step 2
    "pp2_dp2_resumed": {"stages": 2, "ga": 2, "steps": 4},
    "pp2_dp2_activation_checkpointing": {"stages": 2, "ga": 2, "steps": 3, "checkpoint_interval": 1},
    "pp2_dp2_mem_opt_zero1_ga1": {
        "stages": 2,
        "ga": 1,
        "steps": 3,
        "kfac": {**KFAC, "grad_worker_fraction": "mem-opt"},
        "ds": {"zero_optimization": {"stage": 1}},
    },
    "one_stage_loads_two": {"stages": 1, "ga": 1, "steps": 4, "expect_error": True},
}
REFERENCES = {
    "pp2": (2, 3, {}),
    "pp2_dp2_activation_checkpointing": (4, 3, {}),
    "pp2_bf16_zero1": (2, 3, BF16_ZERO1),
    "pp2_dp2": (4, 4, {}),
    "pp2_dp2_mem_opt_zero1_ga1": (2, 3, {}),
    "pp2_last_micro_batch": (2, 3, {}, {**KFAC, "factor_micro_batches": 1}),
}
"""Each compared run's non-pipelined reference: (micro-batches on the one rank, steps, DeepSpeed overrides[,
K-FAC section])."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Two launches (2 and 4 ranks); each scenario's results by rank."""
    results = {}
    for world, scenarios in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        out = tmp_path_factory.mktemp(f"pp{world}")
        specs = {name: {"kfac": KFAC, "micro": MICRO, **s} for name, s in scenarios.items()}
        if world == 2:
            specs["pp2"]["save"] = {"dir": str(out / "ckpt"), "at": 3}
            specs["stage_1_state_corrupt"]["load"] = str(out / "ckpt")
        if world == 4:
            ckpt = str(out / "ckpt")
            specs["pp2_dp2"]["save"] = {"dir": ckpt, "at": 2}
            specs["pp2_dp2_resumed"]["load"] = ckpt
            specs["one_stage_loads_two"]["load"] = ckpt
        worker = launch.WORKERS / "pp_worker.py"
        results.update(zip(specs, launch.deepspeed_run(world, out, list(specs.values()), worker=worker)))
    return results


def reference(
    micro_batches: int, steps: int, ds: dict, kfac: dict = KFAC
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The model's weights and each step's ``nu`` trained non-pipelined on one rank (``ds_kfac.initialize``)."""
    cfg = ds_worker.config({"micro": MICRO, "ga": micro_batches, "kfac": kfac, "ds": ds}, 1)
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=cfg)
    dtype = next(engine.module.parameters()).dtype
    nus = []
    for step in range(steps):
        x, y = problem.global_batch(step, MICRO * micro_batches)
        for m in range(micro_batches):
            rows = slice(m * MICRO, (m + 1) * MICRO)
            engine.backward(problem.loss_fn(engine(x[rows].to(dtype)), y[rows]))
            engine.step()
        nus.append(float(engine.kfac.last_nu))
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return params, nus


@pytest.mark.parametrize("name", list(REFERENCES))
def test_pipeline_equals_the_non_pipelined_run(name: str, runs: dict[str, list[dict]], one_rank: None) -> None:
    """Each stage's weights after the steps equal the non-pipelined run's weights of the same layers, and every
    rank's ``nu`` (one KL clip over the stages' layers) is the reference's, at every step. The reference is
    not vacuous: K-FAC and the KL clip change the update (nu < 1, and plain SGD differs)."""
    params, nus = reference(*REFERENCES[name])
    ranks = runs[name]
    assert all(r["engine"] == "KFACPipelineEngine" for r in ranks)
    assert sorted({n for r in ranks for n in r["layers"]}) == ["0", "2", "4"]  # each stage its own layers
    assert {r["stage"] for r in ranks} == {0, 1}
    for r in ranks:
        assert r["params"].keys() <= params.keys() and r["params"]
        for key, value in r["params"].items():
            torch.testing.assert_close(value, params[key], **TOL)
        assert r["nus"] == ranks[0]["nus"]  # identical on every rank
        torch.testing.assert_close(torch.tensor(r["nus"]), torch.tensor(nus), **TOL)
    assert max(nus) < 1.0
    plain = problem.make_model().state_dict()
    assert not all(torch.allclose(plain[k], v.float()) for k, v in params.items())


def test_overlap_and_mem_opt_placement(runs: dict[str, list[dict]]) -> None:
    """Factors are reduced during the last micro-batch's backward pass (found by counting the stage's forward
    passes; with one micro-batch every backward pass is the last); with
    mem-opt a stage's layers are placed over the stage's two data-parallel ranks (at ZeRO 1 a layer's gradient
    workers are the ranks whose partitions hold it: one for a whole layer)."""
    ranks = runs["pp2_dp2_mem_opt_zero1_ga1"]
    assert all(r["overlapped"] > 0 for r in ranks)
    last_stage = [r["grad_workers"] for r in ranks if r["stage"] == 1]
    assert last_stage[0] == last_stage[1]  # one plan per stage
    workers = [tuple(w) for w in last_stage[0].values()]
    assert {w for ws in workers for w in ws} == {0, 1}  # both of the stage's ranks work
    assert (1,) in workers  # a whole layer (not split by ZeRO 1's partitions) has one gradient worker
    for name in ("pp2_dp2", "pp2_dp2_activation_checkpointing"):  # two micro-batches: the second's backward
        assert all(r["overlapped"] > 0 for r in runs[name]), name


def identical(a: Any, b: Any) -> bool:
    """Whether two K-FAC states (nested containers of tensors and plain values) are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_is_bitwise(runs: dict[str, list[dict]]) -> None:
    """Saved after step 2 of 4 and resumed: the same weights and K-FAC state, bit for bit, on every rank."""
    for whole, resumed in zip(runs["pp2_dp2"], runs["pp2_dp2_resumed"]):
        assert resumed["kfac_steps"] == whole["kfac_steps"] == 4
        assert resumed["nus"] == whole["nus"][2:]
        assert whole["params"].keys() == resumed["params"].keys()
        assert all(torch.equal(whole["params"][k], resumed["params"][k]) for k in whole["params"])
        assert (whole["kfac"] is not None) == (whole["dp_rank"] == 0)  # each stage's state, on its rank 0
        assert identical(whole["kfac"], resumed["kfac"])


def test_another_number_of_stages_is_refused(runs: dict[str, list[dict]]) -> None:
    """A checkpoint of 2 stages loaded into a 1-stage pipeline raises on every rank, naming both counts."""
    for r in runs["one_stage_loads_two"]:
        assert r["error"] is not None
        assert "holds the K-FAC state of 2 pipeline stages" in r["error"] and "this pipeline has 1" in r["error"]


def test_tied_layers_across_stages_are_skipped(runs: dict[str, list[dict]]) -> None:
    """A ``TiedLayerSpec`` module used on both stages is left out of K-FAC on both, with a warning naming it;
    the stages' other layers are preconditioned."""
    ranks = runs["tied"]
    assert [r["layers"] for r in ranks] == [["2"], ["5"]]
    for r in ranks:
        assert [name for name, _ in r["skipped"]] == ["tied_modules.ends"]
        assert any("tied across pipeline stages" in w and "tied_modules.ends" in w for w in r["warnings"])
        assert r["kfac_steps"] == 2


def test_a_stage_without_k_fac_layers_is_refused(one_rank: None) -> None:
    """A stage whose layers are all skipped would skip every K-FAC step while the other stages wait for it in
    the KL clip's sum: refused when the engine is built (here a one-stage pipeline on one rank)."""
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=list(problem.make_model()), num_stages=1, loss_fn=problem.loss_fn)
    cfg = ds_worker.config({"micro": MICRO, "ga": 1, "kfac": {**KFAC, "skip_layers": ["."]}}, 1)
    with pytest.warns(UserWarning, match="K-FAC registered no layer"):
        with pytest.raises(ValueError, match=r"pipeline stages \[0\] have no layer K-FAC preconditions"):
            ds_kfac.initialize(model=model, config=cfg)


def test_a_stage_state_that_cannot_load_is_refused_on_every_stage(runs: dict[str, list[dict]]) -> None:
    """Stage 1's K-FAC state file is unreadable: its rank names the file, and stage 0, whose own state is fine,
    raises too (before DeepSpeed loads anything), instead of loading alone."""
    stage0, stage1 = runs["stage_1_state_corrupt"]
    assert "kfac_state_pp1.pt (" in stage1["error"] and "is truncated or corrupt" in stage1["error"]
    assert "the K-FAC state of another pipeline stage" in stage0["error"]
