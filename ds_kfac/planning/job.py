"""What a DeepSpeed JSON says about a K-FAC job before launch: its ``"kfac"`` section (through
:class:`~ds_kfac.KFACConfig`) and the DeepSpeed keys that change K-FAC's memory or traffic."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..config import KFACConfig, KFACConfigError
from ..config.json_values import half_precision, json_object, json_value, zero_stage
from ..integration.optimizer_setup import raw_gradient_clipping, refuse_muon


@dataclass(frozen=True)
class Job:
    """A DeepSpeed config read for ``world`` data-parallel ranks."""

    section: dict[str, Any]
    """The ``"kfac"`` section as written (placements vary its ``grad_worker_fraction`` and ``factor_reduction``)."""
    kfac: KFACConfig
    world: int
    zero_stage: int
    micro_batch: int
    accumulation: int
    param_dtype: torch.dtype
    """The model's dtype in the engine (fp16 or bf16 when enabled): the gradients', and ZeRO's flat buffers'."""
    raw_clipping: float
    """``gradient_clipping`` with DeepSpeed's default (``integration.optimizer_setup.raw_gradient_clipping``): with
    ``eigenbasis_moments`` the engine clips the raw gradients itself, one more all-reduce of their norm per step
    under ZeRO 1/2."""
    parameter_alignment: bool
    """``zero_optimization.parameter_alignment`` (where ZeRO 1/2 partitions cut the parameters)."""
    bert: dict[str, Any]
    """The ``"bert"`` section that ``examples/bert/pretrain.py`` reads (``{}`` where there is none)."""

    def config_for(self, fraction: Union[str, float], reduction: str) -> KFACConfig:
        """The ``"kfac"`` section with another placement (:func:`placed`)."""
        return placed(self.section, fraction, reduction)


def placed(section: dict[str, Any], fraction: Union[str, float], reduction: Optional[str] = None) -> KFACConfig:
    """A ``"kfac"`` section with ``fraction`` (and ``reduction``, where given) in place of its own, checked as
    ``initialize`` checks it; its ``calibration``, read only for ``"auto"``, left out."""
    changed = {"grad_worker_fraction": fraction, "calibration": None}
    if reduction is not None:
        changed["factor_reduction"] = reduction
    return KFACConfig.parse({**section, **changed})


def read_job(config: Union[str, Path, dict[str, Any]], world: int) -> Job:
    """The job a DeepSpeed config (a JSON file or its dict) describes at ``world`` data-parallel ranks; a
    :class:`~ds_kfac.KFACConfigError` or ``ValueError`` names what is wrong with it (a section or key of the wrong
    JSON kind included: :mod:`~ds_kfac.config.json_values`)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--world must be a positive number of data-parallel ranks, got {world!r}")
    where = "the DeepSpeed config"
    if not isinstance(config, dict):
        where = str(config)
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the DeepSpeed config {where}: {err}") from None
        json_object(config, f"the DeepSpeed config {where}")
    stage = zero_stage(config, where)
    zero = config.get("zero_optimization", {})  # an object: zero_stage checked it
    half = [{"fp16": "float16", "bf16": "bfloat16"}[key] for key in half_precision(config, where)]
    json_value(config, "gradient_clipping", (int, float), None, where)
    optimizer = json_object(config.get("optimizer", {}), where, "optimizer")
    json_value(optimizer, "optimizer.type", str, None, where)
    bert = json_object(config.get("bert", {}), where, "bert")
    for key, kind in (("model", str), ("vocab_size", int), ("max_seq_length", int)):
        json_value(bert, f"bert.{key}", kind, None, where)
    if config.get("kfac") is None:
        raise KFACConfigError(f'{where} has no "kfac" section: there is nothing to plan (K-FAC is off without one)')
    section = config["kfac"]
    kfac = KFACConfig.parse(section)
    if not kfac.enabled:
        raise KFACConfigError(f'{where}: "kfac" has "enabled": false, so K-FAC holds and sends nothing')
    refuse_muon(config, kfac)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{where}: zero_optimization.stage={stage!r}; DeepSpeed's stages are 0, 1, 2 and 3")
    if json_value(zero, "zero_optimization.round_robin_gradients", bool, False, where):
        raise ValueError(
            f"{where}: zero_optimization.round_robin_gradients=true reorders ZeRO's partitions; not planned"
        )
    micro, accumulation = _batch(config, world, where)
    return Job(
        section=section,
        kfac=kfac,
        world=world,
        zero_stage=stage,
        micro_batch=micro,
        accumulation=accumulation,
        param_dtype=getattr(torch, half[0]) if half else torch.float32,
        raw_clipping=float(raw_gradient_clipping(config)) if kfac.eigenbasis_moments else 0.0,
        parameter_alignment=json_value(zero, "zero_optimization.parameter_alignment", bool, False, where),
        bert=bert,
    )


def _batch(config: dict[str, Any], world: int, where: str) -> tuple[int, int]:
    """The micro-batch per rank and the accumulation steps, completed from ``train_batch_size`` as DeepSpeed does
    (``train_batch_size = micro-batch x accumulation x world``)."""
    total, micro, accumulation = (
        json_value(config, key, int, None, where)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    if total is not None and micro is None:
        micro = total // ((accumulation or 1) * world)
    if accumulation is None:
        accumulation = total // (micro * world) if total is not None and micro else 1
    if not micro or (total is not None and total != micro * accumulation * world):
        raise ValueError(
            f"{where}: train_batch_size={total}, train_micro_batch_size_per_gpu={micro}, "
            f"gradient_accumulation_steps={accumulation} do not fit {world} ranks "
            f"(train_batch_size must be micro-batch x accumulation x {world})"
        )
    return micro, accumulation
