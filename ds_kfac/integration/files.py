"""Files ds_kfac keeps beside DeepSpeed's in a checkpoint's tag directory (``<save_dir>/<tag>/``): their names
(:func:`state_file`), the tag DeepSpeed saves to or loads, an atomic write and a checked read, and the ZeRO stage
DeepSpeed's files were saved at."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any, Optional, Union

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

KFAC_STATE = "kfac_state"
"""The stem of K-FAC's state files."""

EASGD_STATE = "easgd"
"""The stem of EASGD's per-rank files."""


def state_file(
    stem: str = KFAC_STATE,
    *,
    stage: Optional[int] = None,
    tensor_parallel: tuple[int, int] = (0, 1),
    rank: Union[int, str, None] = None,
) -> str:
    """The name of one of ds_kfac's files in a checkpoint's tag directory,
    ``<stem>[_pp<stage>][_tp<r>of<n>][_rank<rank>].pt``: K-FAC's state is ``kfac_state.pt``, one per pipeline
    ``stage`` ``kfac_state_pp<stage>.pt``, one per tensor-parallel rank ``r`` of ``n > 1`` (``tensor_parallel``)
    with ``_tp<r>of<n>``, and one per data-parallel ``rank`` under EASGD ``kfac_state_rank<r>.pt``; EASGD's own is
    ``easgd_rank<r>.pt`` (``rank="*"``: a glob of all ranks')."""
    parts = [stem]
    if stage is not None:
        parts.append(f"pp{stage}")
    tp_rank, tp_size = tensor_parallel
    if tp_size > 1:
        parts.append(f"tp{tp_rank}of{tp_size}")
    if rank is not None:
        parts.append(f"rank{rank}")
    return "_".join(parts) + ".pt"


STAGE_STATE_FILE = re.compile(rf"{KFAC_STATE}_pp(\d+)(_tp\d+of\d+)?\.pt")
"""K-FAC's state of one pipeline stage (:func:`state_file` with ``stage``); group 1 is the stage."""


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


def load_file(path: str, what: str) -> Any:
    """``torch.load`` of a file ds_kfac wrote (CPU tensors, plain containers only); a ``ValueError`` naming the file
    and saying it is truncated or corrupt when it cannot be read (torch raises ``RuntimeError``, ``EOFError``,
    ``UnpicklingError`` or, for some truncations, a bare ``OSError: [Errno 22] Invalid argument``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        raise ValueError(
            f"{path} ({size} bytes) is truncated or corrupt: it cannot be read as a {what} "
            f"({type(err).__name__}: {err}); copy it again from where it was saved, or load an older checkpoint"
        ) from err


MODEL_STATES = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")
"""DeepSpeed's model states files: ``mp_rank_<mp>_model_states.pt`` at ZeRO 0-2, one per data-parallel rank
(``zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt``) at ZeRO 3."""


def saved_model_states(checkpoint: str) -> Optional[dict]:
    """The first of DeepSpeed's model states files in tag directory ``checkpoint`` (its ``ds_config``, counters and
    ``dp_world_size``), read memory-mapped (the weights are not read). ``None`` without such a readable file (DeepSpeed
    then reports the checkpoint itself)."""
    names = sorted(f for f in os.listdir(checkpoint) if MODEL_STATES.fullmatch(f)) if os.path.isdir(checkpoint) else []
    if not names:
        return None
    try:
        state = torch.load(os.path.join(checkpoint, names[0]), map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError):  # not torch.save's format: DeepSpeed will say
        return None
    return state if isinstance(state, dict) else None


def _saved_int(value: Any) -> Optional[int]:
    """``value`` if it is an ``int`` (not a ``bool``), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def saved_zero_stage(states: dict) -> Optional[int]:
    """The ZeRO stage of DeepSpeed's model ``states``: ``zero_optimization.stage`` of the ``ds_config`` it records (0
    when absent); ``None`` without a readable entry."""
    config = states.get("ds_config")
    return _saved_int((config.get("zero_optimization") or {}).get("stage", 0)) if isinstance(config, dict) else None


def refuse_unloadable(engine: DeepSpeedEngine, checkpoint: str, optimizer_states: bool) -> None:
    """Raise ``ValueError`` before DeepSpeed loads anything when it would fail part-way through loading the checkpoint
    in tag directory ``checkpoint`` (after writing the weights and counters into the engine): saved at a ZeRO stage it
    cannot load across (:func:`refuse_zero_stage_change`), or, with ``optimizer_states``, ZeRO optimizer states saved at
    another data-parallel world size (:func:`refuse_world_size_change`). Universal checkpoints load across both."""
    states = None if engine.load_universal_checkpoint() else saved_model_states(checkpoint)
    if states is None:
        return
    refuse_zero_stage_change(engine, checkpoint, saved_zero_stage(states), optimizer_states)
    if optimizer_states:
        refuse_world_size_change(engine, checkpoint, _saved_int(states.get("dp_world_size")))


def refuse_zero_stage_change(
    engine: DeepSpeedEngine, checkpoint: str, saved: Optional[int], optimizer_states: bool
) -> None:
    """Raise ``ValueError`` when the checkpoint in tag directory ``checkpoint`` was saved at ZeRO stage ``saved`` and
    this engine cannot load it: DeepSpeed 0.19.8 fails on 3 against 0-2 (other files; its bare ``AssertionError``),
    and with ``optimizer_states`` on 0 against 1-2 (ZeRO optimizer files missing or unread); 1 and 2 load each
    other."""
    current = engine.zero_optimization_stage()
    if saved is None or saved == current:
        return
    if 3 not in (saved, current) and not (optimizer_states and 0 in (saved, current)):
        return
    weights = (
        f"torch.load('{checkpoint}/mp_rank_00_model_states.pt')['module']"
        if saved == 0
        else "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(load_dir, tag)"
    )
    weights_only = "" if 3 in (saved, current) else "; or pass load_optimizer_states=False (weights only)"
    raise ValueError(
        f"checkpoint {checkpoint} was saved at ZeRO stage {saved} and this engine runs ZeRO stage {current}: "
        f"DeepSpeed cannot load it across that change (nothing was loaded). Resume at stage {saved}, or restore the "
        f"weights with {weights} (into the model, before ds_kfac.initialize) and K-FAC's state with "
        f"engine.kfac.load_state_dict(torch.load(<its kfac_state.pt>)), the optimizer starting fresh{weights_only}"
    )


def refuse_world_size_change(engine: DeepSpeedEngine, checkpoint: str, saved: Optional[int]) -> None:
    """Raise ``ValueError`` when this engine runs ZeRO (stage 1-3) and the checkpoint in tag directory
    ``checkpoint`` was saved at data-parallel world size ``saved`` (its model states' ``dp_world_size``) other than
    the engine's: DeepSpeed 0.19.8 refuses to repartition ZeRO optimizer states (``ZeRORuntimeException``), but only
    once it has loaded the weights and counters."""
    current = engine.seq_dp_world_size
    if saved is None or saved == current or not engine.zero_optimization():
        return
    raise ValueError(
        f"checkpoint {checkpoint} holds ZeRO optimizer states saved at data-parallel world size {saved} and this "
        f"engine runs {current}: DeepSpeed cannot repartition them (nothing was loaded). Resume at world size "
        f"{saved}; or pass load_optimizer_states=False (weights only, the optimizer and K-FAC starting fresh); or "
        f"restore the weights with deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(load_dir, "
        f"tag) (into the model, before ds_kfac.initialize) and K-FAC's state, which does not depend on the world size, "
        f"with engine.kfac.load_state_dict(torch.load(<its kfac_state.pt>)), the optimizer starting fresh"
    )
