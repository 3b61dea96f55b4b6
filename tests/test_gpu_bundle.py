"""benchmarks/gpu/ (issue 38) cannot rot: every check of run.py dry-runs on the CPU at toy sizes, cheaply.

The checks that train run in this process (fp16 as bf16, lamb, bert's dry run: BERT-tiny, one batch); the one that
runs pytest runs one case of it; step-cost is checked as commands: every ``step_cost.py`` invocation parses, with its
K-FAC section (step_cost's own tests run it at smoke sizes). The bert check's default plan is checked as configs and
predicted seconds, its logic on synthetic curves.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "gpu"), str(ROOT / "examples" / "bert")]
import convergence  # noqa: E402  (benchmarks/gpu/convergence.py)
import run as bundle  # noqa: E402  (benchmarks/gpu/run.py)
import step_cost  # noqa: E402

from ds_kfac import KFACConfig  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_tests_check_runs_pytest_and_summarizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One conventions case, on the CPU (test_deepspeed.py's fp16 tests, which skip here, would only add its imports)."""
    assert (ROOT / bundle.TESTS[0].split("::")[0]).is_file()
    conventions = "tests/test_conventions_cuda.py::test_float32_step_on_device_is_minus_preconditioned_gradient"
    monkeypatch.setattr(bundle, "TESTS", [f"{conventions}[linear_bias-eigen]"])
    result = bundle.check_tests(argparse.Namespace(device="cpu", timeout=100.0))
    assert result["passed"], result["output_tail"]
    assert result["counts"] == {"passed": 1, "failure": 0, "error": 0, "skipped": 0}


def test_fp16_check_in_process(one_rank: None) -> None:
    """The fp16 check's scenarios (bf16 on the CPU, ZeRO 1) through ds_worker in this process, then its verdict."""
    import ds_worker

    import ds_kfac

    ds_kfac.init_distributed()
    scenarios = bundle.fp16_scenarios("cpu", tiny=True)
    report = bundle.fp16_verdict({name: [ds_worker.run(s)] for name, s in scenarios.items()}, "bf16")
    assert report["passed"], report
    assert set(bundle.fp16_scenarios("cuda", tiny=False)) == {f"{n[:-3]}_s{s}" for n in scenarios for s in (1, 2)}
    assert bundle.fp16_scenarios("cuda", tiny=False)["low_s2"]["ds"]["fp16"]["enabled"]


def test_lamb_check_in_process(one_rank: None) -> None:
    result = bundle.lamb_engines("cpu")
    assert result["passed"] and result["kfac_on"] and result["resolved"] == "Lamb"
    assert len(result["max_abs_difference_per_step"]) == bundle.LAMB_STEPS


@pytest.mark.parametrize("device, tiny", [("cuda", False), ("cpu", True)])
def test_step_cost_invocations_parse(device: str, tiny: bool) -> None:
    parser = step_cost.build_parser()
    for argv in bundle.step_cost_runs(device, tiny, 60.0).values():
        args = parser.parse_args([*argv, "--out", "unused.json"])
        assert args.workloads == ["bert-base"] and args.device == device
        section = step_cost.kfac_section("bert-base", args.smoke, args.set, "comm-opt")
        KFACConfig.parse(section)
    optimizer = step_cost.WORKLOADS["bert-base"].optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(optimizer).__name__ == "Lamb"  # FusedLamb needs CUDA parameters


def test_step_cost_targets() -> None:
    """Issue 45's limits by run name: the shipped method 1.15x (float32, TF32), 1.25x in bf16, at GA 8 only."""
    assert bundle._ratio_target("shipped_ga8", 8, 1.14) is True
    assert bundle._ratio_target("shipped_tf32_ga8", 8, 1.16) is False
    assert bundle._ratio_target("shipped_bf16_ga8", 8, 1.24) is True
    assert bundle._ratio_target("shipped_bf16_ga8", 8, 1.26) is False
    assert bundle._ratio_target("shipped_ga8", 32, 2.0) is None and bundle._ratio_target("inverse_ga8", 8, 2.0) is None
    assert bundle._slowest_target("shipped_bf16_ga8", 1.6) is False and bundle._slowest_target("plain_ga8", 9) is None


def test_linalg_check_dry_run() -> None:
    """The refresh microbenchmark at toy widths: every method runs; the warm updates (Householder and Cholesky-QR2)
    give one basis, orthonormal, whose drift is below the drifted basis' (one subspace step), and eigh's residual
    is at rounding."""
    import linalg

    result = bundle.CHECKS["linalg"](argparse.Namespace(device="cpu", tiny=True))
    assert result["passed"] and [row["width"] for row in result["widths"]] == list(linalg.TINY_WIDTHS)
    for row in result["widths"]:
        house, chol = row["subspace_householder"], row["subspace_cholesky_qr2"]
        assert abs(row["drift_before"] - linalg.DRIFT) < 0.05
        assert house["residual"] < 0.75 * row["drift_before"] and abs(chol["residual"] - house["residual"]) < 1e-5
        assert chol["orthogonality"] < 1e-5 and row["eigh_fp32"]["residual"] < 1e-5
        assert row["eigh_fp64"]["residual"] < 1e-12 and row["matmul_tf32"]["ms"] > 0
    factor = linalg.spd_factor(16, torch.Generator().manual_seed(1), torch.device("cpu"))
    basis = linalg.drifted_basis(factor, torch.Generator().manual_seed(2))
    q_house, _ = linalg.subspace_step(*linalg.basis_drift(factor, basis)[:2])
    q_chol, _ = linalg.subspace_cholesky(factor, basis)
    torch.testing.assert_close(q_chol, q_house, atol=1e-4, rtol=0)


def test_hooks_check_dry_run() -> None:
    """BERT-mini's smoke model (bert-tiny, 2 encoder layers) with K-FAC's hooks and without: 3 timed rounds each,
    the 6 Linears of each layer registered (the shipped phase-1 section skips the heads and the pooler)."""
    result = bundle.CHECKS["hooks"](argparse.Namespace(device="cpu", tiny=True))
    assert result["passed"] and result["workload"] == "bert-mini"
    assert [len(t) for t in result["times_ms"].values()] == [3, 3]
    assert result["registered_layers"] == 2 * 6
    assert result["added_ms"]["per_layer"] == pytest.approx(
        result["added_ms"]["per_micro_batch"] / result["registered_layers"]
    )


@pytest.mark.timeout(240)  # about 15 s of CPU; more on a machine that is busy
def test_bert_check_dry_run(one_rank: None, tmp_path: Path) -> None:
    """The ``bert`` check's dry run in this process (``--device cpu --tiny``: BERT-tiny, batch 16): phase 1, then
    per arm a 3-rate grid stopped after 2 of 6 steps and the best continued, in bf16; the JSON written."""
    code = bundle.main(["--check", "bert", "--device", "cpu", "--tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bert.json").read_text())
    assert code == 0 and result["passed"], (result["errors"], result["skipped"])
    assert result["plan"]["items"] == ["tiny:16"] and not result["skipped"]
    phase1 = result["phase1"]["tiny"]
    assert phase1["steps"] == 4 and phase1["config"]["client_optimizer"]["class"] == "ds_kfac.Lamb"
    assert 5.0 < phase1["plateau"]["unigram_entropy"] < math.log(1024)
    (item,) = result["items"]
    assert item["steps"] == 6 and item["grid_steps"] == 2 and item["complete"]
    for arm in convergence.ARMS:
        grid, run = item["grids"][arm], item["runs"][arm]
        assert len(grid["scores"]) == 3 and grid["rate"] == run["rate"] and str(run["rate"]) in grid["scores"]
        assert [int(step) for step, _, _ in run["curve"]] == list(range(1, 7))  # the grid's 2 steps, resumed to 6
        assert run["config"]["bf16"]["enabled"] and run["seconds_per_step"] > 0
    ratios = item["summary"]["ratios"]
    assert set(ratios) == {"kfac/adamw", "kfac/soap", "kfac/soap at SOAP's final"}
    assert set(result["fixed_target"]["tiny"]["to_target"]) == set(convergence.ARMS)
    assert "| tiny:16 | kfac |" in result["table"]


def test_bert_plan_and_budget() -> None:
    """The default plan: its schedules, grids and predicted seconds (inside one 10-minute call); every arm's config
    as ds_kfac takes it."""
    from ds_kfac.integration.optimizer_setup import refuse_muon

    plan = convergence.parse_plan(convergence.PLAN)
    assert plan == [("4x512", 256), ("4x512", 1024), ("4x512", 4096), ("12x768", 1024)]
    small, base = convergence.SIZES["4x512"], convergence.SIZES["12x768"]
    assert [convergence.schedule(small, b) for b in (256, 1024, 4096)] == [(96, 16, 32), (48, 8, 16), (24, 4, 8)]
    assert convergence.schedule(base, 1024) == (32, 5, 10)
    assert convergence.centre_rate(512, 256) == pytest.approx(0.002)
    assert convergence.centre_rate(512, 4096) == pytest.approx(0.008)
    expected = convergence.plan_seconds(plan)
    assert expected["parts"] == {"4x512 phase 1": 124, "4x512:256": 61, "4x512:1024": 85, "4x512:4096": 134,
                                 "12x768 phase 1": 44, "12x768:1024": 77}  # fmt: skip
    assert expected["total"] == 526 <= 540
    phase1 = convergence.phase1_config(small, 1200, 0.02, 75)
    assert phase1["bert"]["warmup_proportion"] == 0.0625 and phase1["train_micro_batch_size_per_gpu"] == 256
    for arm in convergence.ARMS:
        config = convergence.arm_config(arm, base, 1024, 0.001)
        assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] == 1024
        assert config["bert"]["max_steps"] == 32 and config["bert"]["eval_every"] == 5 and config["bf16"]["enabled"]
        assert (config.get("optimizer") or config["client_optimizer"])["params"]["lr"] == 0.001
        refuse_muon(config, KFACConfig.parse(config.get("kfac")))
        if "kfac" in config:
            assert KFACConfig.parse(config["kfac"]).eigenbasis_max_dim == 769  # every hidden-wide side
    shipped = json.loads((ROOT / "configs/bert_cpu_phase2_kfac.json").read_text())
    with pytest.raises(Exception, match="Muon"):
        refuse_muon(
            {**shipped, "bf16": {"enabled": True}}, KFACConfig.parse(shipped["kfac"])
        )  # why ds_kfac's arm takes AdamW for the rest
    with pytest.raises(ValueError, match="SIZE:BATCH"):
        convergence.parse_plan(["4x512"])


def test_bert_rates_and_ratios() -> None:
    """The pure logic: the grid's choice, rates moved across widths, the unigram entropy, the plateau verdict, the
    ratios at AdamW's final and the fixed target over batches, on synthetic curves."""
    assert convergence.choose_rate({0.001: 4.0, 0.002: 3.5, 0.004: 3.7}) == {"rate": 0.002, "closed": True}
    assert convergence.choose_rate({0.001: 4.0, 0.002: None, 0.004: float("nan")}) == {"rate": 0.001, "closed": False}
    assert convergence.choose_rate({0.001: None}) == {"rate": None, "closed": False}
    assert convergence.transferred_rates({"adamw": 0.003}, 512, 768) == {"adamw": pytest.approx(0.002)}
    assert convergence.unigram_entropy([[1, 1], [2, 3]]) == pytest.approx(1.5 * math.log(2))
    assert convergence.plateau(5.0, 6.4)["left"] and not convergence.plateau(5.6, 6.4)["left"]
    # step, training seconds, held-out loss: AdamW ends at 4.0 in 100 steps (1 s a step); ds_kfac reaches 4.0 at step
    # 50 (1.2 s a step), SOAP at step 80 (1.1 s a step) and ends at 3.9, which ds_kfac reaches at step 70.
    curves = {
        "adamw": [(50, 50.0, 4.5), (100, 100.0, 4.0)],
        "soap": [(40, 44.0, 4.4), (80, 88.0, 4.0), (100, 110.0, 3.9)],
        "kfac": [(50, 60.0, 4.0), (70, 84.0, 3.9), (100, 120.0, 3.5)],
    }
    summary = convergence.item_summary(curves)
    assert summary["target"] == 4.0
    ratios = summary["ratios"]
    assert ratios["kfac/adamw"] == {"steps": 0.5, "seconds": 0.6}
    assert ratios["kfac/soap"] == {"steps": pytest.approx(50 / 80), "seconds": pytest.approx(60 / 88)}
    assert ratios["kfac/soap at SOAP's final"] == {"steps": 0.7, "seconds": pytest.approx(84 / 110)}
    larger = {"adamw": [(25, 50.0, 4.2)], "kfac": [(10, 20.0, 4.4), (20, 40.0, 4.0)]}
    fixed = convergence.fixed_target({256: curves, 4096: larger})
    assert fixed["target"] == 4.2 and fixed["to_target"]["adamw"][4096] == {"steps": 25, "seconds": 50.0}
    assert fixed["to_target"]["kfac"][4096] == {"steps": pytest.approx(15.0), "seconds": pytest.approx(30.0)}
    assert fixed["to_target"]["adamw"][256] == {"steps": pytest.approx(80.0), "seconds": pytest.approx(80.0)}


def test_time_limit_stops_a_run_and_restores_the_timer() -> None:
    signal.setitimer(signal.ITIMER_REAL, 60.0)  # as pytest-timeout's
    try:
        with pytest.raises(convergence.RunTimeout), convergence.time_limit(0.05):
            time.sleep(1.0)
        assert 58.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_scripts_are_valid_bash_and_name_real_checks() -> None:
    for script in ("fetch_wheels.sh", "install.sh", "run_all.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu" / script)], check=True)
    text = (ROOT / "benchmarks/gpu/run_all.sh").read_text()
    named = {line.split()[2] for line in text.splitlines() if line.strip().startswith("check ") and "()" not in line}
    assert named == set(bundle.CHECKS)


def test_arch_list_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--arch-list``: lamb runs with TORCH_CUDA_ARCH_LIST unset and set to the GPU's capability (issue 45)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert bundle.set_arch_list(None) == "9.0a"  # as the environment has it
    assert bundle.set_arch_list("unset") is None and "TORCH_CUDA_ARCH_LIST" not in bundle.os.environ
    assert bundle.set_arch_list("device") is None  # no GPU here: left unset
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert bundle.set_arch_list("device") == "9.0" == bundle.os.environ["TORCH_CUDA_ARCH_LIST"]
    assert bundle.build_parser().parse_args(["--check", "lamb", "--arch-list", "device"]).arch_list == "device"
    text = (ROOT / "benchmarks/gpu/run_all.sh").read_text()
    parts = re.split(r"\n  (?=\S)", text.split("case $PART in")[1])  # 1), all), 3), 2): lamb both ways or not at all
    assert sum(" lamb " in part for part in parts) == 3
    for part in parts:
        assert (" lamb " in part) == ("lamb --arch-list unset" in part) == ("lamb --arch-list device" in part), part
