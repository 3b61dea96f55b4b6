"""The ``"kfac"`` section of a DeepSpeed JSON config, validated with pydantic.

The same model validates the keyword arguments of the standalone
:class:`ds_kfac.KFACPreconditioner`, so both entry points share keys, defaults
and error messages. Errors are raised as :class:`KFACConfigError`, one message
naming every bad key, its value and what is allowed.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import KFACConfigError, format_errors
from .ranges import DECAY, FRACTION, POSITIVE, POSITIVE_INTEGER, UNDERFLOW, UNIT, Range
from .schedules import PiecewiseSchedule, resolve

PLACEMENT_PRESETS = ("comm-opt", "hybrid-opt", "mem-opt")
AUTO = "auto"
"""``grad_worker_fraction``'s word for a preset chosen by ``ds_kfac.initialize`` from ``calibration``."""
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _alternatives(rng: Range, words: tuple[str, ...], also: tuple[str, ...] = ()) -> str:
    """What a key allows, in words: ``"a number > 0, 'x', or a schedule dict"``."""
    options = [rng.allowed, *(repr(w) for w in words), *also]
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + ", or " + options[-1]


def _constant(v: Any, rng: Range, words: tuple[str, ...], also: tuple[str, ...] = ()) -> Any:
    """``v`` if it is one of ``words``, else ``v`` as a number of ``rng`` (``ValueError`` saying what is allowed)."""
    if isinstance(v, str) and v in words:
        return v
    if not rng.contains(v):
        raise ValueError(f"must be {_alternatives(rng, words, also)}")
    if rng.underflows(v):
        raise ValueError(f"{v!r} is {UNDERFLOW}: use a value >= {rng.smallest:.8g}")
    return rng.kind(v)


def _number(rng: Range, words: tuple[str, ...] = ()) -> Any:
    """An annotated type for a key that is a number of ``rng`` or one of ``words``."""
    return Annotated[Any, BeforeValidator(lambda v: _constant(v, rng, words))]


SCHEDULE_SHAPES = (
    "a schedule is {'milestones': [...], 'values': [...]} or {'initial': x, 'milestones': [...], 'gamma': g}"
)


def _from_dict(v: dict, rng: Range) -> PiecewiseSchedule:
    """A JSON schedule, its structure checked (the values are checked by the caller)."""
    extra = set(v) - {"milestones", "values", "initial", "gamma"}
    if extra or "milestones" not in v or ("values" in v) == ("initial" in v) or ("initial" in v) != ("gamma" in v):
        raise ValueError(SCHEDULE_SHAPES)
    if "values" in v:
        return PiecewiseSchedule(v["milestones"], v["values"])
    if rng.kind is int:
        raise ValueError("an integer schedule takes explicit 'values', not 'initial'/'gamma' decay")
    return PiecewiseSchedule.step_decay(v["initial"], v["milestones"], v["gamma"])


def _schedule(key: str, words: tuple[str, ...] = ()) -> Any:
    """An annotated type for a key that is a constant or a schedule, checked against ``SCHEDULED[key]``.

    Constants, JSON schedules (dicts) and :class:`PiecewiseSchedule` values are checked now; a Python callable is
    accepted as is and checked by :meth:`KFACConfig.at` each time it is called.
    """
    rng = SCHEDULED[key]

    def check(v: Any) -> Any:
        if callable(v) and not isinstance(v, (type, PiecewiseSchedule)):
            return v
        if not isinstance(v, (dict, PiecewiseSchedule)):
            return _constant(v, rng, words, also=("a schedule dict", "(in Python) a callable of the step"))
        schedule = _from_dict(v, rng) if isinstance(v, dict) else v
        bad = [x for x in schedule.values if not rng.contains(x)]
        if bad:
            raise ValueError(f"schedule values {bad} are not allowed: each must be {rng.allowed}")
        tiny = [x for x in schedule.values if rng.underflows(x)]
        if tiny:
            raise ValueError(f"schedule values {tiny} are {UNDERFLOW}: each must be >= {rng.smallest:.8g}")
        return PiecewiseSchedule(schedule.milestones, tuple(rng.kind(x) for x in schedule.values))

    return Annotated[Any, BeforeValidator(check)]


SCHEDULED: dict[str, Range] = {
    "factor_update_steps": POSITIVE_INTEGER,
    "inv_update_steps": POSITIVE_INTEGER,
    "damping": POSITIVE,
    "factor_decay": DECAY,
    "kl_clip": POSITIVE,
}
"""The keys that may be schedules, and the range of their values (constants, schedule values, callables' results)."""

MOMENTS_DEFAULTS: dict[str, Any] = {
    "kl_clip": None,
    "basis_update": "subspace",
    "basis_keep_drift": 0.1,
    "refresh_spread": True,
}
"""The defaults of keys left out with ``eigenbasis_moments`` (docs/config.md, "Eigenbasis moments"): no KL clip (the
step is Adam's normalised direction), and the refresh measured cheapest with the key (``benchmarks/refresh_cost.py``):
warm-started bases, each kept where it drifted by at most 0.1 (no moments to move), refreshes spread over the cycle.
Without the key, a refresh is a full ``eigh`` (``P(g)`` is then the documented preconditioner of the step's factors),
all at the cycle's first step. The last three apply where ``basis_update`` is left out or ``"subspace"``
(``"exact"``, the mode in which 2 ranks equal one process, keeps every refresh at the cycle's first step: spread
slots depend on the placement); ``refresh_spread`` keeps ``false`` with adaptive or background decompositions, and
``basis_keep_drift`` ``0`` with a ``basis_max_drift`` below 0.1."""


class KFACConfig(BaseModel):
    """Validated K-FAC settings. Defaults are listed in docs/config.md."""

    # strict: booleans must be booleans, strings strings, lists lists (neither "yes" nor 1 is true). Numeric keys
    # are checked by their Range (numbers, never bools or strings).
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True, strict=True)

    enabled: bool = True
    factor_update_steps: _schedule("factor_update_steps") = 1
    factor_micro_batches: Optional[_number(POSITIVE_INTEGER)] = None
    inv_update_steps: _schedule("inv_update_steps", words=("adaptive",)) = 10
    adaptive_threshold: _number(POSITIVE) = 0.1
    damping: _schedule("damping") = 0.001
    relative_damping: bool = False
    grafting: Literal["none", "gradient"] = "none"
    factor_decay: _schedule("factor_decay") = 0.95
    kl_clip: Optional[_schedule("kl_clip")] = 0.001
    compute_method: Literal["eigen", "inverse"] = "eigen"
    eigenvalue_outer_product: bool = False
    eigenvalue_correction: bool = False
    fisher: Literal["empirical", "sampled"] = "empirical"
    batchnorm: Literal["none", "unit-wise"] = "none"
    eigenbasis_moments: bool = False
    basis_update: Literal["subspace", "eigh", "exact"] = "eigh"
    basis_max_drift: _number(FRACTION) = 0.5
    basis_keep_drift: _number(UNIT) = 0.0
    eigenbasis_max_dim: Optional[_number(POSITIVE_INTEGER)] = None
    tied_layers: Literal["skip", "precondition"] = "skip"
    grad_worker_fraction: _number(FRACTION, (*PLACEMENT_PRESETS, AUTO)) = "comm-opt"
    calibration: Annotated[Optional[str], Field(validate_default=True)] = None
    factor_reduction: Literal["allreduce", "reduce", "local"] = "allreduce"
    assignment: Literal["compute", "memory"] = "compute"
    skip_layers: list[str] = []
    max_factor_dim: _number(POSITIVE_INTEGER) = 8192
    conv_factors: Literal["expand", "reduce"] = "expand"
    tensor_parallel_factors: Literal["exact", "shard"] = "exact"
    factor_dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    inv_dtype: Literal["float32", "float64"] = "float32"
    symmetric_comm: bool = False
    overlap_factor_comm: bool = True
    async_decompositions: bool = False
    refresh_spread: bool = False

    @field_validator("calibration")
    @classmethod
    def _calibration_for_auto(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        auto = info.data.get("grad_worker_fraction") == AUTO
        if auto and v is None:
            raise ValueError(
                "grad_worker_fraction 'auto' needs the path of a calibration saved by "
                "'python -m ds_kfac.plan --calibrate --save-calibration FILE' (docs/placement.md, \"auto\")"
            )
        if v is not None and "grad_worker_fraction" in info.data and not auto:
            raise ValueError("is read only with grad_worker_fraction 'auto' (this config names a fraction)")
        return v

    @field_validator("async_decompositions")
    @classmethod
    def _async_needs_fixed_refresh(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("inv_update_steps") == "adaptive":
            raise ValueError(
                "true needs a fixed inv_update_steps: adaptive refresh decides each factor's next "
                "interval from its decomposition step, which async decompositions move"
            )
        return v

    @field_validator("refresh_spread")
    @classmethod
    def _spread_needs_fixed_refresh(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("inv_update_steps") == "adaptive":
            raise ValueError("true needs a fixed inv_update_steps (adaptive refresh gives each factor its own steps)")
        if v and info.data.get("async_decompositions") is True:
            raise ValueError(
                "true cannot be combined with async_decompositions: true (spreading refreshes over the cycle and "
                "running them in the background are two answers to one cost: keep one)"
            )
        return v

    @field_validator("basis_keep_drift")
    @classmethod
    def _keep_below_full(cls, v: float, info: ValidationInfo) -> float:
        # Declared after basis_update and basis_max_drift, so they are in info.data when they are valid.
        mode = info.data.get("basis_update")
        if v > 0 and mode not in (None, "subspace"):
            raise ValueError(
                f"{v!r} needs basis_update 'subspace', this config has {mode!r} (a full decomposition at every "
                f"refresh keeps no basis)"
            )
        most = info.data.get("basis_max_drift")
        if most is not None and v > most:
            raise ValueError(
                f"{v!r} is above basis_max_drift={most!r}: a side that drifted that far is decomposed in full, "
                f"so it cannot keep its basis"
            )
        return v

    @field_validator("eigenvalue_outer_product")
    @classmethod
    def _outer_product_needs_eigen(cls, v: bool, info: ValidationInfo) -> bool:
        # compute_method is declared first, so it is in info.data when it is valid.
        method = info.data.get("compute_method")
        if v and method not in (None, "eigen"):
            raise ValueError(f"true needs compute_method 'eigen', this config has compute_method={method!r}")
        return v

    @field_validator("eigenvalue_correction")
    @classmethod
    def _correction_needs_plain_eigen(cls, v: bool, info: ValidationInfo) -> bool:
        method = info.data.get("compute_method")
        if v and method not in (None, "eigen"):
            raise ValueError(f"true needs compute_method 'eigen', this config has compute_method={method!r}")
        if v and info.data.get("eigenvalue_outer_product"):
            raise ValueError(
                "true cannot be combined with eigenvalue_outer_product: true (the outer product caches "
                "1 / (v_G v_A^T + damping) per decomposition, the correction S changes at every factor-update step)"
            )
        return v

    @field_validator("eigenbasis_moments")
    @classmethod
    def _moments_need_plain_eigen(cls, v: bool, info: ValidationInfo) -> bool:
        # Declared after every key it is checked against, so those are in info.data when they are valid.
        if not v:
            return v
        method = info.data.get("compute_method")
        if method not in (None, "eigen"):
            raise ValueError(f"true needs compute_method 'eigen' (an eigenbasis), this config has {method!r}")
        clashes = {
            "eigenvalue_outer_product": (True, "nothing divides by the eigenvalues, so there is nothing to cache"),
            "eigenvalue_correction": (True, "both divide by a second moment in the eigenbasis: keep one"),
            "grafting": ("gradient", "the direction has the base optimizer's per-element scale already"),
            "batchnorm": ("unit-wise", "a unit-wise block has no eigenbasis: leave BatchNorm to the base optimizer"),
        }
        for key, (value, why) in clashes.items():
            if info.data.get(key) == value:
                raise ValueError(f"true cannot be combined with {key}={value!r} ({why})")
        if info.data.get("kl_clip") is not None:
            raise ValueError(
                f"true takes no KL clip, this config has kl_clip={info.data['kl_clip']!r} (the step is Adam's "
                f"normalised direction, sized by the base optimizer's learning rate and LAMB's trust ratio): set "
                f"kl_clip to null or leave it out"
            )
        return v

    @field_validator("eigenbasis_max_dim", "tied_layers")
    @classmethod
    def _needs_moments(cls, v: Any, info: ValidationInfo) -> Any:
        # Declared after eigenbasis_moments, so it is in info.data when it is valid.
        if v not in (None, "skip") and info.data.get("eigenbasis_moments") is not True:
            why = {
                "eigenbasis_max_dim": "a side left in the parameter basis has no curvature to precondition with; "
                "only the base optimizer's moments can be kept in a one-sided basis",
                "tied_layers": "a tied weight's gradient sums every use, which one layer's factors do not describe "
                "for P(g); the moments only need an orthogonal basis",
            }[info.field_name]
            raise ValueError(f"{v!r} needs eigenbasis_moments: true ({why})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _moments_defaults(cls, data: Any) -> Any:
        """With ``eigenbasis_moments``, the keys left out take :data:`MOMENTS_DEFAULTS` where the keys given allow
        them (a value given for ``kl_clip`` is refused)."""
        if not isinstance(data, dict) or data.get("eigenbasis_moments") is not True:
            return data
        if data.get("basis_update", "subspace") != "subspace":
            return {"kl_clip": None, **data}  # another refresh asked for: the cheap one's settings do not apply
        defaults = dict(MOMENTS_DEFAULTS)
        if data.get("inv_update_steps") == "adaptive" or data.get("async_decompositions") is True:
            del defaults["refresh_spread"]  # both exclude spreading (refused when given)
        most = data.get("basis_max_drift")
        if isinstance(most, (int, float)) and not isinstance(most, bool) and most < defaults["basis_keep_drift"]:
            del defaults["basis_keep_drift"]  # a side kept at most basis_max_drift (refused when given above it)
        return {**defaults, **data}

    @field_validator("skip_layers")
    @classmethod
    def _regexes_compile(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{pattern!r} is not a valid regular expression ({err})") from None
        return v

    def at(self, key: str, step: int) -> Union[int, float]:
        """The value of the schedulable ``key`` at ``step``, checked against the same range as its constants.

        Constants and JSON schedules were checked when parsed; a Python callable is checked here, each time it is
        called (host-side, a few comparisons), so a bad value stops the run before it reaches any tensor.
        """
        rng = SCHEDULED[key]
        value = resolve(getattr(self, key), step)
        if not rng.contains(value):
            raise KFACConfigError(f"kfac.{key}: the schedule returned {value!r} at step {step}; must be {rng.allowed}")
        if rng.underflows(value):
            raise KFACConfigError(
                f"kfac.{key}: the schedule returned {value!r} at step {step}, which is {UNDERFLOW}; "
                f"must be >= {rng.smallest:.8g}"
            )
        return rng.kind(value)

    @property
    def factor_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.factor_dtype]

    @property
    def inv_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.inv_dtype]

    @classmethod
    def parse(cls, section: Optional[dict[str, Any]], where: str = "kfac") -> "KFACConfig":
        """Validate a config section (``None`` means K-FAC disabled) into a model,
        turning pydantic's errors into one :class:`KFACConfigError`."""
        if section is None:
            return cls(enabled=False)
        if not isinstance(section, dict):
            raise KFACConfigError(f"'{where}' must be a JSON object, got {type(section).__name__}: {section!r}")
        try:
            return cls(**section)
        except ValidationError as err:
            raise KFACConfigError(format_errors(err, where, cls, "K-FAC")) from None
