"""``ds_kfac.initialize``: ``deepspeed.initialize`` with a ``"kfac"`` config section.

Same arguments and return values as ``deepspeed.initialize``. Differences:

* with ``"kfac": {"enabled": true, ...}`` the engine is a :class:`KFACEngine`; with ``"easgd"`` enabled an
  :class:`EASGDEngine` (synchronous EASGD), or with both a :class:`KFACEASGDEngine`;
* an ``"optimizer"`` of type ``Lamb`` or ``SGD`` in the JSON is built by
  :func:`ds_kfac.optimizers.build_optimizer` (Apex FusedLAMB, DeepSpeed
  FusedLamb, or the pure-PyTorch LAMB), so LAMB configs also run where
  DeepSpeed's CUDA-only FusedLamb cannot, with or without K-FAC;
* with ``"eigenbasis_moments": true`` the JSON optimizer (``Lamb``, ``Adam``, ``AdamW``, or ``Muon``:
  :mod:`ds_kfac.optimizers.muon`, Muon for the matrices K-FAC leaves) is built by
  ds_kfac with the K-FAC layers' parameters in flagged param groups (:mod:`ds_kfac.optimizers.eigenbasis`),
  and ``gradient_clipping`` moves from DeepSpeed to the engine, which clips the raw gradients before K-FAC
  turns them into directions (DeepSpeed would clip the directions).

Everything else, including a config without ``"kfac"`` or with
``"enabled": false``, goes to DeepSpeed unchanged. With K-FAC,
:func:`_initialize_kfac` runs every step of ``deepspeed.initialize`` itself, with :class:`KFACEngine` as the
engine class, or :class:`KFACPipelineEngine` for a ``PipelineModule`` (its pipeline branch)
(``tests/robustness/test_deepspeed_drift.py`` fails when DeepSpeed adds a step).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import functools
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import deepspeed
import torch
from deepspeed import comm as ds_comm
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.module_inject import set_autotp_mode
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig, get_gradient_clipping
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config, merge_tp_model_init_into_config
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
from deepspeed.utils import log_dist, logger
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..config import KFACConfig, KFACConfigError
from ..easgd import EASGDConfig
from ..optimizers import build_optimizer, split_groups
from ..optimizers.muon import build_muon
from ..preconditioning.build import moment_rule, preconditioned_parameters
from .easgd import EASGDEngine, KFACEASGDEngine
from .easgd import refuse_unsupported as refuse_easgd_unsupported
from .engine import KFACEngine
from .extensions import refuse_stale_build_locks
from .pipeline import KFACPipelineEngine
from .refusals import refuse_unsupported

JSON_OPTIMIZERS = ("lamb", "sgd")
EIGENBASIS_OPTIMIZERS = ("lamb", "adam", "adamw", "muon")
"""The JSON optimizer types ``eigenbasis_moments`` can keep moments for (ds_kfac builds them)."""

VERIFIED_DEEPSPEED = SpecifierSet("==0.19.8")
"""The DeepSpeed versions whose internals ds_kfac reads (docs/maintainers.md) were checked on; setup.py's
``deepspeed`` extra requires the same."""


@functools.cache
def check_deepspeed_version(version: str) -> None:
    """Warn, once per process (cached), when DeepSpeed ``version`` is outside :data:`VERIFIED_DEEPSPEED`."""
    if Version(version) not in VERIFIED_DEEPSPEED:
        warnings.warn(
            f"DeepSpeed {version} is outside the range ds_kfac was verified on (deepspeed{VERIFIED_DEEPSPEED}): "
            f"the DeepSpeed internals listed in docs/maintainers.md may have changed",
            RuntimeWarning,
            stacklevel=3,
        )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``deepspeed.add_config_arguments``: ``--deepspeed`` and ``--deepspeed_config``.
    The K-FAC settings live in that config file's ``"kfac"`` section."""
    return deepspeed.add_config_arguments(parser)


def _config_from_args(args: Any) -> Union[str, dict, None]:
    """``args.deepspeed_config``, or the deprecated ``args.deepscale_config`` (which DeepSpeed still reads)."""
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is None:
        return getattr(args, "deepspeed_config", None)
    logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
    if getattr(args, "deepspeed_config", None) is not None:
        raise ValueError(
            f"two DeepSpeed configs given: args.deepscale_config={deepscale!r} and "
            f"args.deepspeed_config={args.deepspeed_config!r}; pass only one"
        )
    return deepscale


@contextlib.contextmanager
def _config_not_in(args: Any) -> Iterator[None]:
    """Hide the config path(s) of ``args`` while the resolved dict is passed as ``config=``
    (``deepspeed.initialize`` refuses both); the engine still gets the caller's ``args``."""
    names = [n for n in ("deepspeed_config", "deepscale_config") if getattr(args, n, None) is not None]
    saved = {n: getattr(args, n) for n in names}
    for n in names:
        setattr(args, n, None)
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(args, n, value)


def _config_dict(args: Any, config: Union[str, dict, None], config_params: Union[str, dict, None]) -> dict:
    """The config as a fresh dict, from ``config``/``config_params`` or ``args.deepspeed_config``."""
    config = config if config is not None else config_params
    from_args = _config_from_args(args)
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


def raw_gradient_clipping(config: dict) -> float:
    """The ``gradient_clipping`` DeepSpeed applies for ``config``: its own default (1.0 in 0.19) where the key is
    left out. With ``eigenbasis_moments`` the engine applies it to the raw gradients itself."""
    return float(get_gradient_clipping(config))


def engine_device(model: torch.nn.Module) -> Optional[torch.device]:
    """Where DeepSpeed's engine will move ``model``: the accelerator's device of this process's local rank
    (``DeepSpeedEngine._set_distributed_vars`` and ``_configure_distributed_model``), unless ZeRO-3's ``zero.Init``
    built it (its parameters carry ``ds_id``, and ZeRO places them); ``None`` then. The optimizer is built before the
    engine moves the model, so a fused LAMB is chosen by this device, not by where the parameters are yet."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def refuse_flat_muon(config: dict) -> None:
    """A JSON ``Muon`` optimizer with ``eigenbasis_moments`` (ds_kfac's :mod:`~ds_kfac.optimizers.muon`)
    orthogonalises each matrix as the model holds it, so it runs where the optimizer steps the model's own
    parameters (ZeRO stage 0, fp32), not flat partitions: refused otherwise, naming what the config has. Also read
    by the planner, which plans only what launches."""
    section = config.get("optimizer")
    if not isinstance(section, dict) or str(section.get("type", "")).lower() != "muon":
        return
    stage = config.get("zero_optimization", {}).get("stage", 0)
    low = [key for key in ("fp16", "bf16") if config.get(key, {}).get("enabled", False)]
    if stage > 0 or low:
        given = f"ZeRO stage {stage}" + "".join(f", {key}" for key in low)
        raise KFACConfigError(
            f"kfac.eigenbasis_moments with optimizer type 'Muon' steps the model's own matrices, which ZeRO stages "
            f"1-3 and fp16/bf16 hand the optimizer as flat partitions; this config has {given}: use ZeRO stage 0 in "
            f"fp32, or optimizer type AdamW/Lamb with the key"
        )


def _optimizer_from_json(
    config: dict, model: torch.nn.Module, model_parameters: Any, kfac_config: KFACConfig
) -> Optional[torch.optim.Optimizer]:
    """Build a JSON ``Lamb``/``SGD`` optimizer ourselves and take it out of the config; with
    ``eigenbasis_moments``, a ``Lamb``/``Adam``/``AdamW`` one whose K-FAC layers' parameters are flagged groups."""
    section = config.get("optimizer")
    kind = str(section.get("type", "")).lower() if isinstance(section, dict) else None
    moments = kfac_config.enabled and kfac_config.eigenbasis_moments
    if moments and kind not in EIGENBASIS_OPTIMIZERS:
        given = "no JSON optimizer" if kind is None else f"optimizer type {section.get('type')!r}"
        raise KFACConfigError(
            f"kfac.eigenbasis_moments: true keeps the base optimizer's per-element moments in K-FAC's eigenbasis, "
            f"so it needs an Adam-type JSON optimizer (type Lamb, Adam, AdamW or Muon) or a client optimizer built with "
            f"ds_kfac.optimizers.split_groups; this config has {given}"
            + (" (SGD keeps no second moment: use K-FAC without the key)" if kind == "sgd" else "")
        )
    if kind not in JSON_OPTIMIZERS and not moments:
        return None
    if moments and section.get("params", {}).get("amsgrad", False):
        raise KFACConfigError(
            f"kfac.eigenbasis_moments with optimizer type {section.get('type')!r} and amsgrad=true: AMSGrad keeps the "
            f"running maximum of v per parameter element, while K-FAC keeps v in its eigenbasis, which turns at every "
            f"refresh, so there is no per-element maximum to carry; set amsgrad to false, or use K-FAC without the key"
        )
    params = model_parameters if model_parameters is not None else model.parameters()
    params = [p for p in params if not isinstance(p, torch.Tensor) or p.requires_grad]
    if moments:
        params = split_groups(params, preconditioned_parameters(model, kfac_config))
    if kind == "muon":
        refuse_flat_muon(config)
        names = {id(p): name for name, p in model.named_parameters()}
        optimizer = build_muon(params, names, section.get("params", {}))
    else:
        optimizer = build_optimizer(section["type"], params, section.get("params", {}), engine_device(model))
    del config["optimizer"]
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage > 0 and not is_zero_supported_optimizer(optimizer):
        # ZeRO asks for this flag for any optimizer outside its tested list.
        config["zero_allow_untested_optimizer"] = True
    return optimizer


def _moments_if_layers(kfac_config: KFACConfig, model: torch.nn.Module) -> KFACConfig:
    """``kfac_config``, with ``eigenbasis_moments`` turned off when K-FAC registers no layer of ``model`` (all in
    ``skip_layers``, or none of a supported type): there are no moments to keep in an eigenbasis, so the model trains
    as the base optimizer, built and clipped by DeepSpeed as without the key (docs/faults.md), with a
    ``UserWarning`` on rank 0 saying so."""
    if preconditioned_parameters(model, kfac_config):
        return kfac_config
    if ds_comm.get_rank() == 0:
        warnings.warn(
            "kfac.eigenbasis_moments: K-FAC registers no layer of this model (all in skip_layers, or none of a "
            "supported type), so there are no moments to keep in its eigenbasis: it trains as the base optimizer, "
            "as without the key",
            UserWarning,
            stacklevel=3,
        )
    return kfac_config.model_copy(update={"eigenbasis_moments": False})


def _refuse_mpu(mpu: Any, stage: int) -> list[str]:
    """What K-FAC does not support of a model-parallel ``mpu``: anything but Megatron's tensor parallelism
    (``megatron.core.parallel_state``, :class:`~ds_kfac.integration.megatron.MegatronMPU`) at ZeRO stage 0."""
    if mpu is None:
        return []
    if not _is_megatron(mpu):
        return [f"model parallelism through mpu={type(mpu).__name__} (supported: megatron.core.parallel_state)"]
    problems = []
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        problems.append("Megatron pipeline parallelism (pipeline_model_parallel_size > 1)")
    if stage > 0 and mpu.get_tensor_model_parallel_world_size() > 1:
        problems.append(
            f"ZeRO stage {stage} with Megatron tensor parallelism (K-FAC needs each shard's whole gradient: stage 0)"
        )
    return problems


def _is_megatron(mpu: Any) -> bool:
    """Whether ``mpu`` is Megatron's ``parallel_state`` (as the user passes it, or wrapped by :func:`initialize`)."""
    if mpu is sys.modules.get("megatron.core.parallel_state"):
        return True
    megatron = sys.modules.get("ds_kfac.integration.megatron")
    return megatron is not None and isinstance(mpu, megatron.MegatronMPU)


def _as_deepspeed_mpu(mpu: Any) -> Any:
    """Megatron's ``parallel_state`` wrapped so that DeepSpeed's engine finds what it asks of an ``mpu``."""
    if mpu is None or mpu is not sys.modules.get("megatron.core.parallel_state"):
        return mpu
    from .megatron import MegatronMPU

    return MegatronMPU(mpu)


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
    check_deepspeed_version(deepspeed.__version__)
    config = _config_dict(args, config, config_params)
    if "kfac" not in config:
        _warn_near_misses(config)
    kfac_section = config.pop("kfac", None)
    kfac_config = KFACConfig.parse(kfac_section)
    easgd_config = EASGDConfig.parse(config.pop("easgd", None))
    if not ds_comm.is_initialized():  # DeepSpeed loads its CPU communication op here: never wait on a stale lock
        refuse_stale_build_locks()
    ds_comm.init_distributed(  # the first step of deepspeed.initialize; ZeRO's optimizer check needs it
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    if kfac_config.eigenbasis_moments and not isinstance(model, PipelineModule):
        kfac_config = _moments_if_layers(kfac_config, model)
    if optimizer is None:
        optimizer = _optimizer_from_json(config, model, model_parameters, kfac_config)
    elif kfac_config.enabled and not callable(optimizer):
        moment_rule(kfac_config, None, optimizer)  # a client optimizer: refused now if it cannot carry the moments
    if kfac_config.enabled:
        mpu = _as_deepspeed_mpu(mpu)
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
        mesh_param=mesh_param,
    )
    if not (kfac_config.enabled or easgd_config.enabled):
        with _config_not_in(args):
            return deepspeed.initialize(**common, distributed_port=distributed_port)
    extra: dict[str, Any] = {}
    if kfac_config.enabled:
        extra["kfac_config"] = kfac_config
        if kfac_config.eigenbasis_moments:  # clip the gradients, not K-FAC's directions (see the module docstring)
            extra["raw_gradient_clipping"] = raw_gradient_clipping(config)
            config["gradient_clipping"] = 0.0
    if easgd_config.enabled:
        extra["easgd_config"] = easgd_config
    return _initialize_kfac(**common, kfac_section=kfac_section, engine_kwargs=extra)


def _engine_class(engine_kwargs: dict[str, Any], pipeline: bool) -> type[DeepSpeedEngine]:
    """The engine for the enabled sections: :class:`KFACEngine` (:class:`KFACPipelineEngine` for a
    ``PipelineModule``), :class:`EASGDEngine` or both combined (refused with a pipeline)."""
    kfac, easgd = "kfac_config" in engine_kwargs, "easgd_config" in engine_kwargs
    if pipeline and not easgd:
        return KFACPipelineEngine
    return KFACEASGDEngine if kfac and easgd else EASGDEngine if easgd else KFACEngine


def _initialize_kfac(
    *,
    model: torch.nn.Module,
    config: dict,
    kfac_section: Optional[dict],
    engine_kwargs: dict[str, Any],
    mpu: Any,
    mesh_param: Any,
    **engine_args: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` (0.19.8) after ``init_distributed``, step by step, with :class:`KFACEngine`
    (or an EASGD engine, :func:`_engine_class`) given ``engine_kwargs``; for a ``PipelineModule`` its pipeline
    branch (the grid ``model.mpu()`` as the mpu) with :class:`KFACPipelineEngine`.

    Steps that only serve setups :func:`~ds_kfac.integration.refusals.refuse_unsupported` refuses (a mesh device, the hybrid engine,
    DualPipeV) are left out; ``tests/robustness/test_deepspeed_drift.py`` lists every step and what happens to
    it here.
    """
    pipeline = isinstance(model, PipelineModule)
    engine_class = _engine_class(engine_kwargs, pipeline)
    log_dist(
        f"DeepSpeed info: version={deepspeed.__version__}, git-hash={deepspeed.__git_hash__}, "
        f"git-branch={deepspeed.__git_branch__}; engine: ds_kfac.{engine_class.__name__}",
        ranks=[0],
    )
    partition_parameters.shutdown_init_context()  # a zero.Init context must not wrap the engine's own modules
    try:
        merge_tp_model_init_into_config(config, mpu, mesh_param, ds_comm)  # deepspeed.tp_model_init's settings
        engine_mpu = model.mpu() if pipeline else mpu  # the pipeline's grid; the user's mpu is refused with it
        config_class = DeepSpeedConfig(config, engine_mpu)
        if "kfac_config" in engine_kwargs:
            mpu_problems = _refuse_mpu(mpu, config_class.zero_optimization_stage)
            refuse_unsupported(config_class, config, engine_kwargs["kfac_config"], model, mpu, mesh_param, mpu_problems)
        if "easgd_config" in engine_kwargs:
            kfac_section = kfac_section if "kfac_config" in engine_kwargs else None
            refuse_easgd_unsupported(config_class, config, model, mpu, kfac_section)
        if config_class.tensor_parallel_config.autotp_size > 0:
            set_autotp_mode(training=True)
        deepspeed.set_optimizer_flags(config_class, model)  # e.g. Muon's per-parameter flags
        engine = engine_class(
            model=model, mpu=engine_mpu, config=config, config_class=config_class, **engine_kwargs, **engine_args
        )
    finally:
        partition_parameters.restore_init_context()
    engine._configure_python_gc()  # "disable_python_gc"
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
