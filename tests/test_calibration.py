"""Time before launch: the simulated interconnect (``ds_kfac.comm.network``), the calibration's fit and the
prediction of each placement's seconds per step (``ds_kfac.planning.predict``), and ``python -m ds_kfac.plan
--calibrate`` on 2 launched ranks under a simulated network.

How close the predictions come to measured steps is a benchmark (``benchmarks/step_cost.py run --predict``;
docs/placement.md), not a timed test."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import launch
import pytest
import torch
from test_plan import BERT_TINY, TINY_LAYERS

from ds_kfac.comm import network
from ds_kfac.planning import FRACTIONS, Plan, plan_job, read_job
from ds_kfac.planning.calibrate import _fit
from ds_kfac.planning.models import bert_config, bert_on_meta
from ds_kfac.planning.predict import COMPUTE_PHASES, Calibration, Link, predict_plan

WORKER = Path(__file__).parent / "workers" / "calibrate_worker.py"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_simulated_network_costs_the_documented_algorithms(world: int) -> None:
    """All-reduce (the faster of a ring and a tree), binomial-tree broadcast and reduce, all-to-all, by the module's
    formulas restated; and at 1,024 ranks a small all-reduce goes by the tree."""
    net, n = network.Network(latency=1e-5, bandwidth=1e9), 3 * 2**20
    hops = math.ceil(math.log2(world)) if world > 1 else 0
    expected = {
        "all_reduce": min(2 * (world - 1) * 1e-5 + 2 * (world - 1) / world * n / 1e9, 2 * hops * 1e-5 + 2 * n / 1e9),
        "broadcast": hops * 1e-5 + (n / 1e9 if world > 1 else 0),
        "reduce": hops * 1e-5 + (n / 1e9 if world > 1 else 0),
        "all_to_all": (world - 1) * 1e-5 + (n / 1e9 if world > 1 else 0),
    }
    for kind, seconds in expected.items():
        assert net.seconds(kind, n, world) == pytest.approx(seconds, rel=1e-12, abs=1e-15)
    assert net.seconds("all_reduce", 1024, 1024) == pytest.approx(2 * 10 * 1e-5 + 2 * 1024 / 1e9)


@pytest.mark.parametrize(
    "text,message",
    [
        ("latency=1e-5", "both latency and bandwidth are required"),
        ("latency=1e-5,bandwidth=fast", "bandwidth is not a number"),
        ("delay=1,bandwidth=1e9", "expected 'latency=<seconds>,bandwidth=<bytes per second>'"),
        ("latency=1e-5,bandwidth=0", "bandwidth > 0"),
        ("latency=-1,bandwidth=1e9", "latency must be >= 0"),
    ],
)
def test_a_malformed_network_is_named(monkeypatch: pytest.MonkeyPatch, text: str, message: str) -> None:
    monkeypatch.setenv(network.ENV, text)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        network.simulated()
    assert network.ENV in str(err.value)


def test_hold_sleeps_only_under_a_simulated_network(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(network.time, "sleep", slept.append)
    monkeypatch.delenv(network.ENV, raising=False)
    network.hold("all_reduce", 10**6, 4)
    assert slept == []
    monkeypatch.setenv(network.ENV, "latency=2e-4,bandwidth=5e8")
    network.hold("all_reduce", 10**6, 4)
    network.hold("broadcast", 10**6, 1)
    assert slept == [pytest.approx(6 * 2e-4 + 1.5 * 10**6 / 5e8), 0.0]


def test_the_fit_recovers_a_line() -> None:
    sizes = [4096 * 4**i for i in range(7)]
    link = _fit(sizes, [3e-4 + 2.5e-9 * n for n in sizes])
    assert link.latency == pytest.approx(3e-4, rel=1e-9) and link.per_byte == pytest.approx(2.5e-9, rel=1e-9)
    assert _fit(sizes, [1e-3 - 1e-12 * n for n in sizes]).per_byte == 0.0  # never negative


CALIBRATION = Calibration(
    device="cpu",
    world=2,
    phases={
        "hooks": 0.010,
        "factors": 0.002,
        "decompose": 0.030,
        "rebase": 0.004,
        "stack": 0.001,
        "precondition": 0.020,
    },
    forward_backward=0.5,
    accumulation=2,
    micro_batch=8,
    collected=2,
    cadence={"factor_update_steps": 1, "inv_update_steps": 10},
    links={"all_reduce": Link(1e-4, 2e-9), "broadcast": Link(5e-5, 1e-9)},
)


def tiny_plan(world: int, fractions: tuple[str, ...] = FRACTIONS, **kfac: object) -> Plan:
    config = {**BERT_TINY, "kfac": {**BERT_TINY["kfac"], "factor_update_steps": 1, "inv_update_steps": 10, **kfac}}
    job = read_job(config, world)
    model, groups = bert_on_meta(bert_config(job.bert["model"], job.bert))
    return plan_job(model, job, fractions, ["allreduce"], groups)


def test_one_rank_is_predicted_its_own_measurement() -> None:
    """At one rank every layer is this rank's and nothing moves: the prediction is the calibration's phases."""
    for placement in predict_plan(tiny_plan(1), CALIBRATION):
        (rank,) = placement.ranks
        measured = {p: CALIBRATION.phases.get(p, 0.0) for p in COMPUTE_PHASES}
        assert rank == pytest.approx({**measured, "factor_comm": 0.0})


def test_two_ranks_split_the_work_and_pay_for_their_collectives() -> None:
    """At 2 ranks, against the documented split: comm-opt preconditions every layer on both ranks and decomposes
    each side once (the two ranks' shares sum to the whole), and both install (``rebase``) and stack every new basis;
    mem-opt preconditions, installs and stacks each layer once. Every rank
    all-reduces the factors (``4F`` bytes plus ``4L`` presence flags per factor step: one bucket and the flags'
    call) and comm-opt broadcasts each decomposition once per refresh to the other rank; mem-opt broadcasts each
    ``P(g)`` (``4ag``) along the row every step."""
    comm, mem = predict_plan(tiny_plan(2, ("comm-opt", "mem-opt")), CALIBRATION)
    factors = 4 * sum(a * a + g * g for a, g in TINY_LAYERS) + 4 * len(TINY_LAYERS)
    reduction = 2 * 1e-4 + 2e-9 * factors
    for placement in (comm, mem):
        assert [r["factor_comm"] for r in placement.ranks] == pytest.approx([reduction] * 2)
        assert sum(r["hooks"] for r in placement.ranks) == pytest.approx(2 * CALIBRATION.phases["hooks"])
    assert [r["precondition"] for r in comm.ranks] == pytest.approx([CALIBRATION.phases["precondition"]] * 2)
    for phase in ("rebase", "stack"):
        assert [r[phase] for r in comm.ranks] == pytest.approx([CALIBRATION.phases[phase]] * 2, rel=1e-9)
        assert sum(r[phase] for r in mem.ranks) == pytest.approx(CALIBRATION.phases[phase], rel=1e-9)
        assert min(r[phase] for r in mem.ranks) > 0.1 * CALIBRATION.phases[phase]  # both ranks hold layers
    decompositions = 4 * sum(a * a + a + g * g + g for a, g in TINY_LAYERS)
    compute = sum(r["decompose"] for r in comm.ranks) - 1e-9 * 2 * decompositions / 10
    assert compute == pytest.approx(CALIBRATION.phases["decompose"] + 2 * 2 * 5e-5 / 10, rel=1e-9)
    gradients = 4 * sum(a * g for a, g in TINY_LAYERS)
    broadcasts = sum(r["precondition"] for r in mem.ranks) - CALIBRATION.phases["precondition"]
    assert broadcasts == pytest.approx(2 * (2 * 5e-5 + 1e-9 * gradients + 1e-4 + 2e-9 * 4), rel=1e-9)
    assert comm.overhead == max(sum(r.values()) for r in comm.ranks)


def test_one_sided_blocks_weigh_the_side_they_keep() -> None:
    """With ``eigenbasis_max_dim`` 256 the intermediate layers keep only their input side (129) and the output
    layers only their output side (128): each rank's share of the factors' running averages and of the
    decompositions is by the sides it holds, weighted ``dim^2`` and ``dim^3`` of the kept sides (restated here from
    the layer shapes), never by a dropped side's size."""
    plan = tiny_plan(3, ("mem-opt",), eigenbasis_moments=True, eigenbasis_max_dim=256)  # 3: unequal shares
    (placement,) = predict_plan(plan, CALIBRATION)

    def kept(b: object) -> dict[str, int]:
        return {s: d for s, d in (("A", b.adapter.a_dim), ("G", b.adapter.g_dim)) if d <= 256}

    assert {tuple(kept(b)) for b in plan.blocks} == {("A", "G"), ("A",), ("G",)}
    for phase, power in (("factors", 2), ("decompose", 3)):
        total = sum(d**power for b in plan.blocks for d in kept(b).values())
        shares = []
        for roles, predicted in zip(plan.placements[0].roles, placement.ranks):
            held = roles.stores_factor if phase == "factors" else (lambda b, s: roles.decomposes(b.name, s))
            mine = sum(d**power for b in plan.blocks for s, d in kept(b).items() if held(b, s))
            assert predicted[phase] == pytest.approx(CALIBRATION.phases[phase] * mine / total, rel=1e-9)
            shares.append(mine / total)
        assert sum(shares) == pytest.approx(1.0) and min(shares) > 0.1  # mem-opt: each side on one rank, all busy


def test_zero3_pays_its_two_all_to_alls() -> None:
    """At ZeRO 3 (mem-opt only) every rank takes part in two all-to-alls a step (the gradients' slices to each
    layer's worker, ``P(g)``'s back), costed by the all-to-all link on the bytes the planner counts for the rank; a
    calibration without that link is refused, naming it, and the other placements are refused as ``initialize``
    refuses them."""
    config = {**BERT_TINY, "zero_optimization": {"stage": 3}, "kfac": {**BERT_TINY["kfac"], "inv_update_steps": 10}}
    job = read_job({**config, "gradient_accumulation_steps": 1}, 4)
    model, groups = bert_on_meta(bert_config(job.bert["model"], job.bert))
    plan = plan_job(model, job, FRACTIONS, ["allreduce"], groups)
    assert [p.fraction for p in plan.placements if not p.refused] == ["mem-opt"]
    link = Link(3e-4, 4e-9)
    with_link = dataclasses.replace(CALIBRATION, links={**CALIBRATION.links, "all_to_all": link})
    without = predict_plan(plan, dataclasses.replace(CALIBRATION, network="latency=0,bandwidth=1e30"))[-1]
    placed = predict_plan(plan, with_link)[-1]
    mem = plan.placements[-1]
    for rank, cost in enumerate(mem.ranks):
        sent = cost.every_step["all_to_all"]
        assert sent > 0
        paid = placed.ranks[rank]["precondition"] - without.ranks[rank]["precondition"]
        assert paid == pytest.approx(2 * link.latency + link.per_byte * sent + 1e-4 + 2e-9 * 4, rel=1e-9)
    with pytest.raises(ValueError, match="the calibration has no all_to_all link"):
        predict_plan(plan, CALIBRATION)


def test_a_saved_calibration_reads_back(tmp_path: Path) -> None:
    CALIBRATION.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == CALIBRATION


def test_calibrate_on_two_ranks_under_a_simulated_network(tmp_path: Path) -> None:
    """``--calibrate`` on 2 launched ranks of BERT 2x128: the links it fits carry the simulated network (a ring
    all-reduce at 2 ranks costs ``2 alpha + n / B``, a broadcast ``alpha + n / B``, on top of this machine's own
    far faster transfer; an all-to-all at least ``alpha + n / B`` of the ``n`` bytes a rank sends, gloo's own being
    slow), and the placement it recommends is the prediction's fastest, from the saved file."""
    config = {**BERT_TINY, "kfac": {**BERT_TINY["kfac"], "factor_update_steps": 1, "inv_update_steps": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    saved, log = tmp_path / "calibration.json", tmp_path / "log.txt"
    alpha, bandwidth = 2e-3, 1e8
    args = ["--calibrate", "--calibrate-steps", "2", "--deepspeed_config", str(tmp_path / "ds.json")]
    os.environ[network.ENV] = f"latency={alpha},bandwidth={bandwidth}"
    try:
        launch.deepspeed_script(2, [str(WORKER), *args, "--save-calibration", str(saved)], 180, log)
    finally:
        del os.environ[network.ENV]
    calibration = Calibration.load(saved)
    assert calibration.world == 2 and set(calibration.links) == {"all_reduce", "broadcast", "all_to_all"}
    for kind, hops in (("all_reduce", 2), ("broadcast", 1)):  # plus this machine's own transfer, and its noise
        link = calibration.links[kind]
        assert hops * alpha - 1e-3 <= link.latency < hops * alpha + 5e-3, (kind, link)
        assert 0.9 / bandwidth <= link.per_byte < 1 / bandwidth + 5e-9, (kind, link)
    (smallest, seconds), *_ = calibration.samples["all_to_all"]  # gloo's own all-to-all is slow on CPU: bounds only
    assert smallest == 2048 and seconds >= alpha and calibration.links["all_to_all"].per_byte >= 0.9 / bandwidth
    assert calibration.phases["hooks"] > 0 and calibration.phases["precondition"] > 0
    out = log.read_text()
    best = min(predict_plan(tiny_plan(2, inv_update_steps=2), calibration), key=lambda t: t.overhead)
    assert f"Recommended: grad_worker_fraction {best.fraction!r}, factor_reduction 'allreduce'" in out
    assert torch.isfinite(torch.tensor(best.overhead))


def test_the_command_predicts_from_a_saved_calibration_on_a_stated_network(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--calibration FILE --world 4``: a table of every placement and a recommendation, the fastest at the
    configured reduction; ``--network`` prices the collectives by the stated network instead of the measured links
    (a slower network, a slower prediction), and a malformed one is named."""
    from ds_kfac.planning.cli import main

    config = {**BERT_TINY, "kfac": {**BERT_TINY["kfac"], "factor_update_steps": 1, "inv_update_steps": 10}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    CALIBRATION.save(tmp_path / "c.json")
    args = ["--deepspeed_config", str(tmp_path / "ds.json"), "--world", "4", "--calibration", str(tmp_path / "c.json")]

    def overheads(*extra: str) -> dict[str, float]:
        main([*args, *extra])
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if re.match(r"(comm|hybrid|mem)-opt \(n=\d\) allreduce", line)]
        got = {line.split(" (")[0]: float(line.split()[-2].replace(",", "")) for line in rows[-3:]}
        best = min(got, key=got.get)
        assert f"Recommended: grad_worker_fraction '{best}', factor_reduction 'allreduce'" in out
        return got

    measured, slow = overheads(), overheads("--network", "latency=1e-3,bandwidth=1e7")
    assert set(measured) == {"comm-opt", "hybrid-opt", "mem-opt"}
    assert all(slow[f] > measured[f] for f in measured)
    with pytest.raises(SystemExit, match="--network: .*bandwidth is not a number"):
        main([*args, "--network", "latency=1e-3,bandwidth=fast"])
