"""benchmarks/batch_scaling.py: the ladder's shapes and best-point arithmetic on synthetic runs, and its smoke mode."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("batch_scaling", ROOT / "benchmarks/batch_scaling.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["batch_scaling"] = bs  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(bs)


def test_batch_shapes_grow_by_accumulation_beyond_the_largest_micro_batch() -> None:
    assert bs.shape(64, 128) == (32, 1)
    assert bs.shape(4096, 128) == (128, 16)
    with pytest.raises(ValueError, match="not a multiple of the micro-batch"):
        bs.shape(2 * 200, 128)
    config = bs.configure(
        json.loads((ROOT / "configs/resnet_sgd_cpu.json").read_text()), bs.LADDERS["resnet"], 1024, 0.3, 50
    )
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (128, 4)
    assert config["optimizer"]["params"]["lr"] == config["scheduler"]["params"]["warmup_max_lr"] == 0.3
    assert config["resnet"]["steps"] == config["scheduler"]["params"]["total_num_steps"] == 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 4  # 8% of the budget


def _run(arm: str, batch: int, lr: float, seed: int, steps: float | None) -> dict:
    return {
        "arm": arm,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "to_target": steps and {"steps": steps, "seconds": steps / 10},
    }


def test_best_points_pick_each_arms_fastest_learning_rate_and_take_medians_over_its_seeds() -> None:
    runs = [
        _run("base", 256, 0.1, 0, 80.0),
        _run("base", 256, 0.2, 0, 60.0),
        _run("kfac", 256, 0.1, 0, None),
        _run("kfac", 256, 0.2, 0, 30.0),
        _run("base", 256, 0.2, 1, 70.0),
        _run("base", 256, 0.2, 2, 64.0),
        _run("kfac", 256, 0.2, 1, 36.0),
        _run("kfac", 256, 0.2, 2, None),  # a seed that never reached it counts as infinitely late
        _run("base", 1024, 0.2, 0, None),
        _run("kfac", 1024, 0.2, 0, 20.0),
    ]
    best = bs.best_points(runs)
    assert (
        best["base"]["256"]["lr"] == 0.2 and best["base"]["256"]["steps"] == 64.0 and best["base"]["256"]["seeds"] == 3
    )
    assert best["kfac"]["256"]["steps"] == 36.0 and best["kfac"]["256"]["steps_per_seed"] == [30.0, 36.0, None]
    assert best["base"]["1024"] == {"lr": None, "steps": None, "seconds": None, "seeds": 0}
    ratios = bs.ratios(best)
    assert ratios["256"]["steps"] == pytest.approx(36 / 64) and ratios["1024"] == {"steps": None, "seconds": None}
    result = {"task": "resnet", "best": best, "ratios": ratios}
    assert "| 256 (128 x 1 x 2) | 0.2 | 64 | 6.4 | 0.2 | 36 | 3.6 | 0.56 | 0.56 | 3 |" in bs.table(result)


def smoke_command(out: Path) -> list[str]:
    """The smoke run at one batch (tests/conftest.py's ``resnet_smoke`` runs it beside test_time_to_target's)."""
    cmd = [sys.executable, str(ROOT / "benchmarks/batch_scaling.py"), "run", "resnet", "--smoke", "--batches", "64"]
    cmd += ["--lrs", "0.1", "--steps", "4", "--evaluations", "2", "--target", "0.0", "--out", str(out)]
    return cmd + ["--timeout", "200"]


@pytest.mark.timeout(300)
def test_smoke_run_writes_the_documented_json(resnet_smoke: dict[str, Path]) -> None:
    """The real launcher path at one batch, a few steps per run (:func:`smoke_command`): the JSON carries every curve
    and the best points."""
    tmp_path = resnet_smoke[__name__]
    result = json.loads((tmp_path / "batch_scaling_resnet.json").read_text())
    assert set(result) == {"task", "command", "settings", "versions", "runs", "best", "ratios"}
    assert [(r["arm"], r["batch"], r["lr"], r["steps"]) for r in result["runs"]] == [
        ("base", 64, 0.1, 4),
        ("kfac", 64, 0.1, 4),
    ]
    for run in result["runs"]:
        assert [point[0] for point in run["curve"]] == [2.0, 4.0]
        assert run["to_target"] == {"steps": 2.0, "seconds": run["curve"][0][1]}  # target 0: the first evaluation
    assert result["ratios"]["64"]["steps"] == 1.0
    assert (tmp_path / "batch_scaling_resnet.png").stat().st_size > 0


def test_merge_joins_runs_and_recomputes_the_best_points(tmp_path: Path) -> None:
    """Ladders run in parts (a grid per batch) merge into one result; parts that disagree, or overlap, are refused."""

    def part(name: str, runs: list, target: float = 0.9) -> Path:
        settings = {"metric": "held_out_accuracy", "target": target, "world": 2, "samples": 1000, "steps": None}
        result = {"task": "resnet", "command": f"run {name}", "settings": settings, "versions": {}, "runs": runs}
        (tmp_path / name).write_text(json.dumps(result))
        return tmp_path / name

    small = part("a.json", [_run("base", 256, 0.1, 0, 80.0), _run("kfac", 256, 0.1, 0, 40.0)])
    large = part("b.json", [_run("base", 1024, 0.4, 0, 30.0), _run("kfac", 1024, 0.4, 0, 24.0)])
    merged = bs.merge([small, large], tmp_path / "m.json")
    assert merged["command"] == ["run a.json", "run b.json"]
    assert merged["settings"]["batches"] == [256, 1024] and merged["settings"]["lrs"]["base"] == [0.1, 0.4]
    assert merged["ratios"]["256"] == {"steps": 0.5, "seconds": 0.5}
    assert merged["ratios"]["1024"] == {"steps": pytest.approx(0.8), "seconds": pytest.approx(0.8)}
    assert json.loads((tmp_path / "m.json").read_text())["best"] == merged["best"]
    assert (tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="target 0.95 differs"):
        bs.merge([small, part("c.json", [], target=0.95)], tmp_path / "x.json")
    with pytest.raises(SystemExit, match="present twice"):
        bs.merge([small, small], tmp_path / "x.json")
