"""benchmarks/step_cost.py: the FLOP floor against a hand count, and its smoke mode on 1 and 2 processes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import launch
import pytest
import torch
from torch import nn

from ds_kfac import KFACConfig

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("step_cost", ROOT / "benchmarks/step_cost.py")
sc = importlib.util.module_from_spec(_spec)
sys.modules["step_cost"] = sc  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(sc)

CYCLES = 2
SCHEMA = {
    "top": {"benchmark", "command", "settings", "versions", "load_average", "floor_constants", "configurations"},
    "configuration": {
        "workload",
        "world",
        "placement",
        "ga",
        "load_before",
        "kfac_config",
        "layers",
        "arms",
        "ratio",
        "floor",
        "refreshes",
        "timed_refreshes",
        "memory",
    },
    "arm": {"mean_ms", "median_ms", "slowest_ms", "coverage", "phases_ms", "classes", "step_ms"},
    "class": {"count", "mean_ms", "phases_ms", "coverage"},
    "ratio": {"mean", "median", "min", "max", "per_cycle", "recipe_cadence", "at_recipe_cadence"},
    "floor": {"flops_per_step", "ratio", "overhead_vs_floor", "phases"},
    "memory": {"kfac_state_bytes", "kfac_state_bytes_in_step", "model_param_bytes", "peak_rss_bytes"},
}

LAUNCH_TIMEOUT = 180
"""Seconds per smoke configuration's launch: a hang guard. The 2-rank smoke takes about 10 s, but on a 2-core machine
with a busy loop on each core (issue 48's emulated slower machine) its launch ran past the 60 s it had."""


class ConvThenLinear(nn.Module):
    """Conv2d(2->3, 3x3, stride 2, pad 1, no bias) on 2x2x4x4, then Linear(12->5) on the flattened 2x12."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False)
        self.fc = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))


def test_flop_floor_matches_a_hand_count() -> None:
    model = ConvThenLinear()
    layers = sc.count_layers(model, {"x": torch.randn(2, 2, 4, 4)}, lambda m, b: m(b["x"]).sum())
    # conv: output 2x3x2x2, so n = 2*2*2 = 8 rows of 2*3*3 = 18 inputs, 3 outputs: 8*18*3 = 432 multiply-adds.
    # fc: n = 2 rows, a = 12 + bias column = 13, g = 5: 2*12*5 = 120 multiply-adds.
    assert {(w.name, w.macs, w.rows, w.a_dim, w.g_dim) for w in layers} == {
        ("conv", 432, 8, 18, 3),
        ("fc", 120, 2, 13, 5),
    }
    # GA 2, factors every 2 steps, decompositions every 3, world 2, mem-opt (1 gradient worker per layer).
    flops = sc.flops_per_step(layers, ["conv", "fc"], ga=2, factor_every=2, inv_every=3, world=2, grad_workers=1)
    assert flops["forward_backward"] == 6 * 2 * (432 + 120)
    assert flops["factors"] == 2 * (2 * 8 * (18**2 + 3**2) + 2 * 2 * (13**2 + 5**2)) / 2
    assert flops["precondition"] == (4 * 3 * 18 * (3 + 18) + 4 * 5 * 13 * (5 + 13)) / 2
    assert flops["decompose"] == 9 * (18**3 + 3**3 + 13**3 + 5**3) / 3 / 2
    # A skipped layer still costs forward/backward, but no K-FAC work; comm-opt preconditions everything.
    fc_only = sc.flops_per_step(layers, ["fc"], ga=1, factor_every=1, inv_every=1, world=2, grad_workers=2)
    assert fc_only == {
        "forward_backward": 6 * (432 + 120),
        "factors": 2 * 2 * (13**2 + 5**2),
        "precondition": 4 * 5 * 13 * 18,
        "decompose": 9 * (13**3 + 5**3) / 2,
    }
    # K-FAC-reduce: one conv row per example (B = 2); the multiply-adds do not change.
    reduced = sc.count_layers(model, {"x": torch.randn(2, 2, 4, 4)}, lambda m, b: m(b["x"]).sum(), "reduce")
    assert {(w.name, w.macs, w.rows) for w in reduced} == {("conv", 432, 2), ("fc", 120, 2)}
    summary = sc.floor_summary(flops, base_mean_ms=10.0, kfac_phases_ms={"hooks": 1.0, "factors": 0.5}, ratio=1.5)
    extra = flops["factors"] + flops["precondition"] + flops["decompose"]
    assert summary["ratio"] == pytest.approx(1 + extra / flops["forward_backward"])
    assert summary["overhead_vs_floor"] == pytest.approx(0.5 / (summary["ratio"] - 1))
    factors = summary["phases"]["factors"]
    assert factors["floor_ms"] == pytest.approx(10.0 * flops["factors"] / flops["forward_backward"])
    assert factors["measured_ms"] == 1.5 and factors["measured_phases"] == ["hooks", "factors"]


def _check(result: dict[str, Any], world: int, workloads: list[str]) -> None:
    assert set(result) == SCHEMA["top"]
    configs = result["configurations"]
    assert [(c["workload"], c["world"], c["ga"]) for c in configs] == [
        (w, world, ga) for w in workloads for ga in (1, 4)
    ]
    for c in configs:
        assert set(c) == SCHEMA["configuration"]
        assert c["kfac_config"]["factor_update_steps"] == 2 and c["kfac_config"]["inv_update_steps"] == 4
        for name in sc.ARMS:
            arm = c["arms"][name]
            assert set(arm) == SCHEMA["arm"] | ({"untimed_ms"} if name == "kfac" else set())
            assert len(arm["step_ms"]) == CYCLES and all(len(cycle) == 4 for cycle in arm["step_ms"])
            # Per 4-step cycle: index 0 decomposes, 2 updates factors, 1 and 3 are plain.
            expected_counts = {"decomposition": CYCLES, "factor": CYCLES, "plain": 2 * CYCLES}
            assert {k: v["count"] for k, v in arm["classes"].items()} == expected_counts
            for block in [arm, *arm["classes"].values()]:
                assert all(ms >= 0 for ms in block["phases_ms"].values()), (name, block["phases_ms"])
                assert 0.9 <= block["coverage"] <= 1.1, (name, block["coverage"], block["phases_ms"])
                assert block["coverage"] == pytest.approx(sum(block["phases_ms"].values()) / block["mean_ms"])
            assert arm["median_ms"] <= arm["slowest_ms"]
        kfac = c["arms"]["kfac"]
        assert kfac["untimed_ms"] >= 0
        assert kfac["classes"]["decomposition"]["phases_ms"]["decompose"] > 0
        plain_decompose = kfac["classes"]["plain"]["phases_ms"].get("decompose", 0.0)
        if c["kfac_config"].get("refresh_spread"):  # the BERT recipe: every step refreshes its slot's factors
            assert plain_decompose > 0
        else:
            assert plain_decompose == 0.0
        assert set(c["ratio"]) == SCHEMA["ratio"] and len(c["ratio"]["per_cycle"]) == CYCLES
        assert c["ratio"]["min"] <= c["ratio"]["median"] <= c["ratio"]["max"]
        assert c["ratio"]["mean"] == pytest.approx(kfac["mean_ms"] / c["arms"]["base"]["mean_ms"])
        # At the measured cadence the class means amortize back to the measured mean; the recipe's is the config's.
        measured_inv = c["kfac_config"]["inv_update_steps"]
        assert sc.amortized_ms(kfac["classes"], c["kfac_config"], measured_inv) == pytest.approx(kfac["mean_ms"])
        recipe = json.loads((ROOT / sc.WORKLOADS[c["workload"]].kfac_config).read_text())["kfac"]
        assert c["ratio"]["recipe_cadence"] == {k: recipe.get(k, sc.CADENCE[k]) for k in sc.CADENCE}
        at_recipe = sc.amortized_ms(kfac["classes"], c["ratio"]["recipe_cadence"], measured_inv)
        at_recipe /= c["arms"]["base"]["mean_ms"]
        assert c["ratio"]["at_recipe_cadence"] == pytest.approx(at_recipe)
        # Every rank decomposed its sides in full at step 0; with the subspace refresh (the key's default, the BERT
        # recipe's) later refreshes started from the basis they had (a subspace step, or the basis kept:
        # basis_keep_drift), with plain K-FAC's default (eigh) every refresh was a full one.
        assert len(c["refreshes"]) == world and all(r["full"] > 0 for r in c["refreshes"])
        warm = sum(r["subspace"] + r["kept"] for r in c["refreshes"])
        assert warm > 0 if KFACConfig.parse(c["kfac_config"]).basis_update == "subspace" else warm == 0
        for total, timed in zip(c["refreshes"], c["timed_refreshes"]):  # the measured cycles' share of them
            assert all(0 <= timed[how] <= total[how] for how in ("full", "subspace", "kept"))
        floor = c["floor"]
        assert set(floor) == SCHEMA["floor"] and floor["ratio"] > 1
        # The measured overhead in units of the floor's, from the recorded means (its sign is timing noise: at smoke
        # sizes K-FAC's arm can come out as fast as the base's on a loaded machine).
        assert floor["overhead_vs_floor"] == pytest.approx((c["ratio"]["mean"] - 1) / (floor["ratio"] - 1))
        flops = floor["flops_per_step"]
        extra = sum(flops[p] for p in floor["phases"])
        assert floor["ratio"] == pytest.approx(1 + extra / flops["forward_backward"])
        assert set(floor["phases"]) == {"factors", "precondition", "decompose"}
        for phase, entry in floor["phases"].items():
            base_ms = c["arms"]["base"]["mean_ms"]
            assert entry["floor_ms"] == pytest.approx(flops[phase] / flops["forward_backward"] * base_ms), phase
            measured = sum(kfac["phases_ms"].get(p, 0.0) for p in entry["measured_phases"])
            assert entry["measured_ms"] == pytest.approx(measured), phase
        memory = c["memory"]
        assert set(memory) == SCHEMA["memory"] and len(memory["kfac_state_bytes"]) == world
        assert all(m["factors"] > 0 and m["decompositions"] > 0 for m in memory["kfac_state_bytes"])
        # During a factor step the step's statistics are held on top of the running state (on one
        # process in the accumulators; with more, they may already be in the reduction's buffers).
        held = zip(memory["kfac_state_bytes"], memory["kfac_state_bytes_in_step"])
        assert all(sum(during.values()) >= sum(after.values()) for after, during in held)
        if world == 1:
            assert memory["kfac_state_bytes_in_step"][0]["accumulators"] > 0
        rss = memory["peak_rss_bytes"]
        assert all(0 < b <= k for b, k in zip(rss["base_only"], rss["with_kfac"])) and len(rss["base_only"]) == world


def test_amortized_step_at_another_cadence() -> None:
    """Per ``inv`` steps: one decomposition step, ``inv / factor - 1`` factor steps, the rest plain, each without its
    ``decompose`` time, plus one measured cycle's refresh work (measured here: 4 steps per cycle, one each of
    decomposition and factor, two plain)."""

    def classes(decompose: dict[str, float]) -> dict:
        means = {"plain": 1.0, "factor": 3.0, "decomposition": 4.0}
        counts = {"plain": 2, "factor": 1, "decomposition": 1}
        return {
            c: {"count": counts[c], "mean_ms": means[c] + d, "phases_ms": {"decompose": d}}
            for c, d in decompose.items()
        }

    at_once = classes({"plain": 0.0, "factor": 0.0, "decomposition": 26.0})  # a fixed cadence's refresh
    spread = classes({"plain": 6.5, "factor": 6.5, "decomposition": 6.5})  # refresh_spread: a quarter per step
    for measured in (at_once, spread):
        assert (
            sc.amortized_ms(measured, {"factor_update_steps": 5, "inv_update_steps": 25}, 4)
            == (4 + 4 * 3 + 20 + 26) / 25
        )
        assert sc.amortized_ms(measured, {"factor_update_steps": 2, "inv_update_steps": 4}, 4) == (4 + 3 + 2 + 26) / 4
        assert (
            sc.amortized_ms(measured, {"factor_update_steps": 3, "inv_update_steps": 10}, 4) is None
        )  # 3 does not divide 10
    del at_once["plain"]
    assert sc.amortized_ms(at_once, {"factor_update_steps": 5, "inv_update_steps": 25}, 4) is None


@pytest.mark.parametrize(
    "world, workloads, placement",
    [(1, ["bert-mini", "resnet20"], "comm-opt"), (2, ["resnet20"], "mem-opt")],
)
def test_smoke_run_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture, world: int, workloads: list[str], placement: str
) -> None:
    out = tmp_path / "step_cost.json"
    args = ["run", "--smoke", "--workloads", *workloads, "--worlds", str(world), "--placements", placement]
    sc.main([*args, "--ga", "1", "4", "--cycles", str(CYCLES), "--timeout", str(LAUNCH_TIMEOUT), "--out", str(out)])
    assert not launch.leftovers()
    result = json.loads(out.read_text())
    _check(result, world, workloads)
    assert out.with_suffix(".png").stat().st_size > 0
    capsys.readouterr()
    sc.main(["table", str(out), str(out)])  # several files make one table
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].startswith("| workload | K-FAC settings | world | placement | GA |") and rows[1].startswith(
        "| --- |"
    )
    configurations = result["configurations"]
    assert len(rows) == 2 + 2 * len(configurations)
    assert all(
        f"| {c['workload']} | as shipped | {world} | {placement} | {c['ga']} |" in row
        for c, row in zip(configurations * 2, rows[2:])
    )
    sc.main(["table", "--phases", str(out)])
    phases, floors = capsys.readouterr().out.strip().split("\n\n")
    assert len(phases.splitlines()) == 2 + 2 * len(configurations)  # a row per arm
    assert len(floors.splitlines()) == 2 + 3 * len(configurations)  # factors, precondition, decompose


def test_smoke_times_the_sampled_fisher_backward(tmp_path: Path) -> None:
    """``--set fisher='"sampled"'``: the K-FAC arm calls ``sample_fisher`` on every micro-batch, and the extra backward
    is the phase ``sampled_backward`` of the steps that update factors (4-step cycle: indices 0 and 2), none on the
    plain steps nor in the base arm; the phases still cover the step."""
    out = tmp_path / "sampled.json"
    args = ["run", "--smoke", "--workloads", "resnet8-demo", "--worlds", "1", "--ga", "2", "--cycles", "1"]
    sc.main([*args, "--set", 'fisher="sampled"', "--timeout", str(LAUNCH_TIMEOUT), "--out", str(out)])
    (c,) = json.loads(out.read_text())["configurations"]
    assert c["kfac_config"]["fisher"] == "sampled"
    kfac, base = c["arms"]["kfac"], c["arms"]["base"]
    assert all("sampled_backward" not in block["phases_ms"] for block in [base, *base["classes"].values()])
    sampled = {name: block["phases_ms"]["sampled_backward"] for name, block in kfac["classes"].items()}
    assert sampled["plain"] == 0.0 and sampled["factor"] > 0 and sampled["decomposition"] > 0
    assert all(0.9 <= block["coverage"] <= 1.1 for block in [kfac, *kfac["classes"].values()])


def test_smoke_predicts_under_a_simulated_network(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--predict --network``: both ranks hold K-FAC's collectives back by the stated network, the calibration made
    in the same processes fits links that carry it (a ring all-reduce at 2 ranks: ``2 alpha + n / B``), and the
    tables put the prediction beside the measurement."""
    out = tmp_path / "predicted.json"
    args = ["run", "--smoke", "--workloads", "bert-demo", "--worlds", "2", "--placements", "mem-opt", "--ga", "2"]
    network = "latency=1e-3,bandwidth=1e8"
    sc.main([*args, "--cycles", "1", "--predict", "--network", network, "--timeout", str(LAUNCH_TIMEOUT),
             "--out", str(out)])  # fmt: skip
    assert not launch.leftovers()
    (c,) = json.loads(out.read_text())["configurations"]
    links = c["predicted"]["calibration"]["links"]
    # The simulated 2 alpha and 1 / B, plus this machine's own (far faster) transfer and the noise of a shared
    # machine; without the network the fit is about 0.1 ms and 1e-9 s a byte.
    assert 1e-3 <= links["all_reduce"]["latency"] < 7e-3 and 0.9e-8 <= links["all_reduce"]["per_byte"] < 1.5e-8
    assert len(c["predicted"]["ranks_ms"]) == 2 and c["predicted"]["overhead_ms"] > 0
    capsys.readouterr()
    sc.main(["table", "--predicted", str(out)])
    (row,) = capsys.readouterr().out.strip().splitlines()[2:]
    assert row.startswith(f"| bert-demo w2 mem-opt GA2 | {network} |")
    sc.main(["table", "--ranking", str(out)])
    (row,) = capsys.readouterr().out.strip().splitlines()[2:]
    assert row.startswith(f"| bert-demo, 2, 2 | {network} | mem-opt ")
