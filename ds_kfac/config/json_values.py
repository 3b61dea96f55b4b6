"""The shape of a DeepSpeed JSON config outside the ``"kfac"`` section, as ds_kfac reads it: a value of the wrong
JSON kind is named in one line (where it is, what it must be, what it is), never met as an ``AttributeError``."""

from __future__ import annotations

import json
from typing import Any, Union

Kind = Union[type, tuple[type, ...]]

_WORDS = {dict: "a JSON object", list: "a list", str: "a string", bool: "a boolean", int: "an integer"}


def json_kind(value: Any) -> str:
    """What ``value``, read from JSON, is in JSON's words: ``"a list"``, ``"a number"``, ``"null"``..."""
    if value is None:
        return "null"
    if isinstance(value, float):
        return "a number"
    return _WORDS.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """``value``'s kind and its JSON text, cut to 60 characters: ``a list: [1, 2]``, ``a boolean: true``."""
    text = json.dumps(value, default=repr)
    text = text if len(text) <= 60 else text[:57] + "..."
    return "null" if value is None else f"{json_kind(value)}: {text}"


def _describe(kind: Kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(_WORDS.get(k, k.__name__) for k in kinds)


def _is(value: Any, kind: Kind) -> bool:
    """``isinstance`` in JSON's sense: ``true`` is no number."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def json_object(value: Any, where: str, key: str = "") -> dict[str, Any]:
    """``value`` (the config ``where`` names, or its section ``key``) if it is a JSON object, else a ``ValueError``
    naming it and what it is instead."""
    if not isinstance(value, dict):
        name = f"{where}: {key}" if key else where
        raise ValueError(f"{name} must be a JSON object (keys and values), got {_shown(value)}")
    return value


def json_value(section: dict[str, Any], key: str, kind: Kind, default: Any, where: str) -> Any:
    """``section[key]`` (``default`` where it is left out or null) if it is of ``kind``, else a ``ValueError``
    naming ``where: key`` (``key`` dotted from the top level), what it must be and what it is."""
    value = section.get(key.rpartition(".")[2])
    if value is None:
        return default
    if not _is(value, kind):
        raise ValueError(f"{where}: {key} must be {_describe(kind)}, got {_shown(value)}")
    return value


def zero_stage(config: dict[str, Any], where: str) -> int:
    """The config's ``zero_optimization.stage`` (0 where left out), its section and value of the right JSON kinds."""
    zero = json_object(config.get("zero_optimization", {}), where, "zero_optimization")
    return json_value(zero, "zero_optimization.stage", int, 0, where)


def half_precision(config: dict[str, Any], where: str) -> list[str]:
    """The config's enabled half-precision sections, ``"fp16"`` then ``"bf16"``, each and its ``enabled`` of the
    right JSON kinds."""
    return [
        key
        for key in ("fp16", "bf16")
        if json_value(json_object(config.get(key, {}), where, key), f"{key}.enabled", bool, False, where)
    ]
