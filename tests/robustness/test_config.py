"""Configuration robustness (issue 14): strict JSON types and schedules (item 10), Python schedules checked at run
time (item 5), near-miss top-level keys (item 9a)."""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from typing import Any, Callable

import launch
import pytest
import torch
from torch import nn

import ds_kfac
from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner, PiecewiseSchedule
from ds_kfac.config.schema import SCHEDULED
from ds_kfac.easgd import EASGDConfig

pytestmark = pytest.mark.timeout(120)

MILESTONES = "schedule milestones must be a list of non-negative, strictly increasing integers"

# section -> the message line it must give (after "invalid K-FAC config:\n  ").
MALFORMED_SCHEDULES = {
    "milestones a string": (
        {"damping": {"milestones": "10", "values": [0.1, 0.01]}},
        rf"kfac\.damping: {MILESTONES}, not '10' \(got {{'milestones': '10', 'values': \[0\.1, 0\.01\]}}\)",
    ),
    "milestones null": ({"damping": {"milestones": None, "values": [0.1]}}, rf"kfac\.damping: {MILESTONES}, not None"),
    "milestones not increasing": (
        {"kl_clip": {"milestones": [10, 10], "values": [0.1, 0.2, 0.3]}},
        rf"kfac\.kl_clip: {MILESTONES}, not \[10, 10\]",
    ),
    "milestones decreasing": (
        {"kl_clip": {"milestones": [10, 5], "values": [0.1, 0.2, 0.3]}},
        rf"kfac\.kl_clip: {MILESTONES}, not \[10, 5\]",
    ),
    "milestone not integral": (
        {"factor_decay": {"milestones": [2.5], "values": [0.9, 0.5]}},
        rf"kfac\.factor_decay: {MILESTONES}, not \[2\.5\]",
    ),
    "milestone a bool": (
        {"inv_update_steps": {"milestones": [True], "values": [1, 2]}},
        rf"kfac\.inv_update_steps: {MILESTONES}, not \[True\]",
    ),
    "milestone negative": (
        {"factor_update_steps": {"milestones": [-1], "values": [1, 2]}},
        rf"kfac\.factor_update_steps: {MILESTONES}, not \[-1\]",
    ),
    "milestone a string": (
        {"damping": {"milestones": ["5"], "values": [0.1, 0.2]}},
        rf"kfac\.damping: {MILESTONES}, not \['5'\]",
    ),
    "values null": (
        {"damping": {"milestones": [5], "values": None}},
        r"kfac\.damping: a piecewise schedule needs a list of len\(values\) == len\(milestones\) \+ 1 values, "
        r"not values=None with 1 milestones",
    ),
    "values too few": (
        {"damping": {"milestones": [5, 9], "values": [0.1, 0.2]}},
        r"kfac\.damping: .*len\(values\) == len\(milestones\) \+ 1 values, not values=\[0\.1, 0\.2\] with 2 milestones",
    ),
    "value a string": (
        {"damping": {"milestones": [5], "values": ["0.1", 0.01]}},
        r"kfac\.damping: schedule values \['0\.1'\] are not allowed: each must be a number > 0",
    ),
    "value out of the key's range": (
        {"factor_decay": {"milestones": [5], "values": [0.9, 1.0]}},
        r"kfac\.factor_decay: schedule values \[1\.0\] are not allowed: each must be a number in \[0, 1\)",
    ),
    "value not integral for an integer key": (
        {"inv_update_steps": {"milestones": [5], "values": [10, 2.5]}},
        r"kfac\.inv_update_steps: schedule values \[2\.5\] are not allowed: each must be an integer >= 1",
    ),
    "gamma a string": (
        {"damping": {"initial": 0.1, "milestones": [5], "gamma": "0.5"}},
        r"kfac\.damping: schedule 'gamma' must be a number, not '0\.5' \(got \{'initial': 0\.1, ",
    ),
    "initial a string": (
        {"kl_clip": {"initial": "0.1", "milestones": [5], "gamma": 0.5}},
        r"kfac\.kl_clip: schedule 'initial' must be a number, not '0\.1'",
    ),
    "initial a bool": (
        {"kl_clip": {"initial": True, "milestones": [5], "gamma": 0.5}},
        r"kfac\.kl_clip: schedule 'initial' must be a number, not True",
    ),
    "decay without gamma": (
        {"damping": {"initial": 0.1, "milestones": [5]}},
        r"kfac\.damping: a schedule is \{'milestones': \[\.\.\.\], 'values': \[\.\.\.\]\} or "
        r"\{'initial': x, 'milestones': \[\.\.\.\], 'gamma': g\} \(got \{'initial': 0\.1, 'milestones': \[5\]\}\)",
    ),
    "decay with a null milestone list": (
        {"damping": {"initial": 0.1, "milestones": None, "gamma": 0.5}},
        rf"kfac\.damping: {MILESTONES}, not None",
    ),
    "python schedule with a bad value": (
        {"damping": PiecewiseSchedule((2,), (0.1, -1.0))},
        r"kfac\.damping: schedule values \[-1\.0\] are not allowed: each must be a number > 0",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED_SCHEDULES))
def test_malformed_schedule_names_key_value_and_allowed(case: str) -> None:
    """issue 14, item 10: a malformed schedule field is one KFACConfigError naming kfac.<key>, the bad value and what
    is allowed (before: raw TypeErrors/KeyErrors without the key, or silently accepted milestones)."""
    section, line = MALFORMED_SCHEDULES[case]
    with pytest.raises(KFACConfigError) as caught:
        KFACConfig.parse(section)
    message = str(caught.value)
    assert message.startswith("invalid K-FAC config:\n  ") and message.count("\n") == 1, message
    assert re.match(line, message.split("\n  ", 1)[1]), message


def test_valid_json_schedules_resolve_to_the_documented_values() -> None:
    """issue 14, item 10: the checks keep every documented schedule form, including integral floats for integer keys
    (converted to int), and the values at each step are the documented ones."""
    config = KFACConfig.parse(
        {
            "damping": {"milestones": [2, 4], "values": [0.3, 0.2, 0.1]},
            "kl_clip": {"initial": 0.01, "milestones": [1, 3.0], "gamma": 0.5},
            "inv_update_steps": {"milestones": [3], "values": [2.0, 5]},
            "factor_decay": {"milestones": [], "values": [0]},
        }
    )
    steps = range(6)
    assert [config.at("damping", s) for s in steps] == [0.3, 0.3, 0.2, 0.2, 0.1, 0.1]
    assert [config.at("kl_clip", s) for s in steps] == [0.01, 0.005, 0.005, 0.0025, 0.0025, 0.0025]
    intervals = [config.at("inv_update_steps", s) for s in steps]
    assert intervals == [2, 2, 2, 5, 5, 5] and all(type(i) is int for i in intervals)
    assert config.at("factor_decay", 9) == 0.0 and type(config.at("factor_decay", 9)) is float


# key -> values of the wrong type. Every field of KFACConfig is listed (checked below).
WRONG_TYPES: dict[str, list[Any]] = {
    "enabled": ["no", "true", 1, 0, None],
    "factor_update_steps": [True, "10", None, [1]],
    "inv_update_steps": [True, "10", None],
    "adaptive_threshold": [True, "0.1", None],
    "damping": ["0.1", True, None],
    "relative_damping": ["yes", 1],
    "grafting": [True, None, 1],
    "factor_decay": ["0.9", False],
    "kl_clip": ["0.01", True],
    "compute_method": [True, 1, ["eigen"]],
    "eigenvalue_outer_product": ["yes", 1],
    "eigenvalue_correction": ["yes", 1, None],
    "eigenbasis_moments": ["yes", 1, None],
    "eigenbasis_max_dim": ["768", True, 768.5, [768]],
    "tied_layers": [True, None, 1, "yes"],
    "fisher": [True, None, "true_fisher", 1],
    "batchnorm": [True, None, "unitwise", 1],
    "grad_worker_fraction": [True, "0.5", None],
    "calibration": [True, 1, ["c.json"]],
    "factor_reduction": [None, 0],
    "assignment": [1, None],
    "skip_layers": ["pooler", [1], None, {"pooler": 1}],
    "max_factor_dim": ["8192", True, 8192.5, None],
    "conv_factors": [None, 1],
    "tensor_parallel_factors": [None, "full"],
    "factor_dtype": [32, None],
    "inv_dtype": [64, None],
    "symmetric_comm": ["false", 0],
    "overlap_factor_comm": ["true", 1],
    "async_decompositions": ["false", 0],
    "refresh_spread": ["true", 1, None],
    "basis_update": [True, None, "qr", 1],
    "basis_max_drift": ["0.5", True, None],
    "basis_keep_drift": ["0.1", True, None],
    "factor_micro_batches": [True, "4", 2.5, [1]],
}

# key -> values of the right type that were accepted and must stay so (value as stored).
RIGHT_TYPES: dict[str, list[tuple[Any, Any]]] = {
    "max_factor_dim": [(64, 64), (64.0, 64)],
    "grad_worker_fraction": [(1, 1.0), (0.5, 0.5), ("mem-opt", "mem-opt")],
    "adaptive_threshold": [(1, 1.0)],
    "damping": [(1, 1.0)],
    "factor_update_steps": [(3.0, 3)],
    "skip_layers": [(["a", "b"], ["a", "b"])],
    "enabled": [(False, False)],
    "factor_micro_batches": [(4, 4), (4.0, 4), (None, None)],
    "eigenvalue_correction": [(True, True), (False, False)],
    "eigenbasis_moments": [(True, True), (False, False)],
    "fisher": [("sampled", "sampled"), ("empirical", "empirical")],
    "batchnorm": [("unit-wise", "unit-wise"), ("none", "none")],
    "basis_update": [("subspace", "subspace"), ("eigh", "eigh"), ("exact", "exact")],
    "basis_max_drift": [(1, 1.0), (0.25, 0.25)],
    "basis_keep_drift": [(0, 0.0), (0.5, 0.5)],
    "refresh_spread": [(True, True), (False, False)],
    "calibration": [("c.json", "c.json")],
}
RIGHT_TYPE_CONTEXT = {"basis_keep_drift": {"basis_update": "subspace"}, "calibration": {"grad_worker_fraction": "auto"}}
"""The keys another key's value must accompany for a right type to be accepted (a kept basis needs the subspace
refresh, a calibration the fraction it is read for)."""


def test_types_are_strict_for_every_key() -> None:
    """issue 14, item 10: booleans must be JSON booleans, numbers numbers (not bools, not strings), strings strings,
    lists lists, for every key; each refusal names kfac.<key> and the value (before: "yes", "no", 1 and true were
    silently taken for booleans and numbers)."""
    assert set(WRONG_TYPES) == set(KFACConfig.model_fields)
    accepted = []
    for key, values in WRONG_TYPES.items():
        for value in values:
            try:
                KFACConfig.parse({key: value})
            except KFACConfigError as err:
                # A list of the wrong items is reported at its first item: kfac.skip_layers.0 ... (got 1).
                where, shown = (
                    (f"{key}.0", value[0]) if isinstance(value, list) and key == "skip_layers" else (key, value)
                )
                assert re.search(rf"^  kfac\.{where}: .*\(got {re.escape(repr(shown))}\)$", str(err), re.M), err
            else:
                accepted.append((key, value))
    assert accepted == []
    for key, pairs in RIGHT_TYPES.items():
        for value, stored in pairs:
            got = getattr(KFACConfig.parse({**RIGHT_TYPE_CONTEXT.get(key, {}), key: value}), key)
            assert got == stored and type(got) is type(stored), (key, value, got)


# Probes for the shared ranges, and which of them each key allows (an independent statement of docs/config.md).
PROBES = [0, 1, 2, -1, 0.0, 1e-40, 1e-12, 0.5, 0.999, 1.0, 1.5, 10.0, True, False, "1", math.nan, math.inf, -math.inf]
ALLOWED = {
    "factor_update_steps": [1, 2, 1.0, 10.0],
    "inv_update_steps": [1, 2, 1.0, 10.0],
    "damping": [1, 2, 1e-12, 0.5, 0.999, 1.0, 1.5, 10.0],
    "kl_clip": [1, 2, 1e-12, 0.5, 0.999, 1.0, 1.5, 10.0],
    "factor_decay": [0, 0.0, 1e-40, 1e-12, 0.5, 0.999],  # 1e-40 is 0 in float32, a harmless decay
}


def _accepts(make: Callable[[], Any]) -> bool:
    try:
        make()
    except KFACConfigError:
        return False
    return True


def test_callables_are_held_to_the_constants_range() -> None:
    """issue 14, item 5: KFACConfig.at checks a callable's value against exactly the range the schema uses for a
    constant of the same key (one definition of each range)."""
    assert set(SCHEDULED) == set(ALLOWED)
    for key, allowed in ALLOWED.items():
        as_constant = [p for p in PROBES if _accepts(lambda: KFACConfig.parse({key: p}))]
        as_callable = [p for p in PROBES if _accepts(lambda: KFACConfig.parse({key: lambda s: p}).at(key, 7))]
        assert [repr(p) for p in as_constant] == [repr(p) for p in allowed], key
        assert [repr(p) for p in as_callable] == [repr(p) for p in allowed], key


def test_at_names_key_step_and_value() -> None:
    """issue 14, item 5: the run-time message names the key, the step and the value, and what is allowed."""
    config = KFACConfig.parse({"damping": lambda step: 0.0 if step >= 12 else 0.1})
    assert config.at("damping", 11) == 0.1
    with pytest.raises(KFACConfigError) as caught:
        config.at("damping", 12)
    assert str(caught.value) == "kfac.damping: the schedule returned 0.0 at step 12; must be a number > 0"


UNDERFLOW = (
    r"0 or subnormal in float32, the arithmetic it is used in \(whose smallest normal number is 1\.1754944e-38\)"
)
# case -> (parser, section, the message line it must give).
UNDERFLOWING = {
    "damping": (
        KFACConfig.parse,
        {"damping": 1e-50},
        rf"kfac\.damping: 1e-50 is {UNDERFLOW}: use a value >= 1\.1754944e-38 \(got 1e-50\)",
    ),
    "kl_clip": (KFACConfig.parse, {"kl_clip": 1e-39}, rf"kfac\.kl_clip: 1e-39 is {UNDERFLOW}: use a value >= "),
    "adaptive_threshold": (
        KFACConfig.parse,
        {"adaptive_threshold": 5e-45},
        rf"kfac\.adaptive_threshold: 5e-45 is {UNDERFLOW}: use a value >= ",
    ),
    "damping decaying to 1e-62": (
        KFACConfig.parse,
        {"damping": {"initial": 1e-2, "milestones": [100, 200, 300], "gamma": 1e-20}},
        rf"kfac\.damping: schedule values {re.escape(str([1e-2 * 1e-20**2, 1e-2 * 1e-20**3]))} are {UNDERFLOW}: "
        r"each must be >= 1\.1754944e-38 "
        r"\(got \{'initial': 0\.01, ",
    ),
    "piecewise kl_clip": (
        KFACConfig.parse,
        {"kl_clip": {"milestones": [5], "values": [0.01, 1e-45]}},
        rf"kfac\.kl_clip: schedule values \[1e-45\] are {UNDERFLOW}",
    ),
    "easgd rho": (EASGDConfig.parse, {"rho": 1e-40}, rf"easgd\.rho: 1e-40 is {UNDERFLOW}: use a value >= "),
}


@pytest.mark.parametrize("case", list(UNDERFLOWING))
def test_positive_values_that_underflow_in_float32_are_refused(case: str) -> None:
    """issue 22, item 2: a positive value below float32's smallest normal number passes "> 0" but is 0 (or loses its
    precision) in the float32 arithmetic it is used in (the parameters became NaN): refused when parsed, naming
    the key, the value and the bound."""
    parse, section, line = UNDERFLOWING[case]
    with pytest.raises(KFACConfigError) as caught:
        parse(section)
    message = str(caught.value)
    assert message.count("\n") == 1 and re.match(line, message.split("\n  ", 1)[1]), message


def test_a_python_schedule_that_underflows_stops_the_run() -> None:
    """issue 22, item 2: a callable is checked at each use: decaying to 1e-62 at step 2 raises there, naming the
    key, the step and the value; 1.2e-38 (float32's smallest normal number is 1.1754944e-38) is taken."""
    config = KFACConfig.parse({"damping": lambda step: [0.01, 1.2e-38, 1e-62][step]})
    assert config.at("damping", 1) == 1.2e-38
    with pytest.raises(KFACConfigError) as caught:
        config.at("damping", 2)
    expected = rf"kfac\.damping: the schedule returned 1e-62 at step 2, which is {UNDERFLOW}; must be >= 1\.1754944e-38"
    assert re.fullmatch(expected, str(caught.value)), caught.value


GOOD = dict(damping=0.01, kl_clip=0.01, factor_decay=0.9, factor_update_steps=1, inv_update_steps=1)

# case -> (key, value the callable returns from step 2 on, step named, optimizer steps applied before the error).
# factor_update_steps is read when step 1 ends (to arm the hooks of step 2), after step 1's P(g), before its update.
BAD_CALLABLES = {
    "damping zero": ("damping", 0.0, 2, 2),
    "damping negative": ("damping", -1.0, 2, 2),
    "damping a string": ("damping", "0.01", 2, 2),
    "kl_clip negative": ("kl_clip", -0.1, 2, 2),
    "factor_decay one": ("factor_decay", 1.0, 2, 2),
    "factor_update_steps zero": ("factor_update_steps", 0, 2, 1),
    "factor_update_steps not integral": ("factor_update_steps", 2.5, 2, 1),
    "inv_update_steps zero": ("inv_update_steps", 0, 2, 2),
    "inv_update_steps not integral": ("inv_update_steps", 1.5, 2, 2),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _train(model: nn.Module, steps: int, applied: list[int], **keys: Any) -> None:
    """SGD + standalone K-FAC; ``applied`` gets each step whose optimizer update ran."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFACPreconditioner(model, optimizer=optimizer, **{**GOOD, **keys})
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=data, dtype=torch.float64)
        ((model(x) - x[:, :2].sin()) ** 2).mean().backward()
        kfac.step()
        optimizer.step()
        applied.append(step)


@pytest.mark.parametrize("case", list(BAD_CALLABLES))
def test_bad_python_schedule_stops_the_run_before_any_nan(case: str) -> None:
    """issue 14, item 5: a Python schedule returning an invalid value raises KFACConfigError naming the key, the step
    and the value, before any parameter or gradient is touched by it (before: NaN parameters or ZeroDivisionError)."""
    key, bad, step, done = BAD_CALLABLES[case]
    good = GOOD[key]
    model, applied = _model(), []
    allowed = SCHEDULED[key].allowed
    message = f"kfac.{key}: the schedule returned {bad!r} at step {step}; must be {allowed}"
    with pytest.raises(KFACConfigError, match=f"^{re.escape(message)}$"):
        _train(model, 4, applied, **{key: lambda s: good if s < 2 else bad})
    assert applied == list(range(done))
    assert all(p.isfinite().all() and p.grad.isfinite().all() for p in model.parameters())
    reference = _model()  # the same run with the constant: the parameters are those of its first `done` steps
    _train(reference, done, [])
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


# Top-level DeepSpeed sections defined outside deepspeed.runtime.constants.
DEEPSPEED_SECTIONS = [
    "zero_optimization",
    "tensorboard",
    "csv_monitor",
    "wandb",
    "comet",
    "activation_checkpointing",
    "flops_profiler",
    "aio",
    "compression_training",
    "autotuning",
    "elasticity",
    "comms_logger",
    "data_efficiency",
    "curriculum_learning",
    "checkpoint",
    "sparse_attention",
    "nebula",
    "hybrid_engine",
    "weight_quantization",
    "compile",
    "timers",
    "amp",
]


def test_near_miss_keys_are_named_and_deepspeed_keys_are_not() -> None:
    """issue 14, item 9a: the keys taken for a misspelt "kfac", and none of DeepSpeed's own config keys; with a "kfac"
    section, other keys are not second-guessed (its own errors are raised before DeepSpeed starts, as before)."""
    import deepspeed.runtime.constants as ds_constants

    from ds_kfac.integration.initialize import kfac_near_misses

    near = ["kfca", "KFAC", "k-fac", "kfac_config", "K_FAC", "kfc", "Kfac "]
    far = ["kfac", "train_batch_size", "zero_optimization", "fp16", "bf16", "bert", "fac_tor", "optimizer", 3]
    assert kfac_near_misses(near + far) == near
    deepspeed_keys = [v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)]
    assert len(deepspeed_keys) > 50 and "gradient_accumulation_steps" in deepspeed_keys
    deepspeed_keys += DEEPSPEED_SECTIONS
    assert kfac_near_misses(deepspeed_keys) == []
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "kfac": {"damping": -1}, "KFAC": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(KFACConfigError, match=r"kfac\.damping: must be a number > 0"):
            ds_kfac.initialize(model=model, model_parameters=model.parameters(), config=config)


INITIALIZE = """
import json, os, warnings
import torch
from torch import nn
import ds_kfac

torch.set_num_threads(1)
model = nn.Linear(3, 2)
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "KFAC": {"damping": 0.01}, "kfca": {}, "zero_optimization": {"stage": 0}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine, *_ = ds_kfac.initialize(model=model, model_parameters=model.parameters(), config=config)
ours = [(str(w.message), w.filename) for w in caught if w.category is UserWarning and "'kfac'" in str(w.message)]
print("RESULT " + json.dumps({"engine": type(engine).__name__, "kfac": hasattr(engine, "kfac"), "warnings": ours}))
ds_kfac.release_deepspeed_shm()
torch.distributed.destroy_process_group()
"""


def test_initialize_warns_for_each_near_miss_and_runs_plain_deepspeed() -> None:
    """issue 14, item 9a: a config with "KFAC" and "kfca" but no "kfac" gives a plain DeepSpeed engine (as before)
    and one UserWarning per near-miss key, naming it and saying K-FAC is off, pointing at the caller's line.
    One real single-process engine, in a subprocess so this process stays without torch.distributed."""
    (out,) = launch.run([[sys.executable, "-c", INITIALIZE]], timeout=100, env=launch.one_rank_env())
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert result["engine"] == "DeepSpeedEngine" and not result["kfac"]
    expected = [
        f"config key {key!r} looks like a misspelt 'kfac' section; it is not read, and K-FAC is off "
        f'(the section must be named exactly "kfac")'
        for key in ("KFAC", "kfca")
    ]
    assert [message for message, _ in result["warnings"]] == expected
    assert {filename for _, filename in result["warnings"]} == {"<string>"}
