"""Files ds_kfac keeps beside DeepSpeed's in a checkpoint's tag directory (``<save_dir>/<tag>/``): the tag
DeepSpeed saves to or loads, and an atomic write."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine


def tag_to_save(engine: DeepSpeedEngine, tag: Any) -> str:
    """The tag ``DeepSpeedEngine.save_checkpoint`` saves to: ``tag``, else its default ``global_step<N>``."""
    return f"global_step{engine.global_steps}" if tag is None else str(tag)


def tag_to_load(engine: DeepSpeedEngine, load_dir: str, tag: Any) -> Optional[str]:
    """The tag ``DeepSpeedEngine.load_checkpoint`` loads: ``tag``, else the one its ``latest`` file names
    (``latest_universal`` for universal checkpoints); ``None`` without that file."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest_universal" if engine.load_universal_checkpoint() else "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def save_atomic(state: Any, path: str) -> None:
    """``torch.save`` through a temporary file, so that a reader sees the whole file or none."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
