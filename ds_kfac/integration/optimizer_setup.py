"""The optimizer :func:`ds_kfac.initialize` hands the engine, and where ``gradient_clipping`` applies.

* an ``"optimizer"`` of type ``Lamb`` or ``SGD`` in the JSON is built by
  :func:`ds_kfac.optimizers.build_optimizer` (Apex FusedLAMB, DeepSpeed
  FusedLamb, or the pure-PyTorch LAMB), for the device the engine will move the model to
  (:func:`engine_device`), so LAMB configs also run where DeepSpeed's CUDA-only FusedLamb cannot, with or
  without K-FAC;
* with ``"eigenbasis_moments": true`` the JSON optimizer (``Lamb``, ``Adam``, ``AdamW``, or ``Muon``:
  :mod:`ds_kfac.optimizers.muon`, Muon for the matrices K-FAC leaves) is built here with the K-FAC layers'
  parameters in flagged param groups (:mod:`ds_kfac.optimizers.eigenbasis`), a client optimizer is checked to
  carry the moments, and ``gradient_clipping`` moves from DeepSpeed to the engine, which clips the raw gradients
  before K-FAC turns them into directions (DeepSpeed would clip the directions).

Any other JSON optimizer is left in the config for DeepSpeed to build.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from deepspeed import comm as ds_comm
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import get_gradient_clipping
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer

from ..config import KFACConfig, KFACConfigError
from ..config.json_values import half_precision, json_object, zero_stage
from ..optimizers import build_optimizer, split_groups
from ..optimizers.muon import build_muon
from ..preconditioning.build import moment_rule, preconditioned_parameters

JSON_OPTIMIZERS = ("lamb", "sgd")
EIGENBASIS_OPTIMIZERS = ("lamb", "adam", "adamw", "muon")
"""The JSON optimizer types ``eigenbasis_moments`` can keep moments for (ds_kfac builds them)."""


def raw_gradient_clipping(config: dict) -> float:
    """The ``gradient_clipping`` DeepSpeed applies for ``config``: its own default (1.0 in 0.19) where the key is
    left out. With ``eigenbasis_moments`` the engine applies it to the raw gradients itself."""
    return float(get_gradient_clipping(config))


def clipping_to_engine(config: dict, kfac_config: KFACConfig) -> dict[str, float]:
    """The engine's ``raw_gradient_clipping`` keyword: with ``eigenbasis_moments`` the clip must act on the
    gradients, not K-FAC's directions, so DeepSpeed's is set to 0 in ``config`` and the engine gets its value;
    ``{}`` (DeepSpeed clips) without the key."""
    if not kfac_config.eigenbasis_moments:
        return {}
    clipping = raw_gradient_clipping(config)
    config["gradient_clipping"] = 0.0
    return {"raw_gradient_clipping": clipping}


def engine_device(model: torch.nn.Module) -> Optional[torch.device]:
    """Where DeepSpeed's engine will move ``model``: the accelerator's device of this process's local rank
    (``DeepSpeedEngine._set_distributed_vars`` and ``_configure_distributed_model``), unless ZeRO-3's ``zero.Init``
    built it (its parameters carry ``ds_id``, and ZeRO places them); ``None`` then. The optimizer is built before the
    engine moves the model, so a fused LAMB is chosen by this device, not by where the parameters are yet."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def refuse_muon(config: dict, kfac_config: KFACConfig, has_layers: bool = True) -> None:
    """A JSON ``Muon`` optimizer with K-FAC (``has_layers``: K-FAC registers some layer of the model) runs only with
    ``eigenbasis_moments``: without the key, DeepSpeed's Muon would take K-FAC's layers among its matrices and
    orthogonalise their preconditioned gradients. With it (ds_kfac's :mod:`~ds_kfac.optimizers.muon`), Muon
    orthogonalises each matrix as the model holds it, so it runs where the optimizer steps the model's own
    parameters (ZeRO stage 0, fp32), not flat partitions. Refused otherwise, naming what the config has. Also read
    by the planner, which plans only what launches."""
    section = config.get("optimizer")
    if not (kfac_config.enabled and has_layers) or not isinstance(section, dict):
        return
    if str(section.get("type", "")).lower() != "muon":
        return
    if not kfac_config.eigenbasis_moments:
        raise KFACConfigError(
            "optimizer type 'Muon' with K-FAC needs kfac.eigenbasis_moments: true: without it DeepSpeed's Muon takes "
            "K-FAC's layers among its matrices and orthogonalises their preconditioned gradients (Newton-Schulz "
            "keeps only the polar factor, so K-FAC's rescaling is lost); set the key (K-FAC's layers then take Adam "
            "in their eigenbasis, the other matrices Muon), or use another optimizer type"
        )
    stage, low = zero_stage(config, "the DeepSpeed config"), half_precision(config, "the DeepSpeed config")
    if stage > 0 or low:
        given = f"ZeRO stage {stage}" + "".join(f", {key}" for key in low)
        raise KFACConfigError(
            f"kfac.eigenbasis_moments with optimizer type 'Muon' steps the model's own matrices, which ZeRO stages "
            f"1-3 and fp16/bf16 hand the optimizer as flat partitions; this config has {given}: use ZeRO stage 0 in "
            f"fp32, or optimizer type AdamW/Lamb with the key"
        )


def setup_optimizer(
    config: dict, model: torch.nn.Module, optimizer: Any, model_parameters: Any, kfac_config: KFACConfig
) -> tuple[Any, KFACConfig]:
    """The optimizer to hand the engine and the ``kfac_config`` it runs with: the client ``optimizer`` (checked to
    carry ``eigenbasis_moments``' moments), else the JSON one where ds_kfac builds it (:func:`optimizer_from_json`,
    which takes it out of ``config``), else ``None`` (DeepSpeed builds it). Needs the process group (the warning of
    :func:`_moments_if_layers` is rank 0's)."""
    if kfac_config.eigenbasis_moments and not isinstance(model, PipelineModule):
        kfac_config = _moments_if_layers(kfac_config, model)
    if optimizer is None:
        return optimizer_from_json(config, model, model_parameters, kfac_config), kfac_config
    if kfac_config.enabled and not callable(optimizer):
        moment_rule(kfac_config, None, optimizer)  # a client optimizer: refused now if it cannot carry the moments
    return optimizer, kfac_config


def optimizer_from_json(
    config: dict, model: torch.nn.Module, model_parameters: Any, kfac_config: KFACConfig
) -> Optional[torch.optim.Optimizer]:
    """Build a JSON ``Lamb``/``SGD`` optimizer ourselves and take it out of the config; with
    ``eigenbasis_moments``, a ``Lamb``/``Adam``/``AdamW`` one whose K-FAC layers' parameters are flagged groups."""
    section = config.get("optimizer")
    if section is not None:
        json_object(section, "the DeepSpeed config", "optimizer")
        json_object(section.get("params", {}), "the DeepSpeed config", "optimizer.params")
    kind = str(section.get("type", "")).lower() if isinstance(section, dict) else None
    moments = kfac_config.enabled and kfac_config.eigenbasis_moments
    refuse_muon(config, kfac_config, has_layers=bool(preconditioned_parameters(model, kfac_config)))
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
        names = {id(p): name for name, p in model.named_parameters()}
        optimizer = build_muon(params, names, section.get("params", {}))
    else:
        optimizer = build_optimizer(section["type"], params, section.get("params", {}), engine_device(model))
    del config["optimizer"]
    stage = zero_stage(config, "the DeepSpeed config")
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
            stacklevel=4,  # the caller of ds_kfac.initialize (initialize -> setup_optimizer -> here)
        )
    return kfac_config.model_copy(update={"eigenbasis_moments": False})
