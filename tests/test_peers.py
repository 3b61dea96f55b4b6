"""benchmarks/peers.py's arithmetic on synthetic curves, and the client-optimizer section the peers run through."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_kfac.optimizers import build_client_optimizer
from ds_kfac.optimizers.client import STEP_KEY, pop_client_optimizer

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks/peers.py")
peers = importlib.util.module_from_spec(_spec)
sys.modules["peers"] = peers
_spec.loader.exec_module(peers)


def test_one_time_seconds_is_the_first_steps_excess_over_the_median() -> None:
    # Steps of 1.0 s, the first 5.0 s (a compile): 4.0 s one-time; a run without excess has none.
    assert peers.one_time_seconds([5.0, 6.0, 7.0, 8.0, 9.5]) == pytest.approx(4.0)
    assert peers.one_time_seconds([0.5, 1.5, 2.5]) == 0.0
    assert peers.without_one_time([(10.0, 14.0, 3.0)], 4.0) == [(10.0, 10.0, 3.0)]


def test_summary_times_to_every_arms_median_final_and_the_ratio_to_the_best_peer() -> None:
    a = [[(50.0, 10.0, 4.0), (100.0, 20.0, 3.0)], [(50.0, 10.0, 4.2), (100.0, 22.0, 3.2)]]
    b = [[(50.0, 15.0, 3.5), (100.0, 30.0, 2.5)], [(50.0, 15.0, 3.3), (100.0, 30.0, 2.3)]]
    kfac = [[(50.0, 12.0, 3.0), (100.0, 24.0, 2.0)], [(50.0, 12.0, 3.6), (100.0, 24.0, 2.8)]]
    s = peers.summarize({"a": a, "b": b, "kfac": kfac}, higher_is_better=False)
    assert s["a"]["median_final"] == pytest.approx(3.1) and s["b"]["median_final"] == pytest.approx(2.4)
    # An arm's time to its own median final is its full budget (median over seeds).
    assert s["a"]["to"]["a"] == {"target": pytest.approx(3.1), "steps": 100.0, "seconds": 21.0, "reached": 2}
    # K-FAC to b's 2.4: seed 0 crosses between 3.0 (50) and 2.0 (100) at 60% (step 80, 19.2 s); seed 1 ends at
    # 2.8 and never reaches it, so the median over the two seeds is infinitely late.
    assert s["kfac"]["to"]["b"]["steps"] is None and s["kfac"]["to"]["b"]["reached"] == 1
    # K-FAC to a's 3.1: seed 0 at its first evaluation? 3.0 <= 3.1 at step 50 (12 s); seed 1 between 3.6 and 2.8
    # at 62.5% (step 81.25, 19.5 s); median 65.625 steps, 15.75 s.
    assert s["kfac"]["to"]["a"]["steps"] == pytest.approx(65.625) and s["kfac"]["to"]["a"]["seconds"] == pytest.approx(
        15.75
    )
    assert peers.best_peer(s, higher_is_better=False) == "b"
    assert peers.best_peer(s, higher_is_better=True) == "a"
    assert peers.ratios(s, "kfac", "a") == {"steps": pytest.approx(0.65625), "seconds": pytest.approx(0.75)}
    assert peers.ratios(s, "kfac", "b") == {"steps": None, "seconds": None}
    assert s["kfac"]["seconds_per_step"] == pytest.approx(0.24)


def test_grid_points_are_the_product_of_the_axes_and_sets_are_checked() -> None:
    points = peers.grid_points(["o.lr=0.1,0.2", "o.m=0.9"])
    assert points == [["o.lr=0.1", "o.m=0.9"], ["o.lr=0.2", "o.m=0.9"]]
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        peers.grid_points(["o.lr"])
    assert peers.grid_points(["s.max=[0.01,0.004],[0.02,0.004]"]) == [["s.max=[0.01,0.004]"], ["s.max=[0.02,0.004]"]]
    assert peers.parse_sets(["muon:optimizer.params.muon_lr=0.04"], ["muon", "kfac"]) == {
        "muon": ["optimizer.params.muon_lr=0.04"],
        "kfac": [],
    }
    with pytest.raises(ValueError, match="ARM:KEY=JSON"):
        peers.parse_sets(["soap:x=1"], ["muon"])


def test_every_peer_config_names_a_buildable_optimizer() -> None:
    """Each committed arm's JSON parses, and a client optimizer it names is built over a small model."""
    for task, arms in peers.ARMS.items():
        for arm, path in arms.items():
            config = json.loads((ROOT / path).read_text())
            assert ("optimizer" in config) != ("client_optimizer" in config), f"{task} {arm}: one optimizer section"
            if "client_optimizer" in config:
                build_client_optimizer(config["client_optimizer"], torch.nn.Linear(3, 2).parameters(), seed=0)


class _Noisy(torch.optim.Optimizer):
    """Adds a torch and a NumPy draw to each parameter: what PSGD's probes do inside its step."""

    def __init__(self, params, lr: float = 1.0) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn_like(p) + float(np.random.random()), alpha=group["lr"])


def test_client_optimizer_draws_alike_on_every_rank_and_leaves_the_callers_streams() -> None:
    spec = {"class": f"{__name__}._Noisy", "params": {"lr": 0.5}}
    replicas = []
    for rank in range(2):
        torch.manual_seed(rank)  # the ranks' own streams differ (dropout is seeded per rank)
        np.random.seed(rank)
        weight = torch.nn.Parameter(torch.zeros(4))
        optimizer = build_client_optimizer(spec, [weight], seed=7)
        expected_next = torch.rand(1, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            optimizer.step()
        assert torch.equal(torch.rand(1), expected_next)  # the caller's stream is where it was
        replicas.append((weight.detach().clone(), optimizer.state_dict()["param_groups"][0][STEP_KEY]))
    assert torch.equal(replicas[0][0], replicas[1][0]) and replicas[0][0].abs().sum() > 0
    assert replicas[0][1] == replicas[1][1] == 3  # saved with the optimizer's state, so a resume draws on


def test_client_optimizer_draws_on_where_a_wrapper_replaced_its_groups() -> None:
    """ZeRO 1/2's wrapper gives the optimizer new param groups (its flat partitions), without the step count: the
    draws go on from the count kept beside them, the same as an optimizer whose groups stayed, and the count is in
    the new groups again after the step (so a checkpoint saves it)."""
    spec = {"class": f"{__name__}._Noisy", "params": {"lr": 0.5}}
    runs = []
    for replace in (False, True):
        weight = torch.nn.Parameter(torch.zeros(4))
        optimizer = build_client_optimizer(spec, [weight], seed=7)
        optimizer.step()
        if replace:
            optimizer.param_groups = [{"params": [weight], "lr": 0.5}]
        optimizer.step()
        runs.append((weight.detach().clone(), optimizer.param_groups[0][STEP_KEY]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] == 2


def test_client_optimizer_section_errors_name_the_problem() -> None:
    params = torch.nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match="dotted path"):
        build_client_optimizer({"class": "SOAP"}, params, seed=0)
    with pytest.raises(ImportError, match="no_such_package"):
        build_client_optimizer({"class": "no_such_package.Opt"}, params, seed=0)
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer"):
        build_client_optimizer({"class": "torch.nn.Linear"}, params, seed=0)
    with pytest.raises(ValueError, match="'class' and 'params'"):
        build_client_optimizer({"class": "torch.optim.SGD", "lr": 0.1}, params, seed=0)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"class": "torch.optim.NoSuchOptimizer"}, "'torch.optim.NoSuchOptimizer': module 'torch.optim' has no"),
        ({"class": "torch.optim.SGD", "params": {"lr": 0.1, "momentun": 0.9}}, "unknown keys ['momentun']"),
        ({"class": "pytorch_optimizer.SOAP", "params": {"learning_rate": 0.1}}, "unknown keys ['learning_rate']"),
        ({"class": "torch.optim.SGD", "params": [0.1]}, "must be a JSON object of keyword arguments, got [0.1]"),
    ],
    ids=["no_such_class", "unknown_param", "swallowed_param", "params_not_object"],
)
def test_client_optimizer_hostile_sections_are_refused(section: dict, message: str) -> None:
    """Issue 47, item 1: a class the module lacks, or params its constructor does not name, are refused naming
    them; SOAP's and Kron's ``**kwargs`` would take a misspelt key and train with the default."""
    with pytest.raises(ValueError, match=re.escape(message)):
        build_client_optimizer(section, torch.nn.Linear(2, 2).parameters(), seed=0)


def test_client_optimizer_with_a_json_optimizer_is_refused() -> None:
    """Issue 47, item 1: with an ``"optimizer"`` section too, DeepSpeed would train with the client optimizer and
    ignore the JSON one without a word; alone, the section is built and taken out of the config."""
    section = {"class": "torch.optim.SGD", "params": {"lr": 0.1}}
    both = {"client_optimizer": section, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with pytest.raises(ValueError, match="both a 'client_optimizer' section .* and an \"optimizer\" section"):
        pop_client_optimizer(both, torch.nn.Linear(2, 2).parameters(), seed=0)
    alone = {"client_optimizer": section, "train_batch_size": 2}
    assert isinstance(pop_client_optimizer(alone, torch.nn.Linear(2, 2).parameters(), seed=0), torch.optim.SGD)
    assert alone == {"train_batch_size": 2}
    assert pop_client_optimizer(alone, torch.nn.Linear(2, 2).parameters(), seed=0) is None


def test_run_rotates_the_arms_per_seed_and_saves_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``run`` end to end with the launcher replaced by one that writes each run's metrics.csv: the arms' order
    rotates by one per seed, the one-time cost comes off every time, and the JSON and plot are written."""
    order = []

    def fake_launch(task, config, seed, out, run_name, extra, timeout) -> None:
        arm = run_name.split("-seed")[0]
        order.append(run_name)
        slope = {"sgd": 1.0, "adamw": 0.5, "kfac": 2.0}.get(arm, 0.1)
        rows = ["step,samples,seconds,loss,lr,held_out_accuracy,held_out_loss"]
        for step in range(1, 5):  # 1 s a step, the first 3 s more (a compile)
            accuracy = f"{min(0.99, 0.2 * slope * step):.4f}" if step % 2 == 0 else ""
            rows.append(f"{step},{step},{step + 3.0},1.0,0.1,{accuracy},{'1.0' if accuracy else ''}")
        (out / run_name).mkdir(parents=True, exist_ok=True)
        (out / run_name / "metrics.csv").write_text("\n".join(rows) + "\n")

    monkeypatch.setattr(peers.ttt, "launch", fake_launch)
    monkeypatch.setattr(peers.ttt, "versions", lambda: {})
    args = argparse.Namespace(
        task="resnet",
        arms=["sgd", "adamw", "kfac"],
        set=[],
        seeds=[0, 1],
        name=None,
        out=tmp_path,
        smoke=False,
        timeout=1.0,
        phase1=None,
        extra=[],
        reuse=False,
    )
    result = peers.run(args)
    assert order == ["sgd-seed0", "adamw-seed0", "kfac-seed0", "adamw-seed1", "kfac-seed1", "sgd-seed1"]
    assert {r["one_time_seconds"] for r in result["runs"]} == {3.0}
    assert result["runs"][0]["curve"] == [(2.0, 2.0, 0.4), (4.0, 4.0, 0.8)]  # seconds less the 3 s one-time cost
    # adamw ends at 0.4, sgd at 0.8, kfac at 0.99 from step 4 (0.8 at step 2): the best peer is sgd, reached by
    # kfac at its first evaluation, step 2 against sgd's 4.
    assert peers.best_peer(result["summary"], higher_is_better=True) == "sgd"
    assert peers.ratios(result["summary"], "kfac", "sgd") == {"steps": 0.5, "seconds": 0.5}
    saved = json.loads((tmp_path / "peers_resnet.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(result["summary"]))
    assert (tmp_path / "peers_resnet.png").stat().st_size > 0
    assert "K-FAC to the best peer's (sgd) median final 0.8000: 0.50x its steps" in peers.table(saved)
    # With --reuse the finished runs (same config, seed, arguments) are read back, none launched again, and a
    # changed config is launched.
    order.clear()
    args.reuse, args.name = True, "again"
    (tmp_path / "again").symlink_to(tmp_path / "peers_resnet")
    args.set = ["kfac:kfac.damping=0.2"]
    again = peers.run(args)
    assert order == ["kfac-seed0", "kfac-seed1"]
    assert again["summary"]["sgd"] == result["summary"]["sgd"] and [r["reused"] for r in again["runs"]].count(True) == 4


def test_committed_results_are_what_their_runs_give() -> None:
    """benchmarks/results/peers/: each grid's ranking and each run's summary follow from the stored curves, and
    each names its command."""
    results = sorted((ROOT / "benchmarks/results/peers").glob("*.json"))
    assert any(p.stem.startswith("grid_bert_") for p in results)
    for path in results:
        result = json.loads(path.read_text())
        assert result["command"].startswith("python benchmarks/peers.py ")
        higher = result["settings"]["higher_is_better"]
        curves: dict[str, list] = {}
        for run in result["runs"]:
            curves.setdefault(run["arm"], []).append(run["curve"])
        if "summary" in result:  # a side-by-side run
            assert peers.summarize(curves, higher) == result["summary"], path.name
        else:  # a grid: points ranked by their runs' median final
            finals = {n: p["median_final"] for n, p in result["points"].items()}
            for n, point in result["points"].items():
                assert point["median_final"] == peers.statistics.median(c[-1][2] for c in curves[point["key"]])
            assert result["ranked"] == sorted(finals, key=finals.__getitem__, reverse=higher), path.name
