"""Which modules of a model K-FAC preconditions.

Modules are matched by type (through the MRO, so subclasses of ``nn.Linear``
count), never by class-name strings. New module types plug in with
:func:`register_adapter`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterable, Literal

from torch import nn

from .base import LayerAdapter
from .conv2d import Conv2dAdapter
from .linear import LinearAdapter

logger = logging.getLogger(__name__)

_ADAPTERS: dict[type[nn.Module], type[LayerAdapter]] = {nn.Linear: LinearAdapter, nn.Conv2d: Conv2dAdapter}


def register_adapter(module_type: type[nn.Module], adapter: type[LayerAdapter]) -> None:
    """Teach K-FAC a new module type (and its subclasses)."""
    _ADAPTERS[module_type] = adapter


def adapter_for(module: nn.Module) -> type[LayerAdapter] | None:
    for cls in type(module).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
    return None


@dataclass(frozen=True)
class SkippedLayer:
    name: str
    reason: str


def find_layers(
    model: nn.Module,
    skip_layers: Iterable[str] = (),
    max_factor_dim: int = 8192,
    conv_factors: Literal["expand", "reduce"] = "expand",
) -> tuple[list[tuple[str, LayerAdapter]], list[SkippedLayer]]:
    """Adapters for the model's supported modules, in ``named_modules`` order,
    and the supported modules that were skipped, with why. Conv2d adapters get
    ``conv_factors`` (K-FAC-expand or K-FAC-reduce rows).

    A module is skipped when its name matches one of ``skip_layers`` (``re.search``),
    when a factor would be larger than ``max_factor_dim`` (vocabulary-sized
    embeddings and heads), or when none of its parameters require grad.
    Unsupported variants of a supported type (e.g. grouped Conv2d) raise
    :class:`~ds_kfac.layers.base.UnsupportedLayerError` naming the module, unless skipped by name.
    """
    patterns = [re.compile(p) for p in skip_layers]
    layers: list[tuple[str, LayerAdapter]] = []
    skipped: list[SkippedLayer] = []
    for name, module in model.named_modules():
        adapter_cls = adapter_for(module)
        if adapter_cls is None:
            continue
        hit = next((p.pattern for p in patterns if p.search(name)), None)
        if hit is not None:
            skipped.append(SkippedLayer(name, f"name matches skip_layers pattern {hit!r}"))
            continue
        try:
            is_conv = issubclass(adapter_cls, Conv2dAdapter)
            adapter = adapter_cls(module, conv_factors=conv_factors) if is_conv else adapter_cls(module)
        except ValueError as err:
            raise type(err)(f"layer {name!r}: {err}; add it to skip_layers to train it without K-FAC") from None
        if not any(p.requires_grad for p in adapter.params()):
            skipped.append(SkippedLayer(name, "frozen (no parameter requires grad)"))
        elif max(adapter.a_dim, adapter.g_dim) > max_factor_dim:
            skipped.append(SkippedLayer(name, f"{adapter.describe()} exceeds max_factor_dim={max_factor_dim}"))
        else:
            layers.append((name, adapter))
    for s in skipped:
        logger.info("K-FAC skips %s: %s", s.name, s.reason)
    return layers, skipped
