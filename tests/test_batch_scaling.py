"""benchmarks/batch_scaling.py (its ladders in batch_ladders.py, its scoring in batch_results.py): the ladder's
shapes and best-point arithmetic on synthetic runs, variants of an arm, and its smoke mode."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Optional

import launch
import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("batch_scaling", ROOT / "benchmarks/batch_scaling.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["batch_scaling"] = bs  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(bs)
import batch_ladders as bl  # noqa: E402  (on the path batch_scaling put it on)
import batch_results as br  # noqa: E402


def test_batch_shapes_grow_by_accumulation_beyond_the_largest_micro_batch() -> None:
    assert bl.shape(64, 128) == (32, 1)
    assert bl.shape(4096, 128) == (128, 16)
    with pytest.raises(ValueError, match="not a multiple of the micro-batch"):
        bl.shape(2 * 200, 128)
    config = bl.configure(
        json.loads((ROOT / "configs/resnet_sgd_cpu.json").read_text()), bl.LADDERS["resnet"], "base", 1024, 0.3, 50
    )
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (128, 4)
    assert config["optimizer"]["params"]["lr"] == config["scheduler"]["params"]["warmup_max_lr"] == 0.3
    assert config["resnet"]["steps"] == config["scheduler"]["params"]["total_num_steps"] == 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 4  # 8% of the budget


def test_peer_ladders_set_each_arms_own_rate_and_budgets_in_steps() -> None:
    """BERT phase 2: each arm's rate at its own key (ds_kfac's Adam rate, Muon's for the matrices K-FAC leaves kept;
    DeepSpeed's Muon's muon_lr, its Adam half's kept), the batch by accumulation past 32 per rank, the budget in steps
    per batch, the size's target, and phase 1 as the BERT ladder's (the demo's LAMB phase 1); ResNet's SOAP at both
    of its rate keys."""
    ladder = bl.LADDERS["bert-phase2"]
    assert list(ladder.arms) == ["adamw", "soap", "muon", "kfac"] and ladder.reference == "adamw"
    rates = {"adamw": ("optimizer", "lr"), "soap": ("client_optimizer", "lr"), "kfac": ("optimizer", "adam_lr")}
    rates["muon"] = ("optimizer", "muon_lr")  # DeepSpeed's JSON Muon: its rate for the hidden matrices
    for arm, (section, key) in rates.items():
        base = json.loads((ROOT / ladder.arms[arm].config).read_text())
        config = bl.configure(base, ladder, arm, 2048, 0.016, 50)
        assert config[section]["params"][key] == 0.016
        assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (32, 32)
        assert config["bert"]["max_steps"] == 50
        rest = {k: v for k, v in config[section]["params"].items() if k != key}
        assert rest == {k: v for k, v in base[section]["params"].items() if k != key}  # muon_lr among them
    assert [bl.budget(ladder, b, ladder.samples, None) for b in (256, 1024, 2048, 512)] == [150, 75, 50, 75]
    assert bl.budget(ladder, 2048, ladder.samples, 20) == 20  # --steps wins
    assert bl.budget(ladder, 2048, ladder.samples, None, bl.parse_budgets(["2048=80"])) == 80  # then --budget
    with pytest.raises(SystemExit, match="'2048=0'.*BATCH=STEPS"):
        bl.parse_budgets(["2048=0"])
    assert bl.budget(bl.LADDERS["resnet"], 1024, 122_880, None) == 120  # samples / batch where no budgets
    assert ladder.targets["2x128"] == 4.3 and set(ladder.targets) <= set(bs.sizes.SIZES)
    assert bl.LADDERS["bert"].task.base_config == "configs/bert_cpu_phase1_lamb.json"  # phase 1 from scratch
    resnet = bl.LADDERS["resnet-peers"]
    soap = bl.configure(json.loads((ROOT / resnet.arms["soap"].config).read_text()), resnet, "soap", 4096, 0.2, 60)
    assert soap["client_optimizer"]["params"]["lr"] == soap["scheduler"]["params"]["warmup_max_lr"] == 0.2
    assert (soap["train_micro_batch_size_per_gpu"], soap["gradient_accumulation_steps"]) == (128, 16)
    assert soap["resnet"]["steps"] == soap["scheduler"]["params"]["total_num_steps"] == 60
    assert bl.budget(resnet, 4096, resnet.samples, None) == 60 and list(resnet.arms) == ["sgd", "soap", "kfac"]


def test_grids_and_overrides_name_the_arm_they_do_not_know() -> None:
    ladder = bl.LADDERS["bert-phase2"]
    args = bs.argparse.Namespace(arms=None, lrs=[0.004], kfac_lrs=None, arm_lrs=["soap=0.002,0.004"], set=["a=1"])
    args.set_base, args.set_arm = ["b=2"], ["soap:c=3"]
    assert bs._grids(ladder, args) == {"adamw": [0.004], "soap": [0.002, 0.004], "muon": [0.004], "kfac": [0.004]}
    assert bs._sets(ladder, args) == {"adamw": ["b=2"], "soap": ["c=3"], "muon": [], "kfac": ["a=1"]}
    with pytest.raises(SystemExit, match="'sgd=0.1'.*adamw"):
        bs._grids(ladder, bs.argparse.Namespace(arms=None, lrs=None, kfac_lrs=None, arm_lrs=["sgd=0.1"]))
    with pytest.raises(ValueError, match="--set-arm expects ARM:KEY=JSON .*got 'soap=1'"):
        bs._sets(ladder, bs.argparse.Namespace(arms=None, set=[], set_base=[], set_arm=["soap=1"]))


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
    best = br.best_points(runs)
    assert (
        best["base"]["256"]["lr"] == 0.2 and best["base"]["256"]["steps"] == 64.0 and best["base"]["256"]["seeds"] == 3
    )
    assert best["kfac"]["256"]["steps"] == 36.0 and best["kfac"]["256"]["steps_per_seed"] == [30.0, 36.0, None]
    assert best["base"]["1024"] == {"lr": None, "steps": None, "seconds": None, "seeds": 0}
    ratios = br.ratios(best)
    assert ratios["256"]["steps"] == pytest.approx(36 / 64) and ratios["1024"] == {"steps": None, "seconds": None}
    result = {"task": "resnet", "best": best, "ratios": ratios}
    assert "| 256 (128 x 1 x 2) | 0.2 | 64 | 6.4 | 0.2 | 36 | 3.6 | 0.56 | 0.56 | 3 |" in br.table(result)


def test_three_arms_report_kfac_against_the_reference_and_the_best_other_arm() -> None:
    """With peers, each batch's best other arm may change: K-FAC is divided by the reference (AdamW) and by whichever
    other arm reached the target in the fewest steps there."""
    runs = [
        _run("adamw", 256, 0.008, 0, 100.0),
        _run("soap", 256, 0.008, 0, 80.0),
        _run("kfac", 256, 0.008, 0, 60.0),
        _run("adamw", 2048, 0.016, 0, 30.0),
        _run("soap", 2048, 0.016, 0, None),
        _run("kfac", 2048, 0.016, 0, 12.0),
    ]
    summary = br.summary(br.best_points(runs, ["adamw", "soap", "kfac"]))
    assert summary["ratios"]["256"]["steps"] == pytest.approx(0.6)
    assert summary["ratios"]["2048"]["steps"] == pytest.approx(0.4)
    assert summary["peer_ratios"]["256"] == {"peer": "soap", "steps": 0.75, "seconds": 0.75}
    assert summary["peer_ratios"]["2048"]["peer"] == "adamw"  # SOAP never reached it at 2048
    text = br.table({"task": "bert-phase2", **summary})
    assert "| K-FAC/adamw steps | K-FAC/adamw wall | K-FAC/best other steps |" in text
    row = "| 2048 (32 x 32 x 2) | 0.016 | 30 | 3.0 | never | never | never | 0.016 | 12 | 1.2 | 0.40 | 0.40 | 0.40 | 0.40 | adamw | 1 |"
    assert row in text
    assert "bert-phase2" not in text and "peer_ratios" not in br.summary(br.best_points(runs[:1] + runs[2:3]))


@pytest.mark.timeout(300)
def test_smoke_run_writes_the_documented_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ladder at one batch, a few steps per run, the example trained on 2 preloaded ranks
    (:func:`launch.benchmark_launch`): the JSON carries every curve and the best points."""
    monkeypatch.setattr(bs, "launch", launch.benchmark_launch)
    args = ["run", "resnet", "--smoke", "--batches", "64", "--lrs", "0.1", "--steps", "4", "--evaluations", "2"]
    bs.main([*args, "--target", "0.0", "--out", str(tmp_path), "--timeout", "200"])
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

    def part(name: str, runs: list, target: float = 0.9, budgets: Optional[dict] = None) -> Path:
        settings = {"metric": "held_out_accuracy", "target": target, "world": 2, "samples": 1000, "steps": None}
        settings["budgets"] = budgets or {str(b): 100 for b in sorted({r["batch"] for r in runs})}
        result = {"task": "resnet", "command": f"run {name}", "settings": settings, "versions": {}, "runs": runs}
        (tmp_path / name).write_text(json.dumps(result))
        return tmp_path / name

    small = part("a.json", [_run("base", 256, 0.1, 0, 80.0), _run("kfac", 256, 0.1, 0, 40.0)])
    large = part("b.json", [_run("base", 1024, 0.4, 0, 30.0), _run("kfac", 1024, 0.4, 0, 24.0)])
    merged = br.merge([small, large], tmp_path / "m.json")
    assert merged["command"] == ["run a.json", "run b.json"]
    assert merged["settings"]["batches"] == [256, 1024] and merged["settings"]["lrs"]["base"] == [0.1, 0.4]
    assert merged["settings"]["budgets"] == {"256": 100, "1024": 100}
    assert merged["ratios"]["256"] == {"steps": 0.5, "seconds": 0.5}
    assert merged["ratios"]["1024"] == {"steps": pytest.approx(0.8), "seconds": pytest.approx(0.8)}
    assert json.loads((tmp_path / "m.json").read_text())["best"] == merged["best"]
    assert (tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="target 0.95 differs"):
        br.merge([small, part("c.json", [], target=0.95)], tmp_path / "x.json")
    with pytest.raises(SystemExit, match="present twice"):
        br.merge([small, small], tmp_path / "x.json")
    other = part("d.json", [_run("base", 256, 0.2, 0, 70.0)], budgets={"256": 150})
    with pytest.raises(SystemExit, match="budget 150 at batch 256 differs from an earlier part's 100"):
        br.merge([small, other], tmp_path / "x.json")


def test_arms_runs_only_the_named_arms_grids_and_refuses_an_unknown_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``--arms`` (a grid's edge, one arm): only those arms launch, over their grids, and the JSON names only them;
    an arm the ladder lacks is refused, named. The launcher is replaced by a fake writing a one-row metrics.csv."""
    launched: list[str] = []

    def fake_launch(task, config, seed, out, name, extra, timeout) -> None:  # noqa: ANN001
        launched.append(name)
        lr = json.loads(Path(config).read_text())["scheduler"]["params"]["warmup_max_lr"]
        (out / name).mkdir(exist_ok=True)
        accuracy = 0.99 if lr == 3.2 else 0.5  # only K-FAC at 3.2 reaches the target
        (out / name / "metrics.csv").write_text(f"step,seconds,held_out_accuracy\n60,6.0,{accuracy}\n")

    monkeypatch.setattr(bs, "launch", fake_launch)
    monkeypatch.setattr(bs, "plot", lambda path, result: None)
    argv = ["run", "resnet-peers", "--batches", "4096", "--arms", "kfac", "sgd", "--out", str(tmp_path)]
    bs.main([*argv, "--arm-lrs", "kfac=3.2,6.4", "--arm-lrs", "sgd=1.6", "--target", "0.95"])
    assert launched == ["sgd-b4096-lr1.6-seed0", "kfac-b4096-lr3.2-seed0", "kfac-b4096-lr6.4-seed0"]
    result = json.loads((tmp_path / "batch_scaling_resnet-peers.json").read_text())
    assert list(result["settings"]["arms"]) == ["sgd", "kfac"]  # the ladder's order: the reference first
    assert result["settings"]["lrs"] == {"sgd": [1.6], "kfac": [3.2, 6.4]}
    assert result["best"]["kfac"]["4096"]["lr"] == 3.2 and result["best"]["sgd"]["4096"]["steps"] is None
    assert result["ratios"]["4096"] == {"steps": None, "seconds": None} and "peer_ratios" not in result
    for arms in (["soap", "sgd"], ["kfac"]):  # no K-FAC, or K-FAC alone: no ratios, and a table without them
        bs.main(["run", "resnet-peers", "--batches", "4096", "--arms", *arms, "--out", str(tmp_path), "--lrs", "3.2"])
        result = json.loads((tmp_path / "batch_scaling_resnet-peers.json").read_text())
        assert list(result["best"]) == sorted(arms, key=["sgd", "soap", "kfac"].index) and "ratios" not in result
        assert "K-FAC/" not in br.table(result) and br.table(result).count("\n") == 2
    launched.clear()  # seeds 1 and 2 of chosen rates: K-FAC at 6.4 misses on seed 1 and still runs on seed 2
    bs.main([*argv, "--arm-lrs", "kfac=6.4", "--arm-lrs", "sgd=1.6", "--seeds", "1", "2", "--target", "0.95"])
    assert sorted(launched) == [
        f"{arm}-b4096-lr{lr}-seed{seed}" for arm, lr in (("kfac", 6.4), ("sgd", 1.6)) for seed in (1, 2)
    ]
    launched.clear()  # a grid where no rate reached the target: nothing to re-run on the later seeds
    bs.main([*argv, "--arm-lrs", "kfac=6.4,12.8", "--arm-lrs", "sgd=1.6", "--seeds", "1", "2", "--target", "0.95"])
    assert sorted(launched) == [
        "kfac-b4096-lr12.8-seed1",
        "kfac-b4096-lr6.4-seed1",
        "sgd-b4096-lr1.6-seed1",
        "sgd-b4096-lr1.6-seed2",
    ]
    with pytest.raises(SystemExit):
        bs.main(["run", "resnet-peers", "--arms", "adamw", "--out", str(tmp_path)])
    expected = "--arms of resnet-peers: arm 'adamw': expected ARM or ARM+LABEL (LABEL: letters, digits, - and _) with"
    assert f"{expected} ARM one of ['sgd', 'soap', 'kfac']" in capsys.readouterr().err


def test_rescore_picks_each_arms_best_rate_again_at_another_target() -> None:
    """``table --target``: a saved result's curves scored at a deeper target; the best rate can change with it (here
    the base's slow-then-deep rate), and an arm that never gets there has no point. Crossings by hand, interpolated
    linearly between evaluations (steps 10, 20, 30; seconds a tenth of the step)."""

    def curve_run(arm: str, lr: float, values: list[float]) -> dict:
        curve = [[10.0 * (i + 1), float(i + 1), v] for i, v in enumerate(values)]
        return {"arm": arm, "batch": 256, "lr": lr, "seed": 0, "curve": curve, "to_target": None}

    runs = [
        curve_run("base", 0.1, [0.8, 0.92, 0.7]),  # 0.9 at 10 + 10 * 0.1 / 0.12; never 0.95
        curve_run("base", 0.2, [0.6, 0.8, 0.96]),  # 0.9 at 20 + 10 * 0.1 / 0.16; 0.95 at 20 + 10 * 0.15 / 0.16
        curve_run("kfac", 0.1, [0.9, 0.97, 0.99]),  # 0.9 at 10; 0.95 at 10 + 10 * 0.05 / 0.07
    ]
    settings = {"metric": "held_out_accuracy", "higher_is_better": True, "target": 0.5, "arms": {}}
    result = {"task": "resnet", "command": "run", "settings": settings, "versions": {}, "runs": runs}
    shallow, deep = br.rescore(result, 0.9), br.rescore(result, 0.95)
    assert shallow["best"]["base"]["256"]["lr"] == 0.1
    assert shallow["best"]["base"]["256"]["steps"] == pytest.approx(10 + 10 * 0.1 / 0.12)
    assert shallow["best"]["base"]["256"]["seconds"] == pytest.approx(1 + 0.1 / 0.12)
    assert shallow["ratios"]["256"]["steps"] == pytest.approx(10 / (10 + 10 * 0.1 / 0.12))
    assert deep["settings"]["target"] == 0.95 and result["settings"]["target"] == 0.5  # the saved result untouched
    assert deep["best"]["base"]["256"]["lr"] == 0.2 and deep["best"]["base"]["256"]["steps"] == pytest.approx(29.375)
    assert deep["ratios"]["256"]["steps"] == pytest.approx((10 + 10 * 0.05 / 0.07) / 29.375)
    assert br.rescore(result, 0.995)["best"]["kfac"]["256"] == {"lr": None, "steps": None, "seconds": None, "seeds": 0}


def test_variants_of_an_arm_run_with_their_own_overrides_and_merge_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kfac+fresh``: K-FAC's config and rate keys with its own ``--set-arm`` overrides (K-FAC's ``--set`` not among
    them), run beside K-FAC at the same rate and seed, keyed by its name so the two merge; it is tabled like any arm
    but is not K-FAC's best other arm; a variant of an arm the ladder lacks, or with no label, is refused, named."""
    configs: dict[str, dict] = {}

    def fake_launch(task, config, seed, out, name, extra, timeout) -> None:  # noqa: ANN001
        configs[name] = json.loads(Path(config).read_text())
        (out / name).mkdir(exist_ok=True)
        accuracy = 0.99 if "fresh" in name else 0.96 if name.startswith("kfac") else 0.5
        (out / name / "metrics.csv").write_text(f"step,seconds,held_out_accuracy\n30,3.0,0.1\n60,6.0,{accuracy}\n")

    monkeypatch.setattr(bs, "launch", fake_launch)
    monkeypatch.setattr(bs, "plot", lambda path, result: None)
    argv = ["run", "resnet-peers", "--batches", "4096", "--lrs", "3.2", "--target", "0.95", "--set", "kfac.damping=0.5"]
    argv += ["--out", str(tmp_path)]
    bs.main([*argv, "--arms", "kfac+fresh", "kfac", "sgd", "--set-arm", "kfac+fresh:kfac.factor_decay=0.25"])
    assert set(configs) == {f"{arm}-b4096-lr3.2-seed0" for arm in ("sgd", "kfac", "kfac+fresh")}
    fresh, plain = configs["kfac+fresh-b4096-lr3.2-seed0"]["kfac"], configs["kfac-b4096-lr3.2-seed0"]["kfac"]
    shipped = json.loads((ROOT / "configs/resnet_kfac_cpu.json").read_text())["kfac"]
    assert fresh == shipped | {"factor_decay": 0.25} and plain == shipped | {"damping": 0.5}
    result = json.loads((tmp_path / "batch_scaling_resnet-peers.json").read_text())
    assert list(result["settings"]["arms"]) == ["sgd", "kfac", "kfac+fresh"]
    assert result["settings"]["arms"]["kfac+fresh"] == "configs/resnet_kfac_cpu.json"
    # 0.95 crossed between steps 30 and 60: K-FAC at 30 + 30 * 0.85 / 0.86, its variant at 30 + 30 * 0.85 / 0.89
    assert result["best"]["kfac+fresh"]["4096"]["steps"] == pytest.approx(30 + 30 * 0.85 / 0.89)
    assert result["ratios"]["4096"]["steps"] is None and "peer_ratios" not in result  # SGD never reached it
    again = tmp_path / "again"
    bs.main([*argv, "--arms", "kfac+fresh", "--seeds", "1", "--out", str(again)])
    merged = br.merge(
        [tmp_path / "batch_scaling_resnet-peers.json", again / "batch_scaling_resnet-peers.json"], tmp_path / "m.json"
    )
    assert merged["best"]["kfac+fresh"]["4096"]["seeds"] == 2 and list(merged["best"]) == ["sgd", "kfac", "kfac+fresh"]
    runs = [_run("sgd", 4096, 1.6, 0, 100.0), _run("soap", 4096, 1.6, 0, 80.0), _run("kfac", 4096, 3.2, 0, 60.0)]
    summary = br.summary(br.best_points([*runs, _run("kfac+x", 4096, 3.2, 0, 40.0)]))
    assert summary["peer_ratios"]["4096"] == {"peer": "soap", "steps": 0.75, "seconds": 0.75}
    assert "| kfac+x lr | kfac+x steps |" in br.table({"task": "resnet-peers", **summary})
    for bad in ("adamw+fresh", "kfac+", "kfac+a b"):
        with pytest.raises(ValueError, match=re.escape(f"arm {bad!r}: expected ARM or ARM+LABEL")):
            bl.ordered(bl.LADDERS["resnet-peers"], [bad])
