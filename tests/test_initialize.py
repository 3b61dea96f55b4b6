"""ds_kfac.initialize: config validation, refused setups, JSON optimizers, monitoring, checkpoint errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from workers import ds_worker, problem

import ds_kfac

pytestmark = pytest.mark.timeout(300)

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

BAD_SECTIONS = {
    "unknown key": ({"dampnig": 0.1}, r"kfac\.dampnig: unknown key \(allowed keys: enabled, factor_update_steps"),
    "wrong type": ({"enabled": "maybe"}, r"kfac\.enabled: .*boolean.*'maybe'"),
    "out of range": ({"damping": -1}, r"kfac\.damping: must be a number > 0.*\(got -1\)"),
    "interval not integer": ({"inv_update_steps": 2.5}, r"kfac\.inv_update_steps: must be an integer >= 1"),
    "decay out of range": ({"factor_decay": 1.0}, r"kfac\.factor_decay: must be a number in \[0, 1\)"),
    "bad schedule": ({"damping": {"milestones": [10], "values": [0.1]}}, r"len\(values\) == len\(milestones\) \+ 1"),
    "schedule value": ({"kl_clip": {"milestones": [5], "values": [0.1, -2]}}, r"kfac\.kl_clip: schedule values \[-2\]"),
    "compute method": ({"compute_method": "cholesky"}, r"kfac\.compute_method: Input should be 'eigen' or 'inverse'"),
    "outer product with inverse": (
        {"compute_method": "inverse", "eigenvalue_outer_product": True},
        r"kfac\.eigenvalue_outer_product: true needs compute_method 'eigen', this config has compute_method='inverse'",
    ),
    "fraction": ({"grad_worker_fraction": 1.5}, r"kfac\.grad_worker_fraction: must be in \(0, 1\]"),
    "reduction": (
        {"factor_reduction": "scatter"},
        r"kfac\.factor_reduction: Input should be 'allreduce', 'reduce' or 'local'",
    ),
    "regex": ({"skip_layers": ["("]}, r"kfac\.skip_layers: '\(' is not a valid regular expression"),
    "dtype": ({"inv_dtype": "float16"}, r"kfac\.inv_dtype: Input should be 'float32' or 'float64'"),
    "not an object": (["damping"], r"'kfac' must be a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_SECTIONS))
def test_bad_kfac_section_names_key_value_and_allowed(case: str) -> None:
    """Validation runs first, on every rank, before DeepSpeed or torch.distributed is touched."""
    section, message = BAD_SECTIONS[case]
    model = problem.make_model()
    with pytest.raises(ds_kfac.KFACConfigError, match=message):
        ds_kfac.initialize(model=model, model_parameters=model.parameters(), config={**BASE, "kfac": section})


def test_two_configs_and_no_config_refused(tmp_path: Path) -> None:
    model = problem.make_model()
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json"))
    with pytest.raises(ValueError, match="two DeepSpeed configs given"):
        ds_kfac.initialize(args=args, model=model, config=BASE)
    with pytest.raises(ValueError, match="no DeepSpeed config"):
        ds_kfac.initialize(model=model)


TOP_LEVELS = {
    "list": ("[1, 2]", "a list: [1, 2]"),
    "number": ("3", "an integer: 3"),
    "float": ("0.5", "a number: 0.5"),
    "string": ('"configs/resnet_kfac_cpu.json"', 'a string: "configs/resnet_kfac_cpu.json"'),
    "null": ("null", "null"),
}


@pytest.mark.parametrize("case", list(TOP_LEVELS))
def test_a_config_file_whose_top_level_is_no_object_is_named(tmp_path: Path, case: str) -> None:
    """A JSON file whose top level is a list, a number, a string or null, given as ``config=`` or as
    ``--deepspeed_config``: one ``ValueError`` naming the file and what it holds, before anything starts (before: a
    ``TypeError`` or ``AttributeError`` from ``"kfac" in config`` and ``config.pop``)."""
    text, shown = TOP_LEVELS[case]
    path = tmp_path / "ds.json"
    path.write_text(text)
    model = problem.make_model()
    expected = f"the DeepSpeed config {path} must be a JSON object (keys and values), got {shown}"
    for given in ({"config": str(path)}, {"args": argparse.Namespace(deepspeed_config=str(path))}):
        with pytest.raises(ValueError) as caught:
            ds_kfac.initialize(model=model, **given)
        assert str(caught.value) == expected


@pytest.mark.parametrize("config", [[1, 2], 3, "damping", (0.1,)], ids=["list", "number", "string", "tuple"])
def test_a_standalone_config_of_another_kind_is_named(config: object) -> None:
    """``KFACPreconditioner(config=...)`` that is neither a dict of the keys nor a ``KFACConfig`` (before: a
    ``TypeError`` from unpacking it)."""
    with pytest.raises(ds_kfac.KFACConfigError, match=r'config=\.\.\.\) must be a dict of the "kfac" keys or a KFACC'):
        ds_kfac.KFACPreconditioner(problem.make_model(), config=config, lr=0.1)


SECTIONS_OF_ANOTHER_KIND = {
    "optimizer": ({"optimizer": ["SGD"]}, 'optimizer must be a JSON object (keys and values), got a list: ["SGD"]'),
    "optimizer_params": (
        {"optimizer": {"type": "SGD", "params": [0.1]}},
        "optimizer.params must be a JSON object (keys and values), got a list: [0.1]",
    ),
    "moments_params": (
        {"optimizer": {"type": "AdamW", "params": 0.01}, "kfac": {"eigenbasis_moments": True}},
        "optimizer.params must be a JSON object (keys and values), got a number: 0.01",
    ),
    "zero": ({"zero_optimization": 2}, "zero_optimization must be a JSON object (keys and values), got an integer: 2"),
    "muon_zero": (
        {"optimizer": {"type": "Muon", "params": {}}, "kfac": {"eigenbasis_moments": True}, "zero_optimization": []},
        "zero_optimization must be a JSON object (keys and values), got a list: []",
    ),
    "muon_bf16": (
        {"optimizer": {"type": "Muon", "params": {}}, "kfac": {"eigenbasis_moments": True}, "bf16": "on"},
        'bf16 must be a JSON object (keys and values), got a string: "on"',
    ),
}


@pytest.mark.parametrize("case", list(SECTIONS_OF_ANOTHER_KIND))
def test_sections_ds_kfac_reads_of_another_kind_are_named(one_rank: None, case: str) -> None:
    """The sections ``initialize`` reads itself to build the JSON optimizer (its ``params``, the ZeRO stage, bf16):
    one ``ValueError`` naming the section and what it holds (before: ``AttributeError: 'list' object has no attribute
    'get'`` and ``TypeError``s)."""
    extra, message = SECTIONS_OF_ANOTHER_KIND[case]
    model = problem.make_model()
    config = {**BASE, "kfac": {}, **extra}
    with pytest.raises(ValueError) as caught:
        ds_kfac.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert str(caught.value) == f"the DeepSpeed config: {message}"


def test_add_config_arguments_mirrors_deepspeed(tmp_path: Path) -> None:
    parser = ds_kfac.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "c.json")])
    assert args.deepspeed and args.deepspeed_config.endswith("c.json")


REFUSED = {
    "zero3 parameter offload": (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "ZeRO offload_param",
    ),
    "offload": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "ZeRO offload_optimizer",
    ),
    "fp16 stage 0": ({"fp16": {"enabled": True}}, "fp16 with ZeRO stage 0"),
    "BF16_Optimizer": (
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
        "BF16_Optimizer",
    ),
    "unmanaged accumulation": ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation=false"),
}


def test_setups_and_checkpoints_through_real_engines(tmp_path: Path, one_rank: None) -> None:
    """One rank, this process (ds_worker's scenarios, as a 1-rank launch runs them): refused setups, JSON LAMB under
    ZeRO 2 on CPU, the disabled section, DeepSpeed's CSV monitor, and the errors of loading a checkpoint that does
    not fit."""
    ckpt_plain, ckpt_kfac = str(tmp_path / "plain"), str(tmp_path / "kfac")
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}}
    scenarios = [{"ds": ds, "steps": 1, "expect_error": True} for ds, _ in REFUSED.values()] + [
        {"ds": {**lamb, "zero_optimization": {"stage": 2}}, "steps": 2},
        {"ds": {"kfac": {"enabled": False}}, "steps": 2, "save": {"dir": ckpt_plain, "at": 2}},
        {
            "ds": monitor,
            "kfac": {"skip_layers": ["^4$"], "inv_update_steps": "adaptive"},
            "steps": 2,
            "save": {"dir": ckpt_kfac, "at": 2},
        },
        {"steps": 3, "load": ckpt_plain, "expect_error": True},
        {"steps": 3, "load": ckpt_kfac, "expect_error": True},
    ]
    ds_kfac.init_distributed()
    results = [ds_worker.run(scenario) for scenario in scenarios]
    refused, (lamb_run, disabled, monitored, no_state, mismatch) = results[: len(REFUSED)], results[len(REFUSED) :]
    for (_, message), result in zip(REFUSED.values(), refused):
        assert result["error"] is not None and "KFACConfigError" in result["error"] and message in result["error"]
    assert lamb_run["optimizer"] == "Lamb" and lamb_run["engine"] == "KFACEngine"
    assert all(torch.isfinite(p).all() for p in lamb_run["params"])
    assert disabled["engine"] == "DeepSpeedEngine" and disabled["kfac"] is None
    nu_rows = (tmp_path / "csv" / "job" / "kfac_nu.csv").read_text().splitlines()
    assert nu_rows[0] == "step,nu" and len(nu_rows) == 3
    assert all(0.0 < float(row.split(",")[1]) <= 1.0 for row in nu_rows[1:])
    assert monitored["kfac"]["steps"] == 2
    steps = (tmp_path / "csv" / "job" / "kfac_steps.csv").read_text().splitlines()
    assert steps == ["step,steps", "4,1.0", "8,2.0"]  # K-FAC's step count after each step
    intervals = (tmp_path / "csv" / "job" / "kfac_interval_0.A.csv").read_text().splitlines()
    assert intervals == ["step,0.A", "4,1.0", "8,1.0"]  # DeepSpeed logs at global_samples (4 per step)
    assert "has no K-FAC state" in no_state["error"] and "load_optimizer_states=False" in no_state["error"]
    assert "missing from the checkpoint ['4']" in mismatch["error"]
