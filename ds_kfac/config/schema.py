"""The ``"kfac"`` section of a DeepSpeed JSON config, validated with pydantic.

The same model validates the keyword arguments of the standalone
:class:`ds_kfac.KFACPreconditioner`, so both entry points share keys, defaults
and error messages. Errors are raised as :class:`KFACConfigError`, one message
naming every bad key, its value and what is allowed.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, field_validator

from .schedules import PiecewiseSchedule

PLACEMENT_PRESETS = ("comm-opt", "hybrid-opt", "mem-opt")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KFACConfigError(ValueError):
    """A bad ``kfac`` configuration: the message names each key, value and what is allowed."""


def _schedule(kind: type, low: float, high: float, low_open: bool, allowed: str, words: tuple[str, ...] = ()) -> Any:
    """An annotated type for a hyperparameter that is a constant or a schedule.

    Constants and JSON schedules (dicts) are checked against the range; a
    Python callable is accepted as is (it can only be checked when called).
    """

    def in_range(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            return False
        return (v > low if low_open else v >= low) and v < high

    def check(v: Any) -> Any:
        if isinstance(v, dict):
            extra = set(v) - {"milestones", "values", "initial", "gamma"}
            if extra or "milestones" not in v or (("values" in v) == ("initial" in v)):
                raise ValueError(
                    "a schedule is {'milestones': [...], 'values': [...]} or "
                    "{'initial': x, 'milestones': [...], 'gamma': g}"
                )
            if "values" in v:
                sched = PiecewiseSchedule(tuple(v["milestones"]), tuple(v["values"]))
            elif kind is int:
                raise ValueError("an integer schedule takes explicit 'values', not 'initial'/'gamma' decay")
            else:
                sched = PiecewiseSchedule.step_decay(v["initial"], list(v["milestones"]), v["gamma"])
            bad = [x for x in sched.values if not in_range(x)]
            if bad:
                raise ValueError(f"schedule values {bad} are out of range: each must be {allowed}")
            return PiecewiseSchedule(sched.milestones, tuple(kind(x) for x in sched.values))
        if isinstance(v, PiecewiseSchedule) or (callable(v) and not isinstance(v, type)) or v in words:
            return v
        if not in_range(v):
            alternatives = "".join(f", {w!r}" for w in words)
            raise ValueError(f"must be {allowed}{alternatives}, a schedule dict, or (in Python) a callable of the step")
        return kind(v)

    return Annotated[Any, BeforeValidator(check)]


IntSchedule = _schedule(int, 1, math.inf, low_open=False, allowed="an integer >= 1")
RefreshSchedule = _schedule(int, 1, math.inf, low_open=False, allowed="an integer >= 1", words=("adaptive",))
PositiveSchedule = _schedule(float, 0.0, math.inf, low_open=True, allowed="a number > 0")
DecaySchedule = _schedule(float, 0.0, 1.0, low_open=False, allowed="a number in [0, 1)")


class KFACConfig(BaseModel):
    """Validated K-FAC settings. Defaults are listed in docs/config.md."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    enabled: bool = True
    factor_update_steps: IntSchedule = 1
    inv_update_steps: RefreshSchedule = 10
    adaptive_threshold: float = 0.1
    damping: PositiveSchedule = 0.001
    relative_damping: bool = False
    grafting: Literal["none", "gradient"] = "none"
    factor_decay: DecaySchedule = 0.95
    kl_clip: Optional[PositiveSchedule] = 0.001
    compute_method: Literal["eigen", "inverse"] = "eigen"
    eigenvalue_outer_product: bool = False
    grad_worker_fraction: Union[Literal["comm-opt", "hybrid-opt", "mem-opt"], float] = "comm-opt"
    factor_reduction: Literal["allreduce", "reduce", "local"] = "allreduce"
    assignment: Literal["compute", "memory"] = "compute"
    skip_layers: list[str] = []
    max_factor_dim: int = 8192
    conv_factors: Literal["expand", "reduce"] = "expand"
    factor_dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    inv_dtype: Literal["float32", "float64"] = "float32"
    symmetric_comm: bool = False
    overlap_factor_comm: bool = True
    async_decompositions: bool = False

    @field_validator("async_decompositions")
    @classmethod
    def _async_needs_fixed_refresh(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("inv_update_steps") == "adaptive":
            raise ValueError(
                "true needs a fixed inv_update_steps: adaptive refresh decides each factor's next "
                "interval from its decomposition step, which async decompositions move"
            )
        return v

    @field_validator("grad_worker_fraction")
    @classmethod
    def _fraction_range(cls, v: Union[str, float]) -> Union[str, float]:
        if isinstance(v, float) and not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1] or one of {PLACEMENT_PRESETS}")
        return v

    @field_validator("eigenvalue_outer_product")
    @classmethod
    def _outer_product_needs_eigen(cls, v: bool, info: ValidationInfo) -> bool:
        # compute_method is declared first, so it is in info.data when it is valid.
        method = info.data.get("compute_method")
        if v and method not in (None, "eigen"):
            raise ValueError(f"true needs compute_method 'eigen', this config has compute_method={method!r}")
        return v

    @field_validator("skip_layers")
    @classmethod
    def _regexes_compile(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{pattern!r} is not a valid regular expression ({err})") from None
        return v

    @field_validator("adaptive_threshold")
    @classmethod
    def _positive_threshold(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be a number > 0")
        return v

    @field_validator("max_factor_dim")
    @classmethod
    def _positive_dim(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be a positive integer")
        return v

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
            raise KFACConfigError(_format_errors(err, where)) from None


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not _is_union_tag(p))
        key = f"{where}.{loc}" if loc else where
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(KFACConfig.model_fields)
            lines.append(f"{key}: unknown key (allowed keys: {allowed})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    # Union fields report once per alternative; keep the first message per key.
    seen: dict[str, str] = {}
    for line in lines:
        seen.setdefault(line.split(":", 1)[0], line)
    return "invalid K-FAC config:\n  " + "\n  ".join(seen.values())


def _is_union_tag(part: Any) -> bool:
    """pydantic appends the tried union member (e.g. ``float``) to error locations."""
    return isinstance(part, str) and (
        part in {"float", "int", "str", "bool"} or part.startswith(("literal[", "function-"))
    )
