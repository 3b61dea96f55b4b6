"""Synchronous EASGD as a DeepSpeed mode (issue 12): 2 CPU ranks over gloo under the real launcher, against a
float64 single-process simulation of the update in docs/conventions.md ("EASGD"); bad configs refused in-process
on one rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from workers import problem

import ds_kfac
from ds_kfac import KFACConfigError, KFACPreconditioner

pytestmark = pytest.mark.timeout(300)

WORLD, MICRO, GA, STEPS = 2, 2, 2, 6
TOL = dict(rtol=1e-6, atol=1e-7)  # fp32 against the float64 simulation
KFAC_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 K-FAC against the fp32 standalone preconditioner (eigh)
BF16_TOL = dict(rtol=5e-2, atol=2e-2)
MOMENTUM = {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 4}}
KFAC = {"damping": 0.01, "kl_clip": 0.01, "factor_update_steps": 1, "inv_update_steps": 2, "basis_update": "eigh"}

SCENARIOS: dict[str, dict[str, Any]] = {
    "sgd_period1": {"easgd": {"rho": 0.5}},
    "momentum_period2": {"easgd": {"rho": 0.5, "period": 2}, "ds": {**MOMENTUM, "scheduler": WARMUP}},
    "momentum_period2_again": {"easgd": {"rho": 0.5, "period": 2}, "ds": {**MOMENTUM, "scheduler": WARMUP}},
    "momentum_period2_no_overlap": {
        "easgd": {"rho": 0.5, "period": 2, "overlap": False},
        "ds": {**MOMENTUM, "scheduler": WARMUP},
    },
    "sgd_period2_ga1": {"easgd": {"rho": 1.0, "period": 2}, "ga": 1},
    "kfac": {"easgd": {"rho": 0.5}, "kfac": KFAC},
    "bf16": {"easgd": {"rho": 0.5}, "ds": {"bf16": {"enabled": True}}},
}
RESUMED = ("momentum_period2_no_overlap", "kfac", "bf16")
"""Saved after step 3 (with period 2 a step without elastic update, whose successor's all-reduce has not started
yet), and resumed from there as ``<name>_resumed``."""


def job_scenarios(out: Path) -> dict[str, dict[str, Any]]:
    """This module's part of conftest.py's EASGD job: every scenario, then the saved ones resumed from their
    checkpoints (under ``out``)."""
    scenarios = {name: {**s, "steps": STEPS, "micro": MICRO} for name, s in copy.deepcopy(SCENARIOS).items()}
    for name in RESUMED:
        scenarios[f"{name}_resumed"] = {**scenarios[name], "load": str(out / name)}
        scenarios[name]["save"] = {"dir": str(out / name), "at": 3}
    return scenarios


@pytest.fixture(scope="module")
def runs(easgd_job: dict[str, dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Each scenario's per-rank results, from the 2-rank launch shared with robustness/test_ranks.py."""
    return easgd_job[__name__]


def local_batches(step: int, rank: int, ga: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches of ``step``, as the worker cuts them."""
    x, y = problem.global_batch(step, MICRO * ga * WORLD)
    rows = [slice((m * WORLD + rank) * MICRO, (m * WORLD + rank + 1) * MICRO) for m in range(ga)]
    return [(x[r], y[r]) for r in rows]


def simulate(
    lrs: list[float], rho: float, period: int, momentum: float = 0.0, ga: int = GA, kfac: bool = False
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The update of docs/conventions.md, written out: every rank's weights and the center after ``len(lrs)``
    steps (float64; fp32 with ``kfac``, whose reference is the standalone preconditioner of each rank's data)."""
    dtype = torch.float32 if kfac else torch.float64
    models = [problem.make_model().to(dtype) for _ in range(WORLD)]
    center = [p.detach().clone() for p in models[0].parameters()]
    buffers: list[list[torch.Tensor | None]] = [[None] * len(center) for _ in range(WORLD)]
    precond = [
        KFACPreconditioner(m, lr=lambda s: lrs[s], accumulation_steps=ga, **KFAC) if kfac else None for m in models
    ]
    for t, lr in enumerate(lrs):
        before = [[p.detach().clone() for p in m.parameters()] for m in models]
        for rank, model in enumerate(models):
            model.zero_grad()
            for x, y in local_batches(t, rank, ga):
                (problem.loss_fn(model(x.to(dtype)), y.to(dtype)) / ga).backward()
            if precond[rank] is not None:
                precond[rank].step()
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    g = p.grad
                    if momentum:
                        buffers[rank][i] = g.clone() if buffers[rank][i] is None else momentum * buffers[rank][i] + g
                        g = buffers[rank][i]
                    p -= lr * g
                    if t % period == 0:
                        p -= lr * rho * (before[rank][i] - center[i])
        if t % period == 0:
            total = [sum(before[r][i] for r in range(WORLD)) for i in range(len(center))]
            center = [c + lr * rho * (s - WORLD * c) for c, s in zip(center, total)]
    return [[p.detach() for p in m.parameters()] for m in models], center


def assert_matches(result: list[dict], expected: tuple, tol: dict) -> None:
    weights, center = expected
    for rank, r in enumerate(result):
        for got, want in zip(r["params"], weights[rank]):
            torch.testing.assert_close(got.double(), want.double(), **tol)
        for got, want in zip(r["center"].values(), center):
            torch.testing.assert_close(got.double(), want.double(), **tol)


def assert_bitwise(a: list[dict], b: list[dict]) -> None:
    for ra, rb in zip(a, b):
        for key in ("params", "swapped"):
            assert all(torch.equal(x, y) for x, y in zip(ra[key], rb[key]))
        assert all(torch.equal(ra["center"][n], rb["center"][n]) for n in ra["center"])


def test_period1_sgd_equals_the_simulation(runs: dict[str, list[dict]]) -> None:
    result = runs["sgd_period1"]
    assert result[0]["engine"] == "EASGDEngine"
    assert_matches(result, simulate(result[0]["lrs"], rho=0.5, period=1), TOL)
    assert not torch.equal(result[0]["params"][0], result[1]["params"][0])  # the ranks' weights differ


def test_period2_momentum_with_a_schedule_equals_the_simulation(runs: dict[str, list[dict]]) -> None:
    result = runs["momentum_period2"]
    lrs = result[0]["lrs"]
    assert len(set(lrs)) > 1  # eta follows the scheduler: the lr of the step, read before it moves
    assert_matches(result, simulate(lrs, rho=0.5, period=2, momentum=0.9), TOL)


def test_period2_without_accumulation_equals_the_simulation(runs: dict[str, list[dict]]) -> None:
    result = runs["sgd_period2_ga1"]
    assert_matches(result, simulate(result[0]["lrs"], rho=1.0, period=2, ga=1), TOL)


def test_center_identical_on_every_rank_and_swapped_in(runs: dict[str, list[dict]]) -> None:
    for result in runs.values():
        first = result[0]
        for other in result[1:]:
            assert all(torch.equal(first["center"][n], other["center"][n]) for n in first["center"])
        for r in result:
            assert all(torch.equal(s, c.to(s.dtype)) for s, c in zip(r["swapped"], r["center"].values()))


def test_identical_runs_and_overlap_on_off_are_bitwise_identical(runs: dict[str, list[dict]]) -> None:
    assert_bitwise(runs["momentum_period2"], runs["momentum_period2_again"])
    assert_bitwise(runs["momentum_period2"], runs["momentum_period2_no_overlap"])


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_bitwise(runs: dict[str, list[dict]], name: str) -> None:
    assert_bitwise(runs[name], runs[f"{name}_resumed"])


def test_bytes_one_packed_all_reduce_per_period(runs: dict[str, list[dict]]) -> None:
    """Weights once per ``period`` steps (fp32, all layers in one message); no gradient or factor traffic."""
    n = sum(p.numel() for p in problem.make_model().parameters())
    assert runs["sgd_period1"][0]["bytes"]["easgd_all_reduce"] == STEPS * 4 * n
    assert runs["momentum_period2"][0]["bytes"]["easgd_all_reduce"] == (STEPS // 2) * 4 * n
    assert runs["kfac"][0]["bytes"] == {"easgd_all_reduce": STEPS * 4 * n, "all_reduce": 0, "reduce": 0, "broadcast": 0}


def test_kfac_preconditions_each_rank_with_its_own_factors(runs: dict[str, list[dict]]) -> None:
    result = runs["kfac"]
    assert result[0]["engine"] == "KFACEASGDEngine"
    assert_matches(result, simulate(result[0]["lrs"], rho=0.5, period=1, kfac=True), KFAC_TOL)


def test_bf16_trains_near_the_fp32_simulation(runs: dict[str, list[dict]]) -> None:
    result = runs["bf16"]
    assert_matches(result, simulate(result[0]["lrs"], rho=0.5, period=1), BF16_TOL)


# ------------------------------------------------------------------ refused configs, one rank in this process
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
REFUSED = {
    "rho missing": ({"easgd": {"period": 2}}, r"easgd\.rho: required when EASGD is enabled"),
    "rho not positive": ({"easgd": {"rho": 0}}, r"easgd\.rho: must be a number > 0 \(got 0\)"),
    "rho a string": ({"easgd": {"rho": "0.5"}}, r"easgd\.rho: must be a number > 0 \(got '0.5'\)"),
    "period": ({"easgd": {"rho": 0.5, "period": 0}}, r"easgd\.period: must be an integer >= 1 \(got 0\)"),
    "overlap": ({"easgd": {"rho": 0.5, "overlap": "yes"}}, r"easgd\.overlap: .*boolean.*'yes'"),
    "unknown key": ({"easgd": {"rho": 0.5, "alpha": 1}}, r"easgd\.alpha: unknown key \(allowed keys: enabled, rho"),
    "not an object": ({"easgd": [1]}, r"'easgd' must be a JSON object"),
    "zero": (
        {"easgd": {"rho": 0.5}, "zero_optimization": {"stage": 1}},
        r"EASGD does not support: zero_optimization\.stage=1",
    ),
    "fp16": ({"easgd": {"rho": 0.5}, "fp16": {"enabled": True}}, r"EASGD does not support: fp16"),
    "kfac factor reduction": (
        {"easgd": {"rho": 0.5}, "kfac": {"factor_reduction": "allreduce"}},
        r"kfac\.factor_reduction='allreduce' \(with easgd each rank preconditions its own gradient",
    ),
    "kfac gradient workers": (
        {"easgd": {"rho": 0.5}, "kfac": {"grad_worker_fraction": "mem-opt"}},
        r"kfac\.grad_worker_fraction='mem-opt'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_bad_configs_are_refused_naming_the_key(case: str, one_rank: None) -> None:
    section, message = REFUSED[case]
    with pytest.raises(KFACConfigError, match=message):
        ds_kfac.initialize(model=problem.make_model(), config={**BASE, **section})


def test_disabled_section_is_plain_deepspeed(one_rank: None, tmp_path: Path) -> None:
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config={**BASE, "easgd": {"enabled": False}})
    assert type(engine).__name__ == "DeepSpeedEngine" and engine.enable_backward_allreduce
    engine.destroy()


def test_a_bad_checkpoint_is_refused_before_anything_loads(one_rank: None, tmp_path: Path) -> None:
    """A per-rank EASGD file with a NaN center (or a missing one) is refused naming the file and key; the
    engine's weights, center and step count stay as they were."""
    config = {**BASE, "gradient_clipping": 0.0, "easgd": {"rho": 0.5}}
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=config)
    for step in range(2):
        for x, y in local_batches(step, 0, 1):
            engine.backward(problem.loss_fn(engine(x), y))
            engine.step()
    engine.save_checkpoint(str(tmp_path), tag="ckpt")
    path = tmp_path / "ckpt" / "easgd_rank0.pt"
    state = torch.load(path)
    state["easgd"]["center"][0] = float("nan")
    torch.save(state, path)
    x, y = local_batches(2, 0, 1)[0]
    engine.backward(problem.loss_fn(engine(x), y))
    engine.step()
    before = ([p.detach().clone() for p in engine.module.parameters()], engine.easgd.center.clone())
    with pytest.raises(
        ValueError, match=r"EASGD state not loaded \(nothing was changed\): .*easgd_rank0\.pt: center: "
    ):
        engine.load_checkpoint(str(tmp_path), tag="ckpt")
    path.unlink()
    with pytest.raises(ValueError, match=r"no .*easgd_rank0\.pt \(saved without EASGD\?\)"):
        engine.load_checkpoint(str(tmp_path), tag="ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before[0], engine.module.parameters()))
    assert torch.equal(before[1], engine.easgd.center) and engine.easgd.steps == 3 and engine.global_steps == 3
    engine.destroy()
