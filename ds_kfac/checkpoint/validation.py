"""What a saved K-FAC state must hold, checked whole before any of it is installed.

:meth:`KFACPreconditioner.load_state_dict` (and ``KFACEngine.load_checkpoint``,
before DeepSpeed loads anything) checks a state against what the preconditioner
expects: the version, the method keys, the layer set, every tensor's type,
dtype family (floating point), shape and finiteness, the step count and
counters (non-negative ints), the adaptive-refresh schedule and the pending
decompositions. One ``ValueError`` names every problem, and nothing is written
unless there is none: a NaN loaded into a factor would make every later step
non-finite (under ZeRO 2, skipped as an overflow forever), and a malformed
entry would fail at the next step with part of the state already replaced.
Every rank checks the whole state, so all ranks refuse or accept it together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ..config import KFACConfig
from ..curvature.decomposition import Shape
from ..curvature.numerics import finite_flags
from ..curvature.refresh import factor_name
from .record import (
    AUTO_PLACEMENT_KEYS,
    DECOMPOSITION,
    METHOD_KEYS,
    MOMENT_KEYS,
    MOMENTS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    SHAPE,
    STATE_VERSION,
    layer_keys,
    references_key,
)


class ExpectedLayer(NamedTuple):
    """A layer's sizes (its gradient matrix is ``g_dim x a_dim``), the shape of each running statistic, the
    statistics decomposed on their own ranks (its sides), and its method and the shapes of its decomposition's
    tensors (side after side)."""

    a_dim: int
    g_dim: int
    statistics: dict[str, Shape]
    sides: tuple[str, ...]
    method: str
    state_shapes: list[Shape]


@dataclass(frozen=True)
class ExpectedState:
    """What a state must hold to load into one preconditioner."""

    method_keys: dict[str, Any]
    """This run's value of each of :data:`METHOD_KEYS`."""
    layers: dict[str, ExpectedLayer]
    adaptive: bool
    """Whether decompositions refresh adaptively (the state then holds the schedule and each side's references)."""
    moments: bool = False
    """Whether each layer holds its eigenbasis moments (``eigenbasis_moments``)."""
    auto_placement: Optional[dict[str, Any]] = None
    """What ``"grad_worker_fraction": "auto"`` chose for this run (:data:`~.record.AUTO_PLACEMENT_KEYS`), or ``None``."""


@dataclass(frozen=True)
class CheckedState:
    """A state that :func:`check_state` accepted for ``setup``: installing it needs no second check."""

    state: dict[str, Any]
    setup: ExpectedState


def check_state(state: Any, setup: ExpectedState) -> CheckedState:
    """``state`` (from ``KFACPreconditioner.state_dict()``) checked against ``setup``; a state
    already checked for this setup is returned as it is. Raises one ``ValueError`` naming every
    problem: first those that say the state is from another run setup (version, method keys,
    layer set, refresh mode), else every malformed or non-finite entry."""
    if isinstance(state, CheckedState):
        if state.setup == setup:
            return state
        state = state.state
    if not isinstance(state, dict):
        raise ValueError(f"K-FAC state must be a dict (KFACPreconditioner.state_dict()), got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"K-FAC state has version {state.get('version')!r}, expected {STATE_VERSION}")
    for find_problems in (_setup_problems, _content_problems):  # the second assumes the first found none
        problems = find_problems(state, setup)
        if problems:
            raise ValueError("K-FAC state not loaded (nothing was changed): " + "; ".join(problems))
    return CheckedState(state, setup)


def _setup_problems(state: dict[str, Any], setup: ExpectedState) -> list[str]:
    """Differences in what the state was saved for: its keys, method keys, layers and refresh mode."""
    problems = _key_problems("the state", state, REQUIRED_KEYS, REQUIRED_KEYS + OPTIONAL_KEYS + METHOD_KEYS)
    for key, now in setup.method_keys.items():
        # A checkpoint from before a key existed was saved with its default.
        then = state.get(key, KFACConfig.model_fields[key].default)
        if then != now:
            problems.append(f"saved with {key}={then!r}, this run uses {now!r}")
    layers = state.get("layers", {})
    if not isinstance(layers, dict):
        problems.append(f"'layers' must be a dict of layer name to entry, got {_describe(layers)}")
    elif "layers" in state and set(layers) != set(setup.layers):
        saved, here = set(layers), set(setup.layers)
        problems.append(
            f"does not match this model's layers: missing from the checkpoint {sorted(here - saved)}, "
            f"not in this model {sorted(saved - here, key=str)}"
        )
    problems += _placement_problems(state.get("auto_placement"), setup.auto_placement)
    saved_adaptive = state.get("refresh") is not None
    if saved_adaptive != setup.adaptive:
        problems.append(f"saved with inv_update_steps {_mode(saved_adaptive)}, this run uses {_mode(setup.adaptive)}")
    return problems


def _placement_problems(saved: Any, now: Optional[dict[str, Any]]) -> list[str]:
    """A state saved by a run whose ``"auto"`` chose another placement than this run's ``"auto"`` (a fraction named
    in either run's config, or the same choice, loads)."""
    if saved is None:
        return []
    if not (isinstance(saved, dict) and set(saved) == set(AUTO_PLACEMENT_KEYS)):
        return [f"'auto_placement' must be None or a dict of {AUTO_PLACEMENT_KEYS}, got {_describe(saved)}"]
    fraction = saved["grad_worker_fraction"]
    if now is None or now["grad_worker_fraction"] == fraction:
        return []
    return [
        f"saved by a run whose grad_worker_fraction 'auto' chose {fraction!r} (from calibration "
        f"{saved['calibration']!r}), this run's chose {now['grad_worker_fraction']!r} (from {now['calibration']!r}): "
        f'to resume on the saved placement, set "grad_worker_fraction": {json.dumps(fraction)} in place of "auto"'
    ]


def _mode(adaptive: bool) -> str:
    return "adaptive" if adaptive else "fixed"


def _content_problems(state: dict[str, Any], setup: ExpectedState) -> list[str]:
    """Malformed or non-finite entries of a state saved for this setup."""
    problems: list[str] = []
    steps = state["steps"]
    if not _is_count(steps):
        problems.append(f"'steps' must be a non-negative int, got {_describe(steps)}")
    counters = state["counters"]
    if not isinstance(counters, dict):
        problems.append(f"'counters' must be a dict of counter name to count, got {_describe(counters)}")
    else:
        problems += [
            f"counters[{name!r}] must be a non-negative int, got {_describe(n)}"
            for name, n in counters.items()
            if not (isinstance(name, str) and _is_count(n))
        ]
    if setup.adaptive:
        problems += _refresh_problems(state["refresh"], setup)
    problems += _pending_problems(state.get("pending_decompositions"), steps if _is_count(steps) else None)
    tensors: list[tuple[str, torch.Tensor]] = []  # (what, tensor): checked for finiteness together
    for name, expected in setup.layers.items():
        problems += _layer_problems(name, state["layers"][name], expected, setup, tensors)
    finite = finite_flags([t for _, t in tensors])  # one host sync for every tensor of the state
    problems += [f"{what} is not finite (NaN or infinity)" for (what, _), ok in zip(tensors, finite) if not ok]
    return problems


def _refresh_problems(refresh: Any, setup: ExpectedState) -> list[str]:
    """The adaptive-refresh schedule: ``[interval, previous_interval, next_step, refreshes]`` per factor."""
    if not isinstance(refresh, dict):
        return [f"'refresh' must be a dict of factor to schedule, got {_describe(refresh)}"]
    expected = {factor_name((name, side)) for name, layer in setup.layers.items() for side in layer.sides}
    problems = []
    if set(refresh) != expected:
        problems.append(
            f"'refresh' has no schedule for {sorted(expected - set(refresh))}, "
            f"and one for unknown factors {sorted(set(refresh) - expected, key=str)}"
        )
    for key in sorted(expected & set(refresh)):
        schedule = refresh[key]
        well_formed = isinstance(schedule, (list, tuple)) and len(schedule) == 4 and all(map(_is_count, schedule))
        if not (well_formed and schedule[0] >= 1):
            problems.append(
                f"refresh[{key!r}] must be [interval >= 1, previous_interval, next_step, refreshes] of "
                f"non-negative ints, got {schedule!r}"
            )
    return problems


def _pending_problems(pending: Any, steps: int | None) -> list[str]:
    """Decompositions started at step ``started`` and due at ``install_at``: ``started < steps <= install_at``."""
    if pending is None:
        return []
    if not (
        isinstance(pending, dict)
        and set(pending) == {"started", "install_at"}
        and all(map(_is_count, pending.values()))
    ):
        return [
            f"'pending_decompositions' must be None or {{'started': int, 'install_at': int}}, got {_describe(pending)}"
        ]
    if steps is not None and not pending["started"] < steps <= pending["install_at"]:
        return [f"'pending_decompositions' {pending} does not fit steps={steps} (needs started < steps <= install_at)"]
    return []


def _layer_problems(
    name: str, entry: Any, expected: ExpectedLayer, setup: ExpectedState, tensors: list[tuple[str, torch.Tensor]]
) -> list[str]:
    """One layer's entry; its tensors that are well formed are appended to ``tensors``."""
    where = f"layer {name!r}"
    if not isinstance(entry, dict):
        return [f"{where} must be a dict, got {_describe(entry)}"]
    keys = layer_keys(expected.statistics, expected.sides, setup.adaptive, setup.moments)
    problems = _key_problems(where, entry, keys, keys)
    if problems:
        return problems
    a, g = expected.a_dim, expected.g_dim
    shape = entry[SHAPE]
    if not (isinstance(shape, (list, tuple)) and tuple(shape) == (a, g)):
        return [f"{where}: checkpoint factors are (A, G) = {_shape_of(shape)}, this model has {(a, g)}"]
    problems = [
        problem
        for key, shape in expected.statistics.items()
        for problem in _tensor_problems(f"{where}: {key}", entry[key], shape, tensors)
    ]
    problems += _decomposition_problems(where, entry[DECOMPOSITION], expected.state_shapes, expected.method, tensors)
    for side in expected.sides if setup.adaptive else ():
        key = references_key(side)
        pair = entry[key]
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            problems.append(f"{where}: {key} must be [last, before_last] (tensors or None), got {_describe(pair)}")
            continue
        for i, ref in enumerate(pair):
            problems += _tensor_problems(f"{where}: {key}[{i}]", ref, expected.statistics[side], tensors)
    if setup.moments:
        problems += _moment_problems(where, entry[MOMENTS], (g, a), tensors)
    return problems


def _moment_problems(where: str, moments: Any, shape: Shape, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The eigenbasis moments: ``None``, or ``m`` and ``v`` (``g_dim x a_dim``, ``v >= 0``) and a step count."""
    if moments is None:
        return []
    if not (isinstance(moments, dict) and set(moments) == set(MOMENT_KEYS)):
        return [f"{where}: {MOMENTS} must be None or a dict of {list(MOMENT_KEYS)}, got {_describe(moments)}"]
    problems = []
    if not _is_count(moments["step"]):
        problems.append(f"{where}: {MOMENTS}['step'] must be a non-negative int, got {_describe(moments['step'])}")
    for key in MOMENT_KEYS[:2]:
        problems += _tensor_problems(f"{where}: {MOMENTS}[{key!r}]", moments[key], shape, tensors)
    v = moments["exp_avg_sq"]
    if not problems and bool((v < 0).any()):
        problems.append(f"{where}: {MOMENTS}['exp_avg_sq'] has negative entries (a second moment is >= 0)")
    return problems


def _decomposition_problems(
    where: str, state: Any, shapes: list[Shape], method: str, tensors: list[tuple[str, torch.Tensor]]
) -> list[str]:
    if state is None:
        return []
    if not (isinstance(state, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in state)):
        return [f"{where}: the decomposition must be None or a list of tensors, got {_describe(state)}"]
    saved = [tuple(t.shape) for t in state]
    if saved != shapes:
        return [
            f"{where}: checkpoint decomposition has tensors of shapes {saved}, {method!r} holds {shapes} "
            f"(saved by another ds_kfac version?)"
        ]
    return [
        problem
        for i, (t, shape) in enumerate(zip(state, shapes))
        for problem in _tensor_problems(f"{where}: decomposition tensor {i}", t, shape, tensors)
    ]


def _tensor_problems(what: str, value: Any, shape: Shape, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """``value`` must be ``None`` or a floating-point tensor of ``shape``; if it is, it joins ``tensors``."""
    if value is None:
        return []
    if not isinstance(value, torch.Tensor):
        return [f"{what} must be a tensor or None, got {_describe(value)}"]
    if not value.is_floating_point():
        return [f"{what} has dtype {value.dtype}, expected a floating-point dtype"]
    if tuple(value.shape) != tuple(shape):
        return [f"{what} has shape {tuple(value.shape)}, expected {tuple(shape)}"]
    tensors.append((what, value))
    return []


def _key_problems(where: str, mapping: dict, required: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    missing = [key for key in required if key not in mapping]
    unknown = sorted(set(mapping) - set(allowed), key=str)
    return [f"{where} has no key {key!r}" for key in missing] + [
        f"{where} has an unknown key {key!r}" for key in unknown
    ]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape_of(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"
