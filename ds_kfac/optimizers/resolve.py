"""Choose a LAMB implementation, and build the optimizer of a DeepSpeed JSON config.

The contract of :func:`resolve_lamb` is DeepSpeed ``FusedLamb``'s constructor
and semantics (see :mod:`ds_kfac.optimizers.lamb`).  Backends, in order of
preference when ``backend="auto"``:

1. ``apex.optimizers.FusedLAMB`` (NVIDIA Apex) when it imports and every
   parameter is a CUDA float32/float16 tensor.  Arguments are mapped as
   ``adam_w_mode=True``, ``grad_averaging=True``, ``use_nvlamb=True`` (trust
   ratio also for ``weight_decay == 0``, as DeepSpeed does) and
   ``max_grad_norm=0`` becomes ``inf`` (Apex would otherwise divide by 0).
   Differences that cannot be mapped:

   * Apex bias-corrects ``m`` and ``v`` before adding ``eps`` and before the
     trust ratio; DeepSpeed computes the trust ratio on the uncorrected update
     and multiplies the step by ``sqrt(1 - beta2**t) / (1 - beta1**t)`` after
     it, so early steps are smaller with DeepSpeed (about 0.3x at t = 1 with
     the default betas).
   * Apex does not clamp the trust ratio: ``max_coeff`` / ``min_coeff`` are ignored.
   * Apex clips with the norm of *all* gradients (all groups) and reads
     ``max_grad_norm`` from the constructor only; DeepSpeed clips per group.
   * ``get_lamb_coeffs()`` does not exist on Apex's optimizer.

   ``eps_inside_sqrt=True`` cannot be expressed at all, so Apex is skipped then.
2. DeepSpeed ``deepspeed.ops.lamb.FusedLamb`` when every parameter is a
   contiguous CUDA float32/float64 tensor, ``max_grad_norm`` is 0 (its
   ``step()`` needs caller-supplied group norms to clip) and its CUDA extension
   builds or loads (for the visible devices' compute capabilities where ``TORCH_CUDA_ARCH_LIST`` is unset or has
   an entry such as ``9.0a`` that DeepSpeed's builder cannot parse: :mod:`ds_kfac.integration.cuda_ops`).
3. The pure-PyTorch :class:`~ds_kfac.optimizers.lamb.Lamb` otherwise, and always where a param group is
   flagged ``eigenbasis_moments`` (:mod:`.eigenbasis`), which the fused ones do not know.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from .adam import Adam
from .common import ParamsT
from .eigenbasis import GROUP_KEY
from .lamb import Lamb

logger = logging.getLogger(__name__)

LAMB_KEYS: tuple[str, ...] = tuple(name for name in inspect.signature(Lamb).parameters if name != "params")
SGD_KEYS: tuple[str, ...] = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
ADAM_KEYS: tuple[str, ...] = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "adam_w_mode",
    "torch_adam",
    "amsgrad",
)
"""DeepSpeed's keys of a JSON ``Adam``/``AdamW`` optimizer (``torch_adam`` picks DeepSpeed's implementation and
means nothing here)."""
BACKENDS: tuple[str, ...] = ("auto", "apex", "deepspeed", "torch")
OPTIMIZER_TYPES: tuple[str, ...] = ("Lamb", "SGD", "Adam", "AdamW")


def _check_keys(what: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Raise ``ValueError`` naming every key of ``given`` not in ``allowed``."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for {what}; allowed: {sorted(allowed)}")


def _tensors(params: list[Any]) -> list[Tensor]:
    """The parameter tensors of a list of tensors or param-group dicts."""
    tensors: list[Tensor] = []
    for item in params:
        if isinstance(item, dict):
            group_params = item["params"]
            tensors.extend([group_params] if isinstance(group_params, Tensor) else group_params)
        else:
            tensors.append(item)
    return tensors


def _uses_setting(params: list[Any], kwargs: dict[str, Any], key: str, default: Any) -> set[Any]:
    """Every value ``key`` takes: the constructor's and each param group's override."""
    values = {kwargs.get(key, default)}
    values.update(group[key] for group in params if isinstance(group, dict) and key in group)
    return values


def apex_lamb_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map FusedLamb-style arguments to ``apex.optimizers.FusedLAMB`` ones (see module doc)."""
    mapped = {key: kwargs[key] for key in ("lr", "bias_correction", "betas", "eps", "weight_decay") if key in kwargs}
    mapped.setdefault("eps", 1e-8)  # FusedLamb's default; Apex's is 1e-6
    mapped.setdefault("weight_decay", 0.0)  # FusedLamb's default; Apex's is 0.01
    max_grad_norm = kwargs.get("max_grad_norm", 0.0)
    mapped["max_grad_norm"] = max_grad_norm if max_grad_norm > 0 else math.inf
    mapped.update(adam_w_mode=True, grad_averaging=True, use_nvlamb=True)
    return mapped


def _apex_lamb() -> Optional[type]:
    """``apex.optimizers.FusedLAMB`` if NVIDIA Apex is importable (the unrelated PyPI
    ``apex`` package has no such attribute), else ``None``."""
    try:
        import apex.optimizers
    except ImportError:
        return None
    return getattr(apex.optimizers, "FusedLAMB", None)


def _on_cuda(tensor: Tensor, device: Optional[torch.device]) -> bool:
    """Whether ``tensor`` steps on CUDA: on ``device`` when given (where the engine moves it), else where it is."""
    return (device.type if device is not None else tensor.device.type) == "cuda"


def _apex_unsupported(
    params: list[Any], tensors: list[Tensor], kwargs: dict[str, Any], device: Optional[torch.device]
) -> Optional[str]:
    """Why Apex FusedLAMB cannot run these parameters/arguments, or ``None`` if it can."""
    if not tensors or not all(_on_cuda(t, device) and t.dtype in (torch.float32, torch.float16) for t in tensors):
        return "Apex FusedLAMB needs float32/float16 CUDA parameters"
    if True in _uses_setting(params, kwargs, "eps_inside_sqrt", False):
        return "Apex FusedLAMB cannot put eps inside the square root (eps_inside_sqrt=True)"
    if _apex_lamb() is None:
        return "NVIDIA Apex (apex.optimizers.FusedLAMB) is not installed"
    return None


def _build_apex(params: list[Any], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Construct Apex FusedLAMB (raises if Apex was installed without its CUDA extensions)."""
    return _apex_lamb()(params, **apex_lamb_kwargs(kwargs))  # type: ignore[misc]


def _deepspeed_unsupported(
    params: list[Any], tensors: list[Tensor], kwargs: dict[str, Any], device: Optional[torch.device]
) -> Optional[str]:
    """Why DeepSpeed FusedLamb cannot run these parameters/arguments, or ``None`` if it can."""
    if not tensors or not all(
        _on_cuda(t, device) and t.is_contiguous() and t.dtype in (torch.float32, torch.float64) for t in tensors
    ):
        return "DeepSpeed FusedLamb needs contiguous float32/float64 CUDA parameters"
    if any(norm > 0 for norm in _uses_setting(params, kwargs, "max_grad_norm", 0.0)):
        return "DeepSpeed FusedLamb.step() cannot clip (max_grad_norm > 0) without caller-supplied norms"
    return None


def _build_deepspeed(params: list[Any], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Construct DeepSpeed FusedLamb (builds or loads its CUDA extension), with a ``TORCH_CUDA_ARCH_LIST`` its
    builder parses (``ds_kfac.integration.cuda_ops``: ``9.0a`` makes it fail; the user's value is restored)."""
    from deepspeed.ops.lamb import FusedLamb

    from ..integration.cuda_ops import deepspeed_arch_list

    with deepspeed_arch_list():
        return FusedLamb(params, **kwargs)


_FUSED_BACKENDS = (("apex", _apex_unsupported, _build_apex), ("deepspeed", _deepspeed_unsupported, _build_deepspeed))


def resolve_lamb(
    params: ParamsT, *, backend: str = "auto", device: Optional[torch.device] = None, **kwargs: Any
) -> torch.optim.Optimizer:
    """A LAMB optimizer with DeepSpeed ``FusedLamb`` arguments (``lr``, ``bias_correction``,
    ``betas``, ``eps``, ``eps_inside_sqrt``, ``weight_decay``, ``max_grad_norm``,
    ``max_coeff``, ``min_coeff``, ``amsgrad``) from the fastest backend that can run it.

    ``backend`` is ``"auto"`` (Apex, then DeepSpeed, then PyTorch; see the module
    docstring for when each applies and how Apex differs) or one of ``"apex"``,
    ``"deepspeed"``, ``"torch"`` to force it (``ValueError`` if it cannot run). ``device`` is where the parameters
    will be when the optimizer steps, if not where they are now: DeepSpeed builds a JSON optimizer's engine, and
    moves the model to its accelerator, after ``ds_kfac.initialize`` has built the optimizer on the model's CPU
    parameters (the fused ones keep references to the same ``Parameter`` objects and make their state at the first
    step, on the device).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown LAMB backend {backend!r}; allowed: {list(BACKENDS)}")
    _check_keys("LAMB", kwargs, LAMB_KEYS)
    if kwargs.pop("amsgrad", False):
        raise ValueError("LAMB does not support amsgrad=True (DeepSpeed FusedLamb refuses the AMSGrad variant)")
    params = list(params)
    tensors = _tensors(params)
    if any(isinstance(g, dict) and g.get(GROUP_KEY) for g in params):
        if backend not in ("auto", "torch"):
            raise ValueError(f"LAMB backend {backend!r} cannot apply K-FAC's eigenbasis directions: use 'torch'")
        return Lamb(params, **kwargs)

    failures = []
    for name, unsupported, build in _FUSED_BACKENDS:
        if backend not in ("auto", name):
            continue
        reason = unsupported(params, tensors, kwargs, device)
        if reason is None:
            try:
                # Fresh group dicts: torch.optim.Optimizer fills defaults into them, and a
                # failed attempt must not leave its defaults behind for the next backend.
                optimizer = build([dict(g) if isinstance(g, dict) else g for g in params], kwargs)
            except Exception as error:  # e.g. no CUDA extension, JIT build failure (no nvcc/ninja)
                reason = f"{name} LAMB failed to construct: {error!r}"
                failures.append(reason)
            else:
                logger.info("LAMB backend: %s", type(optimizer).__qualname__)
                return optimizer
        if backend == name:
            raise ValueError(f"LAMB backend {name!r} unavailable: {reason}")
        logger.debug("LAMB backend %s skipped: %s", name, reason)
    if failures:  # a fused LAMB could run these parameters and did not build: say why, not only at debug level
        warnings.warn(
            f"LAMB: the pure-PyTorch Lamb steps these CUDA parameters (the same update, slower), because "
            f"{'; '.join(failures)}",
            RuntimeWarning,
            stacklevel=2,
        )
    return Lamb(params, **kwargs)


def build_optimizer(
    type_name: str, params: ParamsT, params_dict: Optional[dict[str, Any]], device: Optional[torch.device] = None
) -> torch.optim.Optimizer:
    """Build the optimizer of a DeepSpeed config ``"optimizer": {"type": ..., "params": {...}}``.

    ``type_name`` is ``"Lamb"`` (see :func:`resolve_lamb`), ``"SGD"`` (``torch.optim.SGD``), or ``"Adam"`` /
    ``"AdamW"`` (:class:`~ds_kfac.optimizers.Adam`, decoupled weight decay unless ``"adam_w_mode": false`` for
    ``Adam``, as DeepSpeed reads them), case-insensitive.  Unknown types or parameter names raise ``ValueError``
    naming them and the allowed ones. ``device``: where the parameters will step (:func:`resolve_lamb`).
    """
    params_dict = dict(params_dict or {})
    kind = type_name.lower()
    if kind == "lamb":
        _check_keys(f"optimizer type {type_name!r}", params_dict, LAMB_KEYS)
        if "betas" in params_dict:
            params_dict["betas"] = tuple(params_dict["betas"])
        return resolve_lamb(params, device=device, **params_dict)
    if kind == "sgd":
        _check_keys(f"optimizer type {type_name!r}", params_dict, SGD_KEYS)
        return torch.optim.SGD(params, **params_dict)
    if kind in ("adam", "adamw"):
        _check_keys(f"optimizer type {type_name!r}", params_dict, ADAM_KEYS)
        params_dict.pop("torch_adam", None)
        if params_dict.pop("amsgrad", False):
            raise ValueError(f"optimizer type {type_name!r}: amsgrad=true is not supported here")
        decoupled = params_dict.pop("adam_w_mode", True)
        if kind == "adamw" and not decoupled:
            raise ValueError(f"optimizer type {type_name!r} with adam_w_mode=false: use type 'Adam' for L2 decay")
        if "betas" in params_dict:
            params_dict["betas"] = tuple(params_dict["betas"])
        return Adam(params, decoupled_weight_decay=decoupled, **params_dict)
    raise ValueError(f"unknown optimizer type {type_name!r}; allowed: {list(OPTIMIZER_TYPES)} (case-insensitive)")
