"""``"grad_worker_fraction": "auto"``: the config's rules, the choice (the plan command's recommendation, from the
calibration), the calibrations it refuses, and the checkpoint's record of the choice. The choice on 2 launched
ranks, its training and a resume that chooses otherwise: test_deepspeed.py (:func:`auto_scenarios`)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_calibration import CALIBRATION
from test_plan import BERT_TINY
from workers import problem

from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner
from ds_kfac.planning import FRACTIONS, plan_job, read_job
from ds_kfac.planning.auto import choose_fraction
from ds_kfac.planning.models import bert_config, bert_on_meta
from ds_kfac.planning.predict import Calibration, Link, layer_shapes, predict_plan

TINY = {**BERT_TINY, "kfac": {**BERT_TINY["kfac"], "factor_update_steps": 1, "inv_update_steps": 10}}


def auto_config(path: Path, **ds: object) -> dict:
    return {**TINY, **ds, "kfac": {**TINY["kfac"], "grad_worker_fraction": "auto", "calibration": str(path)}}


def tiny_model() -> tuple[torch.nn.Module, list]:
    return bert_on_meta(bert_config(TINY["bert"]["model"], TINY["bert"]))


def calibration_of(model: torch.nn.Module, kfac: dict, **changes: object) -> Calibration:
    """:data:`test_calibration.CALIBRATION` as measured on ``model`` (its layers), with ``changes``."""
    shapes = layer_shapes(model, KFACConfig.parse(kfac))
    return dataclasses.replace(CALIBRATION, layers=shapes, **changes)


HEAVY_PRECONDITION = {"phases": {"precondition": 1.0}, "links": {"all_reduce": Link(0, 0), "broadcast": Link(0, 0)}}
"""Preconditioning is all the cost and the network is free: fewer gradient workers per layer are faster."""
SLOW_BROADCAST = {"phases": {"precondition": 1e-3}, "links": {"all_reduce": Link(0, 0), "broadcast": Link(1.0, 0)}}
"""Every broadcast costs a second: one gradient worker per layer broadcasts ``P(g)`` every step, comm-opt only the
decompositions every 10 steps."""


def test_auto_needs_a_calibration_and_a_calibration_needs_auto() -> None:
    assert KFACConfig.parse({"grad_worker_fraction": "auto", "calibration": "c.json"}).calibration == "c.json"
    with pytest.raises(KFACConfigError, match=r"kfac.calibration: grad_worker_fraction 'auto' needs the path"):
        KFACConfig.parse({"grad_worker_fraction": "auto"})
    for section in ({"calibration": "c.json"}, {"grad_worker_fraction": 0.5, "calibration": "c.json"}):
        with pytest.raises(KFACConfigError, match=r"kfac.calibration: is read only with grad_worker_fraction 'auto'"):
            KFACConfig.parse(section)
    with pytest.raises(KFACConfigError, match=r"kfac.grad_worker_fraction: must be .*'auto'"):
        KFACConfig.parse({"grad_worker_fraction": "automatic"})


def test_a_preconditioner_built_directly_refuses_auto() -> None:
    """Only ``ds_kfac.initialize`` knows the job the calibration predicts for."""
    with pytest.raises(KFACConfigError, match=r"'auto' is chosen by ds_kfac.initialize from kfac.calibration"):
        KFACPreconditioner(problem.make_model(), lr=0.1, grad_worker_fraction="auto", calibration="c.json")


@pytest.mark.parametrize("world", [2, 4])
def test_auto_chooses_what_the_plan_command_recommends(
    tmp_path: Path, capsys: pytest.CaptureFixture, world: int
) -> None:
    """The choice is the fastest preset of the prediction (recomputed here from ``predict_plan``), the one
    ``python -m ds_kfac.plan`` recommends for the same config (its ``kfac.calibration``) and world; the network moves it as the
    costs say: with a free network and costly preconditioning one gradient worker per layer, with slow broadcasts
    comm-opt."""
    from ds_kfac.planning.cli import main

    model, groups = tiny_model()
    chosen = {}
    for name, changes in (("heavy", HEAVY_PRECONDITION), ("slow", SLOW_BROADCAST)):
        path = tmp_path / f"{name}.json"
        calibration_of(model, TINY["kfac"], **changes).save(path)
        config = auto_config(path)
        choice = choose_fraction(config, model, world, groups)
        plan = plan_job(model, read_job(config, world), FRACTIONS, ["allreduce"], groups)
        times = {t.fraction: t.overhead for t in predict_plan(plan, Calibration.load(path))}
        assert choice.predicted == times
        assert times[choice.fraction] == min(times.values())
        (tmp_path / "ds.json").write_text(json.dumps(config))
        main(["--deepspeed_config", str(tmp_path / "ds.json"), "--world", str(world)])  # kfac.calibration's
        out = capsys.readouterr().out
        assert f"Recommended: grad_worker_fraction {choice.fraction!r}," in out
        assert f"(kfac.grad_worker_fraction 'auto' chooses this fraction at start-up, from {path})" in out
        assert re.fullmatch(
            rf"kfac.grad_worker_fraction 'auto' chose '{choice.fraction}' at {world} data-parallel ranks: predicted "
            rf"K-FAC ms a step comm-opt [\d,.]+, hybrid-opt [\d,.]+, mem-opt [\d,.]+ \(calibration {path}, measured "
            rf"on 2 x cpu\)",
            choice.describe(),
        )
        chosen[name] = choice.fraction
    assert chosen["slow"] == "comm-opt"
    assert chosen["heavy"] == "mem-opt" if world == 4 else chosen["heavy"] in ("hybrid-opt", "mem-opt")  # n=1 both


def test_auto_refuses_a_calibration_it_cannot_use(tmp_path: Path) -> None:
    """A missing or malformed file, one saved without its layers, and one of another model are named, with the
    command that saves a usable one; at ZeRO 3 mem-opt is the only placement and the file is not read."""
    model, groups = tiny_model()
    missing = tmp_path / "missing.json"
    with pytest.raises(KFACConfigError, match=rf"kfac.calibration='{missing}': cannot read .*--save-calibration"):
        choose_fraction(auto_config(missing), model, 2, groups)
    broken = tmp_path / "broken.json"
    broken.write_text('{"device": "cpu"}')
    lacks = r"broken.json': cannot read a calibration there \(ValueError: not a saved calibration: missing \['world'"
    with pytest.raises(KFACConfigError, match=lacks):
        choose_fraction(auto_config(broken), model, 2, groups)
    CALIBRATION.save(tmp_path / "old.json")
    with pytest.raises(KFACConfigError, match=r"old.json' does not record the layers it measured"):
        choose_fraction(auto_config(tmp_path / "old.json"), model, 2, groups)
    other = {**TINY["kfac"], "skip_layers": ["^cls\\.", "pooler", "intermediate"]}  # two layers fewer
    calibration_of(model, other).save(tmp_path / "other.json")
    extra = r"not in it \[\(129, 512\), \(129, 512\)\], in it and not in this model \[\] \(12 layers here, 10 there\)"
    with pytest.raises(KFACConfigError, match=r"other.json' measured another model: .* " + extra):
        choose_fraction(auto_config(tmp_path / "other.json"), model, 2, groups)
    stage3 = choose_fraction(auto_config(missing, zero_optimization={"stage": 3}), model, 2, groups)
    assert stage3.fraction == "mem-opt" and "ZeRO stage 3 runs mem-opt only" in stage3.describe()


def test_the_checkpoint_keeps_the_choice_across_a_resume() -> None:
    """A state saved by a run whose ``"auto"`` chose mem-opt loads where ``"auto"`` chooses mem-opt again or the
    config names any fraction, and is refused, naming the saved choice and the fix, where ``"auto"`` chose comm-opt.
    A run naming its fraction records no choice."""

    def preconditioner(fraction: str, calibration: str | None) -> KFACPreconditioner:
        config = KFACConfig.parse({"grad_worker_fraction": fraction})  # as initialize leaves a chosen config
        return KFACPreconditioner(problem.make_model(), config.model_copy(update={"calibration": calibration}), lr=0.1)

    saved = preconditioner("mem-opt", "a.json").state_dict()
    assert saved["auto_placement"] == {"grad_worker_fraction": "mem-opt", "calibration": "a.json"}
    assert preconditioner("mem-opt", None).state_dict()["auto_placement"] is None
    for fraction, calibration in (("mem-opt", "b.json"), ("comm-opt", None), ("hybrid-opt", None)):
        preconditioner(fraction, calibration).load_state_dict(saved)
    with pytest.raises(ValueError) as err:
        preconditioner("comm-opt", "b.json").load_state_dict(saved)
    assert (
        "saved by a run whose grad_worker_fraction 'auto' chose 'mem-opt' (from calibration 'a.json'), this run's "
        "chose 'comm-opt' (from 'b.json'): to resume on the saved placement, set \"grad_worker_fraction\": "
        '"mem-opt" in place of "auto"' in str(err.value)
    )
    with pytest.raises(ValueError, match=r"'auto_placement' must be None or a dict"):
        preconditioner("mem-opt", None).load_state_dict({**saved, "auto_placement": "mem-opt"})
