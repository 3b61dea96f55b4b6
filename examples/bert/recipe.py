"""The ``"bert"`` section of a BERT config: what the example reads beside DeepSpeed's keys.

``model`` (a ``transformers.BertConfig`` JSON), ``max_seq_length``, ``max_steps``, ``warmup_proportion``,
``poly_power``, ``eval_every``, ``save_every``, ``vocab_size`` (the tokenizer's: of the one ``prepare.py`` trains when
none is given, and the one the shards or NVIDIA's HDF5 files must have been made with). ``prepare.py`` and
``pretrain.py`` read the same file, so data and model agree on sequence length and vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BERT_DEFAULTS: dict[str, Any] = {
    "model": "configs/bert/bert-tiny.json",
    "max_seq_length": 128,
    "max_steps": 100,
    "warmup_proportion": 0.1,
    "poly_power": 0.5,
    "eval_every": 25,
    "save_every": 0,
    "vocab_size": 8192,
}
POSITIVE = ("max_seq_length", "max_steps", "vocab_size")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the problem."""


def read_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DeepSpeed's part of the config, its ``"bert"`` section with the defaults filled in), or a
    :class:`ConfigError` naming the file and what is wrong (not JSON, not an object, a bad ``"bert"`` key)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the config ({error})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config must be a JSON object, got {type(config).__name__}")
    section = config.pop("bert", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'bert' must be a JSON object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(BERT_DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: unknown 'bert' keys {unknown} (allowed: {sorted(BERT_DEFAULTS)})")
    bert = {**BERT_DEFAULTS, **section}
    for key in POSITIVE:
        if not isinstance(bert[key], int) or isinstance(bert[key], bool) or bert[key] < 1:
            raise ConfigError(f"{path}: bert.{key} must be a positive integer, got {bert[key]!r}")
    return config, bert
