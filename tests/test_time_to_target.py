"""benchmarks/time_to_target.py: the time-to-target arithmetic on synthetic curves, and its smoke mode."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import launch
import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("time_to_target", ROOT / "benchmarks/time_to_target.py")
ttt = importlib.util.module_from_spec(_spec)
sys.modules["time_to_target"] = ttt  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(ttt)


def test_crossing_interpolates_between_evaluations() -> None:
    curve = [(10.0, 1.0, 5.0), (20.0, 2.0, 3.0), (30.0, 3.5, 1.0)]
    # Lower is better: 4.0 lies halfway between the evaluations at steps 10 and 20.
    assert ttt.crossing(curve, 4.0, higher_is_better=False) == pytest.approx((15.0, 1.5))
    # 1.5 lies three quarters of the way from step 20 (3.0) to step 30 (1.0).
    assert ttt.crossing(curve, 1.5, higher_is_better=False) == pytest.approx((27.5, 3.125))
    # Reached at the first evaluation: that evaluation, no extrapolation towards step 0.
    assert ttt.crossing(curve, 6.0, higher_is_better=False) == (10.0, 1.0)
    assert ttt.crossing(curve, 0.5, higher_is_better=False) is None


def test_crossing_higher_is_better_and_first_crossing_only() -> None:
    curve = [(1.0, 0.1, 0.5), (2.0, 0.2, 0.9), (3.0, 0.3, 0.7), (4.0, 0.4, 0.95)]
    assert ttt.crossing(curve, 0.7, higher_is_better=True) == pytest.approx((1.5, 0.15))
    assert ttt.crossing(curve, 0.9, higher_is_better=True) == pytest.approx((2.0, 0.2))  # exactly on a point
    assert ttt.crossing(curve, 0.99, higher_is_better=True) is None


def test_summary_target_is_median_of_base_finals_and_ratios() -> None:
    base = [
        [(50.0, 10.0, 4.0), (100.0, 20.0, 3.0)],
        [(50.0, 11.0, 4.2), (100.0, 22.0, 3.2)],
        [(50.0, 9.0, 3.9), (100.0, 18.0, 2.8)],
    ]
    kfac = [
        [(50.0, 12.0, 3.0), (100.0, 24.0, 2.0)],  # reaches 3.0 at its first evaluation
        [(50.0, 12.0, 3.5), (100.0, 24.0, 2.5)],  # halfway: step 75, 18 s
        [(50.0, 12.0, 3.6), (100.0, 24.0, 3.1)],  # never reaches 3.0
    ]
    s = ttt.summarize(base, kfac, higher_is_better=False)
    assert s["target"] == 3.0
    assert s["base_steps"] == 100.0 and s["base_seconds"] == 20.0
    assert [r and (r["steps"], r["seconds"]) for r in s["kfac_reached"]] == [(50.0, 12.0), (75.0, 18.0), None]
    # Median over seeds with the miss counted as infinitely late: the middle value.
    assert s["kfac_steps"] == 75.0 and s["kfac_seconds"] == 18.0
    assert s["steps_ratio"] == pytest.approx(0.75) and s["seconds_ratio"] == pytest.approx(0.9)
    assert s["paired_seconds_ratios"] == [pytest.approx(12.0 / 20.0), pytest.approx(18.0 / 22.0), None]
    assert s["seconds_per_step_ratio"] == pytest.approx(24.0 / 20.0)
    # The base run's own crossing of the shared target (information only).
    assert s["base_own_crossing"][0] == {"steps": 100.0, "seconds": 20.0} and s["base_own_crossing"][1] is None
    assert "| K-FAC (to target) | | 75 | 18.0 | 0.75 | 0.90 (-) | 1.20 | 2/3 |" in ttt.table("t", "m", s)


def test_summary_when_most_runs_miss_is_never() -> None:
    base = [[(10.0, 1.0, 0.9)]] * 3
    kfac = [[(10.0, 1.0, 0.5)], [(10.0, 1.0, 0.95)], [(10.0, 1.0, 0.6)]]
    s = ttt.summarize(base, kfac, higher_is_better=True)
    assert s["kfac_steps"] is None and s["steps_ratio"] is None and s["seconds_ratio"] is None
    assert "never" in ttt.table("t", "m", s)
    with pytest.raises(ValueError, match="one non-empty"):
        ttt.summarize(base, kfac[:2], higher_is_better=True)


def test_overrides_and_curve_reading(tmp_path: Path) -> None:
    config = {"kfac": {"damping": 0.003}, "optimizer": {"params": {"lr": 0.1}}}
    out = ttt.apply_overrides(
        config, ["kfac.damping=0.01", "optimizer.params.lr=0.2", "kfac.grad_worker_fraction=mem-opt"]
    )
    assert out == {"kfac": {"damping": 0.01, "grad_worker_fraction": "mem-opt"}, "optimizer": {"params": {"lr": 0.2}}}
    assert config["kfac"]["damping"] == 0.003  # the input is not modified
    with pytest.raises(ValueError, match="KEY.PATH=VALUE"):
        ttt.apply_overrides(config, ["damping"])
    with pytest.raises(ValueError, match="no top-level key 'eigenvalue_correction'.*kfac.eigenvalue_correction"):
        ttt.apply_overrides(config, ["eigenvalue_correction=true"])  # DeepSpeed would ignore it: silently nothing
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,seconds,loss,held_out_accuracy\n1,0.5,2.0,\n2,1.0,1.5,0.6\n3,1.5,1.2,0.8\n")
    assert ttt.read_curve(csv, "held_out_accuracy") == [(2.0, 1.0, 0.6), (3.0, 1.5, 0.8)]
    with pytest.raises(ValueError, match="no column 'held_out_mlm_loss'"):
        ttt.read_curve(csv, "held_out_mlm_loss")


@pytest.mark.timeout(300)
def test_smoke_run_writes_the_documented_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both arms at a global batch of 64 (the configs' 1024 costs 16x the steps' time; nothing here depends on it), a
    few steps per run, the example trained on 2 preloaded ranks (:func:`launch.benchmark_launch`; the launcher itself:
    :func:`test_launch_runs_the_script_through_the_deepspeed_launcher`): the JSON carries settings, versions, curves
    and the summary."""
    monkeypatch.setattr(ttt, "launch", launch.benchmark_launch)
    args = ["run", "resnet", "--smoke", "--seeds", "0", "--out", str(tmp_path), "--timeout", "200"]
    for option in ("--set", "--set-base"):
        args += [option, "train_micro_batch_size_per_gpu=32", option, "gradient_accumulation_steps=1"]
    ttt.main(args)
    result = json.loads((tmp_path / "resnet.json").read_text())
    assert set(result) == {"task", "command", "settings", "configs", "versions", "runs", "summary"}
    assert result["settings"]["seeds"] == [0] and result["settings"]["world"] == 2
    assert {"torch", "deepspeed", "ds_kfac_commit"} <= set(result["versions"])
    assert [(r["arm"], r["seed"]) for r in result["runs"]] == [("base", 0), ("kfac", 0)]
    for run in result["runs"]:
        assert [point[0] for point in run["curve"]] == [2.0, 4.0]  # --eval-every 2 of --steps 4
        assert all(0.0 <= point[2] <= 1.0 and point[1] > 0 for point in run["curve"])
    summary = result["summary"]
    assert summary["target"] == result["runs"][0]["curve"][-1][2]
    assert summary["base_steps"] == 4.0 and math.isfinite(summary["seconds_per_step_ratio"])
    assert (tmp_path / "resnet.png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_launch_runs_the_script_through_the_deepspeed_launcher(tmp_path: Path) -> None:
    """``launch`` itself: the real ``deepspeed --num_gpus 2`` starts 2 ranks of the task's script with the run's
    arguments, the launcher's variables, one thread and unbuffered output, into the run's log; a rank that fails
    fails the run, naming its exit code and log (the ranks: ``workers/launcher_probe.py``, no torch)."""
    task = ttt.Task(str(launch.WORKERS / "launcher_probe.py"), "", "", "held_out_accuracy", True, ())
    config = tmp_path / "config.json"
    config.write_text("{}")
    ttt.launch(task, config, 7, tmp_path, "probe", ["--eval-every", "2"], timeout=100)
    reports = [json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["args"] == {
            "deepspeed_config": str(config), "output_dir": str(tmp_path), "run_name": "probe",
            "seed": 7, "local_rank": rank, "exit": 0,
        }  # fmt: skip
        assert report["extra"] == ["--eval-every", "2"]
        env = report["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (env["OMP_NUM_THREADS"], env["PYTHONUNBUFFERED"]) == ("1", "1")
    assert reports[0]["env"]["MASTER_PORT"] == reports[1]["env"]["MASTER_PORT"]
    log = (tmp_path / "probe.log").read_text()
    assert "rank 0 of 2 started" in log and "rank 1 of 2 started" in log
    failed = rf"run failing failed with exit code \d+; see {re.escape(str(tmp_path / 'failing.log'))}"
    with pytest.raises(RuntimeError, match=failed):
        ttt.launch(task, config, 7, tmp_path, "failing", ["--exit", "3"], timeout=100)


def test_compare_two_finished_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `make demo` prints: the K-FAC run's time to the base run's final held-out loss, and the plot."""
    header = "step,samples,seconds,loss,lr,held_out_mlm_loss,held_out_mlm_accuracy\n"
    for name, rows in {
        "lamb": ["10,0,1.0,0,0,6.0,0", "20,0,2.0,0,0,5.0,0", "30,0,3.0,0,0,4.5,0"],
        "kfac": ["10,0,1.5,0,0,5.5,0", "20,0,3.0,0,0,4.5,0", "30,0,4.5,0,0,4.0,0"],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text(header + "\n".join(rows) + "\n")
    summary = ttt.compare_runs(tmp_path / "lamb", tmp_path / "kfac", "held_out_mlm_loss", higher_is_better=False)
    assert summary["target"] == 4.5 and summary["kfac_steps"] == 20.0 and summary["kfac_seconds"] == 3.0
    out = capsys.readouterr().out
    assert "| K-FAC (to target) | | 20 | 3.0 | 0.67 | 1.00 (1.00-1.00) | 1.50 | 1/1 |" in out
    assert (tmp_path / "time_to_target.png").stat().st_size > 0


def test_table_of_the_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/README.md's time-to-target rows come from benchmarks/results/*.json: each has 3+ seeds and
    its command."""
    results = sorted((ROOT / "benchmarks/results").glob("*.json"))
    paths = [p for p in results if "summary" in json.loads(p.read_text())]  # time_to_target.py's results
    assert {p.stem for p in paths} >= {"bert", "resnet"}
    ttt.main(["table", *map(str, paths)])
    out = capsys.readouterr().out
    for path in paths:
        result = json.loads(path.read_text())
        assert len(result["settings"]["seeds"]) >= 3 and result["command"] in out
        base = [r["curve"] for r in result["runs"] if r["arm"] == "base"]
        kfac = [r["curve"] for r in result["runs"] if r["arm"] == "kfac"]
        # The stored summary is what the stored curves give.
        assert ttt.summarize(base, kfac, result["settings"]["higher_is_better"]) == result["summary"]
