"""Megatron tensor parallelism (issue 11): megatron-core ``ColumnParallelLinear`` -> ``RowParallelLinear`` -> a
replicated ``nn.Linear`` head over gloo, TP=2 (one launch) and TP=2 x DP=2 (another), standalone and through
``ds_kfac.initialize(mpu=parallel_state)``, against single-process runs of the unsharded model in plain
``nn.Linear`` layers (``exact``) or of one ``nn.Linear`` per shard (``shard``); see ``workers/tp_worker.py``."""

from __future__ import annotations

import functools
from typing import Any

import launch
import pytest
import torch
from workers import tp_worker as w

import ds_kfac

pytestmark = pytest.mark.timeout(300)

TWO: dict[str, dict[str, Any]] = {
    "exact": {},
    "exact_no_bias": {"bias": False},
    "exact_skip_bias_add": {"skip_bias_add": True},
    "shard": {"mode": "shard"},
    "exact_float32": {"dtype": "float32"},
    "engine": {"engine": True, "dtype": "float32"},
    "engine_resumed": {"engine": True, "dtype": "float32"},
}
FOUR: dict[str, dict[str, Any]] = {
    "engine": {"engine": True, "dtype": "float32"},
    "placed": {"kfac": {"grad_worker_fraction": 0.5, "factor_reduction": "reduce"}, "dtype": "float32"},
}
TOL = dict(rtol=1e-5, atol=1e-6)
F32_TOL = dict(rtol=1e-5, atol=1e-5)
"""float32 runs (``tp_worker.DTYPES``): shards and data-parallel halves compute and sum the factors in another order
than one process; eigendecompositions amplify that to a few 1e-6 on weights of size ~1, by amounts that depend on
the CPU's kernels (elements near zero fail a purely relative 1e-5)."""


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 2 ranks (TP=2): every scenario of :data:`TWO`, then the refusals."""
    out = tmp_path_factory.mktemp("tp2")
    scenarios = {name: dict(s) for name, s in TWO.items()}
    scenarios["engine"]["save"] = {"dir": str(out / "ckpt"), "at": 3}
    scenarios["engine_resumed"]["load"] = str(out / "ckpt")
    scenarios["refusals"] = {"resharded": {"from": str(out / "ckpt"), "to": str(out / "resharded")}}
    results = launch.deepspeed_run(2, out, list(scenarios.values()), worker=launch.WORKERS / "tp_worker.py")
    return dict(zip(scenarios, results))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 4 ranks (TP=2 x DP=2)."""
    out = tmp_path_factory.mktemp("tp4")
    results = launch.deepspeed_run(4, out, list(FOUR.values()), worker=launch.WORKERS / "tp_worker.py")
    return dict(zip(FOUR, results))


@functools.cache
def reference(bias: bool, shards: int, dtype: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Final weights and every step's ``nu`` of the single-process reference, standalone K-FAC, same data."""
    model = w.Reference(bias, shards, w.DTYPES[dtype])
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR)
    kfac = ds_kfac.KFACPreconditioner(model, {**w.KFAC, "factor_dtype": dtype, "inv_dtype": dtype}, optimizer=optimizer)
    nus = []
    for step in range(w.STEPS):
        x, y = w.batch(step, w.DTYPES[dtype])
        optimizer.zero_grad()
        w.loss_fn(model(x), y).backward()
        kfac.step()
        optimizer.step()
        nus.append(kfac.last_nu.item())
    return model.full(), nus


def check(ranks: list[dict], scenario: dict[str, Any], tol: dict[str, float]) -> None:
    shards = 2 if scenario.get("mode") == "shard" else 1
    expected, nus = reference(scenario.get("bias", True), shards, scenario.get("dtype", "float64"))
    for r, result in enumerate(ranks):
        assert result["params"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, **tol, msg=lambda m: f"rank {r} {name}: {m}")
        torch.testing.assert_close(torch.tensor(result["nus"]), torch.tensor(nus), **tol)


@pytest.mark.parametrize("name", ["exact", "exact_no_bias", "exact_skip_bias_add", "shard"])
def test_tp2_equals_reference(two: dict[str, Any], name: str) -> None:
    """``exact``: the unsharded model's K-FAC; ``shard``: K-FAC per shard block (the row bias left to SGD)."""
    check(two[name], TWO[name], TOL)


def test_tp2_in_float32_equals_reference(two: dict[str, Any]) -> None:
    check(two["exact_float32"], TWO["exact_float32"], F32_TOL)


def test_tp2_engine_equals_the_standalone_preconditioner(two: dict[str, Any]) -> None:
    """Through ``ds_kfac.initialize(mpu=parallel_state)``: the standalone run's weights and ``nu`` (float32), bitwise."""
    for engine, standalone in zip(two["engine"], two["exact_float32"]):
        assert engine["nus"] == standalone["nus"]
        assert engine["params"].keys() == standalone["params"].keys()
        for name, value in standalone["params"].items():
            assert torch.equal(engine["params"][name], value), name


@pytest.mark.parametrize("name", list(FOUR))
def test_tp2_dp2_equals_reference(four: dict[str, Any], name: str) -> None:
    check(four[name], FOUR[name], F32_TOL)


def test_exact_owners_and_shard_blocks(two: dict[str, Any]) -> None:
    """``exact``: each tensor-parallel layer lives on one rank (balanced by cost), the replicated head on both."""
    assert [r["blocks"] for r in two["exact"]] == [["col", "head"], ["row", "head"]]
    assert [r["blocks"] for r in two["shard"]] == [["col", "row", "head"]] * 2


def test_nu_identical_on_every_rank(two: dict[str, Any], four: dict[str, Any]) -> None:
    for ranks in [*two.values(), *four.values()]:
        if "nus" in ranks[0]:
            assert all(r["nus"] == ranks[0]["nus"] for r in ranks)


def test_resume_is_bitwise(two: dict[str, Any]) -> None:
    full, resumed = two["engine"], two["engine_resumed"]
    for a, b in zip(full, resumed):
        assert b["nus"] == a["nus"][3:]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name


def tp_bytes(n: int, steps: int, bias: bool, t: int = 2, itemsize: int = 8) -> list[dict[str, int]]:
    """docs/megatron.md's formula, per rank: per step each layer's non-owners send their rows of the split side
    (``n x d/t``, column: ``d = out``, row: ``d = in``) and their gradient piece (column ``out/t x (in + b)``, row
    ``out x (in/t + b)``) to the owner, which sends each piece back. Owners here: column on rank 0, row on 1."""
    col_rows, row_rows = n * w.HIDDEN // t, n * w.HIDDEN // t
    col_piece, row_piece = w.HIDDEN // t * (w.IN + bias), w.OUT * (w.HIDDEN // t + bias)
    return [
        {"tp_gather": steps * itemsize * (row_rows + row_piece), "tp_scatter": steps * itemsize * col_piece},
        {"tp_gather": steps * itemsize * (col_rows + col_piece), "tp_scatter": steps * itemsize * row_piece},
    ]


@pytest.mark.parametrize("name", ["exact", "exact_no_bias", "shard"])
def test_tensor_parallel_bytes(two: dict[str, Any], name: str) -> None:
    bias = TWO[name].get("bias", True)
    expected = tp_bytes(w.BATCH, w.STEPS, bias) if name != "shard" else [{"tp_gather": 0, "tp_scatter": 0}] * 2
    assert [r["bytes"] for r in two[name]] == expected


def test_refusals(two: dict[str, Any]) -> None:
    errors = two["refusals"][0]
    assert "gather_output=True" in errors["gather_output"]
    assert "input_is_parallel=False" in errors["input_is_parallel"]
    assert "sequence_parallel=True" in errors["sequence_parallel"]
    assert "ZeRO stage 1 with Megatron tensor parallelism" in errors["zero1"]
    assert "another tensor-parallel size" in errors["resharded"] and "kfac_state_tp0of4.pt" in errors["resharded"]


def test_other_mpu_refused() -> None:
    from ds_kfac.integration.initialize import _refuse_mpu

    assert "supported: megatron.core.parallel_state" in _refuse_mpu(object(), 0)[0]
    assert _refuse_mpu(None, 0) == []


def test_import_does_not_load_megatron() -> None:
    import subprocess
    import sys

    code = "import sys, ds_kfac; from ds_kfac.layers import find_layers; print('megatron' in str(list(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
