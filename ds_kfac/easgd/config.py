"""The ``"easgd"`` section of a DeepSpeed JSON config, validated like ``"kfac"`` (strict types, one message
naming every bad key)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config.errors import KFACConfigError, format_errors
from ..config.ranges import POSITIVE, POSITIVE_INTEGER
from ..config.schema import _number


class EASGDConfig(BaseModel):
    """Validated synchronous EASGD settings (docs/config.md, "The easgd section")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = True
    rho: Optional[_number(POSITIVE)] = None
    """The elastic coefficient: each worker and the center move by ``lr * rho`` times their distance."""
    period: _number(POSITIVE_INTEGER) = 1
    """The elastic update (and its all-reduce) runs on steps ``t % period == 0``; other steps are local only."""
    overlap: bool = True
    """Start the weights' all-reduce right after the previous step, overlapping this step's forward/backward."""

    @classmethod
    def parse(cls, section: Optional[dict[str, Any]], where: str = "easgd") -> "EASGDConfig":
        """Validate the section (``None`` means EASGD disabled); any problem raises :class:`KFACConfigError`."""
        if section is None:
            return cls(enabled=False)
        if not isinstance(section, dict):
            raise KFACConfigError(f"'{where}' must be a JSON object, got {type(section).__name__}: {section!r}")
        try:
            config = cls(**section)
        except ValidationError as err:
            raise KFACConfigError(format_errors(err, where, cls, "EASGD")) from None
        if config.enabled and config.rho is None:
            raise KFACConfigError(
                f"invalid EASGD config:\n  {where}.rho: required when EASGD is enabled (a number > 0)"
            )
        return config
