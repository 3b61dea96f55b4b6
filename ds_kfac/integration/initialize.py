"""``ds_kfac.initialize``: ``deepspeed.initialize`` with a ``"kfac"`` config section.

Same arguments and return values as ``deepspeed.initialize``. Differences:

* with ``"kfac": {"enabled": true, ...}`` the engine is a :class:`KFACEngine`;
* an ``"optimizer"`` of type ``Lamb`` or ``SGD`` in the JSON is built by
  :func:`ds_kfac.optimizers.build_optimizer` (Apex FusedLAMB, DeepSpeed
  FusedLamb, or the pure-PyTorch LAMB), so LAMB configs also run where
  DeepSpeed's CUDA-only FusedLamb cannot, with or without K-FAC.

Everything else, including a config without ``"kfac"`` or with
``"enabled": false``, goes to DeepSpeed unchanged.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer

from ..config import KFACConfig, KFACConfigError
from ..optimizers import build_optimizer
from .engine import KFACEngine

JSON_OPTIMIZERS = ("lamb", "sgd")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``deepspeed.add_config_arguments``: ``--deepspeed`` and ``--deepspeed_config``.
    The K-FAC settings live in that config file's ``"kfac"`` section."""
    return deepspeed.add_config_arguments(parser)


def _config_dict(args: Any, config: Union[str, dict, None], config_params: Union[str, dict, None]) -> dict:
    """The config as a fresh dict, from ``config``/``config_params`` or ``args.deepspeed_config``."""
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is not None:
        raise ValueError(
            f"two DeepSpeed configs given: args.deepspeed_config={from_args!r} and config=...; pass only one"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass config= (a dict or a JSON path) or --deepspeed_config")
    return copy.deepcopy(config) if isinstance(config, dict) else load_ds_config(config)


def kfac_near_misses(keys: Iterable[Any]) -> list[str]:
    """The keys that look like a misspelt ``"kfac"``: equal to it ignoring case and ``-``/``_``/spaces
    (``"KFAC"``, ``"k-fac"``), containing it (``"kfac_config"``), or a close ``difflib`` match (``"kfca"``).
    The cutoff, 0.75, needs three of four letters in order; no DeepSpeed config key comes near it."""
    misses = []
    for key in keys:
        if not isinstance(key, str) or key == "kfac":
            continue
        letters = re.sub(r"[^a-z0-9]", "", key.lower())
        if "kfac" in letters or difflib.get_close_matches(letters, ["kfac"], n=1, cutoff=0.75):
            misses.append(key)
    return misses


def _warn_near_misses(config: dict) -> None:
    """A config without ``"kfac"`` runs plain DeepSpeed: say so for each key that was probably meant to be it."""
    for key in kfac_near_misses(config):
        warnings.warn(
            f"config key {key!r} looks like a misspelt 'kfac' section; it is not read, and K-FAC is off "
            f'(the section must be named exactly "kfac")',
            UserWarning,
            stacklevel=3,
        )


def _optimizer_from_json(
    config: dict, model: torch.nn.Module, model_parameters: Any
) -> Optional[torch.optim.Optimizer]:
    """Build a JSON ``Lamb``/``SGD`` optimizer ourselves and take it out of the config."""
    section = config.get("optimizer")
    if not isinstance(section, dict) or str(section.get("type", "")).lower() not in JSON_OPTIMIZERS:
        return None
    params = model_parameters if model_parameters is not None else model.parameters()
    params = [p for p in params if not isinstance(p, torch.Tensor) or p.requires_grad]
    optimizer = build_optimizer(section["type"], params, section.get("params", {}))
    del config["optimizer"]
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage > 0 and not is_zero_supported_optimizer(optimizer):
        # ZeRO asks for this flag for any optimizer outside its tested list.
        config["zero_allow_untested_optimizer"] = True
    return optimizer


def _refuse_unsupported(cfg: DeepSpeedConfig, config: dict, model: torch.nn.Module, mesh_param: Any) -> None:
    """One error naming every part of the DeepSpeed setup K-FAC does not support yet."""
    stage = cfg.zero_optimization_stage
    offload = [
        name
        for name, section in (
            ("offload_optimizer", cfg.zero_config.offload_optimizer),
            ("offload_param", cfg.zero_config.offload_param),
        )
        if section is not None
        and str(getattr(section, "device", "none")).lower() not in ("none", "offloaddevicenum.none")
    ]
    problems = []
    if stage > 2:
        problems.append(f"zero_optimization.stage={stage} (supported: 0, 1, 2)")
    if offload:
        problems.append(f"ZeRO {' and '.join(offload)}")
    if cfg.float16_config.enabled and stage == 0:
        problems.append(
            "fp16 with ZeRO stage 0 (its optimizer wrapper does not scale the loss; use stage 1/2, or bf16)"
        )
    if cfg.bfloat16_config.enabled and stage == 1 and str(cfg.grad_accum_dtype).lower() in ("fp32", "float32"):
        problems.append("bf16 with data_types.grad_accum_dtype=fp32 at ZeRO stage 1 (DeepSpeed's BF16_Optimizer)")
    if not getattr(cfg, "managed_gradient_accumulation", True):
        problems.append(
            "managed_gradient_accumulation=false (K-FAC scales G by gradient_accumulation_steps and needs "
            "the engine's micro-step count to find the accumulation boundary)"
        )
    if isinstance(model, PipelineModule):
        problems.append("pipeline parallelism (PipelineModule)")
    if mesh_param is not None or "sequence_parallel_size" in config:
        problems.append("sequence/mesh parallelism")
    if problems:
        raise KFACConfigError("K-FAC does not support yet: " + "; ".join(problems))


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config: Union[str, dict, None] = None,
    mesh_param: Any = None,
    config_params: Union[str, dict, None] = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with K-FAC: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    The ``"kfac"`` section is validated first, on every rank, and any
    problem raises :class:`ds_kfac.KFACConfigError` naming the key.
    """
    if model is None:
        raise ValueError("ds_kfac.initialize requires a model")
    config = _config_dict(args, config, config_params)
    if "kfac" not in config:
        _warn_near_misses(config)
    kfac_config = KFACConfig.parse(config.pop("kfac", None))
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None  # the resolved dict is passed as config=
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    if optimizer is None:
        optimizer = _optimizer_from_json(config, model, model_parameters)
    common = dict(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
    )
    if not kfac_config.enabled:
        return deepspeed.initialize(**common, distributed_port=distributed_port, mesh_param=mesh_param)
    config_class = DeepSpeedConfig(config, mpu)
    _refuse_unsupported(config_class, config, model, mesh_param)
    # The non-pipeline path of deepspeed.initialize, with our engine class.
    engine = KFACEngine(**common, config_class=config_class, kfac_config=kfac_config)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
