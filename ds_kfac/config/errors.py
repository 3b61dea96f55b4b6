"""A config section's errors in one message: :class:`KFACConfigError` and :func:`format_errors` (the ``"kfac"`` and
``"easgd"`` sections share them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class KFACConfigError(ValueError):
    """A bad ``kfac`` configuration: the message names each key, value and what is allowed."""


def format_errors(err: ValidationError, where: str, model: type[BaseModel], title: str) -> str:
    """One message for every error of ``model`` (the ``where`` section of a config, e.g. ``"kfac"``), a line per key."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not _is_union_tag(p))
        key = f"{where}.{loc}" if loc else where
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(model.model_fields)
            lines.append(f"{key}: unknown key (allowed keys: {allowed})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    # Union fields report once per alternative; keep the first message per key.
    seen: dict[str, str] = {}
    for line in lines:
        seen.setdefault(line.split(":", 1)[0], line)
    return f"invalid {title} config:\n  " + "\n  ".join(seen.values())


def _is_union_tag(part: Any) -> bool:
    """pydantic appends the tried union member (e.g. ``float``) to error locations."""
    return isinstance(part, str) and (
        part in {"float", "int", "str", "bool"} or part.startswith(("literal[", "function-"))
    )
