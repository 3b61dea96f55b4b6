"""Which modules of a model K-FAC preconditions.

Modules are matched by type (through the MRO, so subclasses of ``nn.Linear``
count), never by class-name strings. New module types plug in with
:func:`register_adapter`.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal, Optional

from torch import nn

from .base import LayerAdapter
from .batchnorm import BatchNormAdapter
from .conv2d import Conv2dAdapter
from .linear import LinearAdapter
from .tensor_parallel import TensorParallelAdapter, TensorParallelFactors

logger = logging.getLogger(__name__)

_ADAPTERS: dict[type[nn.Module], type[LayerAdapter]] = {nn.Linear: LinearAdapter, nn.Conv2d: Conv2dAdapter}


OPTIONAL_ADAPTERS = {"megatron.core.tensor_parallel": "ds_kfac.integration.megatron"}
"""Adapters for optional libraries: once the library is imported (a model uses it), :func:`find_layers` imports
their module, which registers them (``import ds_kfac`` itself never imports the library)."""


def _load_optional_adapters() -> None:
    for library, module in OPTIONAL_ADAPTERS.items():
        if library in sys.modules:
            importlib.import_module(module)


def register_adapter(module_type: type[nn.Module], adapter: type[LayerAdapter]) -> None:
    """Teach K-FAC a new module type (and its subclasses)."""
    _ADAPTERS[module_type] = adapter


def adapter_for(module: nn.Module) -> type[LayerAdapter] | None:
    for cls in type(module).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
    return None


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
"""The BatchNorm types ``"batchnorm": "unit-wise"`` registers."""

FROZEN_WEIGHT = (
    "frozen weight with a trainable bias (K-FAC preconditions a layer's weight; the bias trains with the base "
    "optimizer alone)"
)


@dataclass(frozen=True)
class SkippedLayer:
    name: str
    reason: str


def find_layers(
    model: nn.Module,
    skip_layers: Iterable[str] = (),
    max_factor_dim: int = 8192,
    conv_factors: Literal["expand", "reduce"] = "expand",
    warn: bool = True,
    tensor_parallel_factors: TensorParallelFactors = "exact",
    batchnorm: bool = False,
    tied: bool = False,
    one_sided_dim: Optional[int] = None,
) -> tuple[list[tuple[str, LayerAdapter]], list[SkippedLayer]]:
    """Adapters for the model's supported modules, in ``named_modules`` order,
    and the supported modules that were skipped, with why. Conv2d adapters get
    ``conv_factors`` (K-FAC-expand or K-FAC-reduce rows), tensor-parallel ones
    ``tensor_parallel_factors`` (:mod:`ds_kfac.layers.tensor_parallel`). With
    ``batchnorm``, ``nn.BatchNorm1d``/``nn.BatchNorm2d`` layers with affine
    parameters (and their subclasses) are registered too, for the unit-wise
    natural gradient. With ``tied`` (``tied_layers: "precondition"``), a layer
    whose parameters other modules also hold is registered, unless another
    registered layer holds one of them too. With ``one_sided_dim``
    (``eigenbasis_max_dim``), a side larger than it is left in the parameter
    basis, so only the other must fit ``max_factor_dim``; a layer with both
    sides larger is skipped.

    A module is skipped when its name matches one of ``skip_layers`` (``re.search``),
    when its weight is frozen (a frozen bias alone is left out of the layer's
    factors instead), when a factor would be larger than ``max_factor_dim``
    (vocabulary-sized embeddings and heads), or when another module holds one of
    its parameters (tied weights: the gradient sums every use, which this layer's
    factors do not describe). Unsupported variants of a supported type (e.g.
    grouped Conv2d) raise :class:`~ds_kfac.layers.base.UnsupportedLayerError`
    naming the module, unless skipped by name.

    Skips are logged at INFO. With ``warn``, a ``UserWarning`` names the layers
    skipped for tied parameters, and another says so when no layer is registered.
    """
    _load_optional_adapters()
    patterns = [re.compile(p) for p in skip_layers]
    owners = _owners(model)
    layers: list[tuple[str, LayerAdapter]] = []
    skipped: list[SkippedLayer] = []
    tied_skips: list[SkippedLayer] = []
    tied_found = False  # a registered layer sharing a parameter: with ``tied``, what the key changes
    for name, module in model.named_modules():
        adapter_cls = adapter_for(module)
        if adapter_cls is None and batchnorm and isinstance(module, BATCHNORMS) and module.affine:
            adapter_cls = BatchNormAdapter
        if adapter_cls is None:
            continue
        hit = next((p.pattern for p in patterns if p.search(name)), None)
        if hit is not None:
            skipped.append(SkippedLayer(name, f"name matches skip_layers pattern {hit!r}"))
            continue
        try:
            if issubclass(adapter_cls, Conv2dAdapter):
                adapter = adapter_cls(module, conv_factors=conv_factors)
            elif issubclass(adapter_cls, TensorParallelAdapter):
                adapter = adapter_cls(module, tensor_parallel_factors=tensor_parallel_factors)
            else:
                adapter = adapter_cls(module)
        except ValueError as err:
            raise type(err)(f"layer {name!r}: {err}; add it to skip_layers to train it without K-FAC") from None
        if not adapter.params()[0].requires_grad:
            skipped.append(
                SkippedLayer(name, FROZEN_WEIGHT if adapter.has_bias else "frozen (no parameter requires grad)")
            )
        elif not (kept := kept_sides(adapter, one_sided_dim)):
            skipped.append(
                SkippedLayer(name, f"{adapter.describe()}: both sides exceed eigenbasis_max_dim={one_sided_dim}")
            )
        elif max(kept.values()) > max_factor_dim:
            skipped.append(SkippedLayer(name, f"{adapter.describe()} exceeds max_factor_dim={max_factor_dim}"))
        elif (shared := _shared(name, module, adapter.params(), owners)) and not tied:
            tied_skips.append(SkippedLayer(name, f"tied: {shared}"))
            skipped.append(tied_skips[-1])
        else:
            layers.append((name, adapter))
            tied_found = tied_found or bool(shared)
    if tied:
        layers = _without_doubly_registered(layers, skipped, tied_skips)
    for s in skipped:
        logger.info("K-FAC skips %s: %s", s.name, s.reason)
    if warn:
        _warn(model, layers, skipped, tied_skips)
        if tied and layers and not tied_found:
            warnings.warn(
                'tied_layers: "precondition" changes nothing: no layer K-FAC registers shares a parameter with '
                f"another module ({_tied_skipped(model, skipped, owners)})",
                UserWarning,
                stacklevel=3,
            )
        _warn_unregistered(model, patterns, batchnorm)
    return layers, skipped


def kept_sides(adapter: LayerAdapter, one_sided_dim: Optional[int]) -> dict[str, int]:
    """The factors K-FAC collects for a layer, by side (``"A"``, ``"G"``) with their sizes: both, or with
    ``one_sided_dim`` those not above it (one: a one-sided block; none: the layer is skipped)."""
    sides = {"A": adapter.a_dim, "G": adapter.g_dim}
    return sides if one_sided_dim is None else {s: d for s, d in sides.items() if d <= one_sided_dim}


def _without_doubly_registered(
    layers: list[tuple[str, LayerAdapter]], skipped: list[SkippedLayer], tied_skips: list[SkippedLayer]
) -> list[tuple[str, LayerAdapter]]:
    """``layers`` less those holding a parameter another registered layer holds too (each would precondition the
    same gradient), which are added to the skips."""
    holders: dict[nn.Parameter, list[str]] = defaultdict(list)
    for name, adapter in layers:
        for p in adapter.params():
            holders[p].append(name)
    kept = []
    for name, adapter in layers:
        others = sorted({o for p in adapter.params() for o in holders[p] if o != name})
        if others:
            tied_skips.append(SkippedLayer(name, f"tied: a parameter is also that of registered layer(s) {others}"))
            skipped.append(tied_skips[-1])
        else:
            kept.append((name, adapter))
    return kept


def _warn_unregistered(model: nn.Module, patterns: list[re.Pattern], batchnorm: bool) -> None:
    """Name the trainable modules K-FAC looks like it should precondition but does not, which the base optimizer
    would otherwise train alone without a word: convolutions other than ``nn.Conv2d`` (``nn.Conv1d``, ``nn.Conv3d``,
    transposed), and, with ``batchnorm``, BatchNorm layers of other types (``nn.SyncBatchNorm``, ``nn.BatchNorm3d``),
    or none at all. Modules matching ``skip_layers`` are not named (listing them there silences this)."""

    def unregistered(kind: type[nn.Module], handled: tuple[type[nn.Module], ...]) -> str:
        return ", ".join(
            f"{name!r} ({type(module).__name__})"
            for name, module in model.named_modules()
            if isinstance(module, kind)
            and not isinstance(module, handled)
            and any(p.requires_grad for p in module.parameters(recurse=False))
            and not any(pattern.search(name) for pattern in patterns)
        )

    convolutions = unregistered(nn.modules.conv._ConvNd, tuple(_ADAPTERS))
    if convolutions:
        warnings.warn(
            "K-FAC preconditions nn.Conv2d, not these convolutions, which train with the base optimizer alone "
            f"(conv_factors does not apply to them; list them in skip_layers to silence this): {convolutions}",
            UserWarning,
            stacklevel=4,
        )
    if not batchnorm:
        return
    norms = unregistered(nn.modules.batchnorm._BatchNorm, BATCHNORMS)
    if norms:
        why = f"not these, which train with the base optimizer alone (skip_layers silences this): {norms}"
    elif not any(isinstance(m, BATCHNORMS) and m.affine for m in model.modules()):
        why = "the model (on a pipeline, this stage) has no such layer, so the key changes nothing"
    else:
        return
    warnings.warn(
        f'"batchnorm": "unit-wise" preconditions nn.BatchNorm1d and nn.BatchNorm2d layers with affine parameters; '
        f"{why}",
        UserWarning,
        stacklevel=4,
    )


Owners = dict[nn.Parameter, list[tuple[nn.Module, str, str]]]


def _owners(model: nn.Module) -> Owners:
    """Every module holding each parameter, with the module's name and the parameter's qualified name
    (a module registered under several names counts once: sharing a whole module is not tying)."""
    owners: Owners = defaultdict(list)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            owners[param].append((module, module_name, f"{module_name}.{param_name}".lstrip(".")))
    return owners


def _tied_skipped(model: nn.Module, skipped: list[SkippedLayer], owners: Owners) -> str:
    """Why ``tied_layers`` found no tied layer: the skipped layers that are tied, with their reasons, or a guess."""
    tied = [
        f"{s.name!r} ({s.reason})"
        for s in skipped
        if _shared(s.name, module := model.get_submodule(s.name), module.parameters(recurse=False), owners)
    ]
    if tied:
        return f"the tied layers are skipped: {', '.join(tied)}"
    return "were the weights tied after K-FAC was attached?"


def _shared(name: str, module: nn.Module, params: Iterable[nn.Parameter], owners: Owners) -> str:
    """Which of layer ``name``'s ``params`` other modules also hold, and where ('' if none)."""
    parts = []
    for param in params:
        own = next((qualified for m, _, qualified in owners[param] if m is module), name)
        others = [f"{other!r} (as {qualified!r})" for m, other, qualified in owners[param] if m is not module]
        if others:
            parts.append(f"parameter {own!r} is shared with module {', '.join(others)}")
    return "; ".join(parts)


def _warn(
    model: nn.Module, layers: list[tuple[str, LayerAdapter]], skipped: list[SkippedLayer], tied: list[SkippedLayer]
) -> None:
    """The skips a user must hear about, and with no layer registered why, naming the layers seen (stack level: the
    caller of ``KFACPreconditioner``)."""
    if tied:
        warnings.warn(
            "K-FAC skips layers whose parameters other modules share (tied weights: their gradient sums every use, "
            'which one layer\'s factors do not describe; with eigenbasis_moments, tied_layers: "precondition" '
            "keeps their moments in the layer's eigenbasis); the base optimizer trains them without K-FAC: "
            + "; ".join(f"{s.name!r} ({s.reason})" for s in tied),
            UserWarning,
            stacklevel=4,
        )
    if layers:
        return
    if skipped:
        why = "; ".join(f"{s.name!r}: {s.reason}" for s in skipped)
        message = f"every supported layer was skipped ({why})"
    else:
        types = ", ".join(t.__name__ for t in _ADAPTERS)
        message = (
            f"the model has no module of a supported type ({types} or a subclass), {_trainable_modules(model)}; "
            f"teach K-FAC another module type with ds_kfac.register_adapter(module_type, adapter)"
        )
    warnings.warn(
        f"K-FAC registered no layer, so it preconditions nothing and the model trains with the base optimizer "
        f"alone: {message}",
        UserWarning,
        stacklevel=4,
    )


def _trainable_modules(model: nn.Module, most: int = 8) -> str:
    """The modules of ``model`` holding trainable parameters, by name and type (the first ``most``): what K-FAC saw
    when it registered none."""
    seen = [
        f"{name!r} ({type(module).__name__})"
        for name, module in model.named_modules()
        if any(p.requires_grad for p in module.parameters(recurse=False))
    ]
    if not seen:
        return "nor any module with trainable parameters"
    more = f" and {len(seen) - most} more" if len(seen) > most else ""
    return f"only {', '.join(seen[:most])}{more} with trainable parameters"
