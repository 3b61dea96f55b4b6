"""benchmarks/gpu/ (issue 38) cannot rot: every check of run.py dry-runs on the CPU at toy sizes, cheaply.

The checks that train run in this process (fp16 as bf16, lamb); the one that runs pytest runs one case of it; the
long ones (step-cost, bert) are checked as commands: every ``step_cost.py`` invocation parses, with its K-FAC
section, and every BERT config and ``pretrain.py`` command line parses (the examples' and step_cost's own tests run
them at smoke sizes).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "gpu"), str(ROOT / "examples" / "bert")]
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


def test_bert_plan_parses(tmp_path: Path) -> None:
    """Phase 1, AdamW, ds_kfac's config and a peer: configs that K-FAC and the model accept, commands pretrain.py
    parses, one rank, phase 2 from phase 1's run."""
    import pretrain

    peer = "configs/bert_cpu_phase2_kfac.json"  # a stand-in for the lead's peer configs
    for tiny in (False, True):
        args = argparse.Namespace(
            device="cuda", tiny=tiny, peer_config=[peer], phase1_steps=600, phase2_steps=150, timeout=1.0
        )
        plan = bundle.bert_plan(args, tmp_path / str(tiny))
        assert list(plan["commands"]) == ["phase1", "base", "kfac", Path(peer).stem]
        for name, cmd in plan["commands"].items():
            assert cmd[1:3] == ["--num_gpus", "1"]
            parsed = pretrain.parse_args(cmd[cmd.index(str(ROOT / "examples/bert/pretrain.py")) + 1 :])
            assert (parsed.init_checkpoint is None) == (name == "phase1")
            config = json.loads(Path(plan["configs"][name]).read_text())
            assert (ROOT / config["bert"]["model"]).is_file()
            if "kfac" in config:
                KFACConfig.parse(config["kfac"])
        if not tiny:
            assert config["bert"]["max_seq_length"] == 128 and config["bert"]["max_steps"] == 150


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
