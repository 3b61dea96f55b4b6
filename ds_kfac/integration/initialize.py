"""``ds_kfac.initialize``: ``deepspeed.initialize`` with a ``"kfac"`` config section.

Same arguments and return values as ``deepspeed.initialize``. Differences:

* with ``"kfac": {"enabled": true, ...}`` the engine is a :class:`KFACEngine`; with ``"easgd"`` enabled an
  :class:`EASGDEngine` (synchronous EASGD), or with both a :class:`KFACEASGDEngine`;
* a JSON ``Lamb`` or ``SGD`` optimizer, and with ``"eigenbasis_moments": true`` a ``Lamb``, ``Adam``, ``AdamW``
  or ``Muon`` one, is built by ds_kfac, and with that key ``gradient_clipping`` moves from DeepSpeed to the
  engine (:mod:`.optimizer_setup`).

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
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config, merge_tp_model_init_into_config
from deepspeed.runtime.zero import partition_parameters
from deepspeed.utils import log_dist, logger
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..config import KFACConfig
from ..config.json_values import json_object
from ..easgd import EASGDConfig
from .auto_placement import resolve_auto
from .easgd import EASGDEngine, KFACEASGDEngine
from .easgd import refuse_unsupported as refuse_easgd_unsupported
from .engine import KFACEngine
from .extensions import refuse_stale_build_locks
from .optimizer_setup import clipping_to_engine, setup_optimizer
from .pipeline import KFACPipelineEngine
from .refusals import optimized_parameters, refuse_unsupported

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
    if isinstance(config, dict):
        return copy.deepcopy(config)
    return json_object(load_ds_config(config), f"the DeepSpeed config {config}")


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
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = list(model_parameters)  # read by ds_kfac's JSON optimizer, its checks and DeepSpeed
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
    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else model_parameters
    kfac_config = resolve_auto(kfac_config, {**config, "kfac": kfac_section}, model, mpu, groups)
    optimizer, kfac_config = setup_optimizer(config, model, optimizer, model_parameters, kfac_config)
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
        extra.update(clipping_to_engine(config, kfac_config))
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
            optimized = optimized_parameters(engine_args["optimizer"], engine_args["model_parameters"])
            refuse_unsupported(
                config_class, config, engine_kwargs["kfac_config"], model, mpu, mesh_param, mpu_problems, optimized
            )
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
