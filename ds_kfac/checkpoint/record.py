"""The saved state's layout, named once: a layer's entry (:class:`LayerRecord`) and the top-level keys.

A checkpoint's K-FAC state is a plain dict (``torch.load(weights_only=True)`` reads it back) of the
:data:`REQUIRED_KEYS`, the optional ones and the method keys; its ``"layers"`` maps each layer's name to the
dict of a :class:`LayerRecord`. Saving (:mod:`.io`), gathering (:mod:`ds_kfac.placement.state_gather`),
checking (:mod:`.validation`) and loading all read these names from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

STATE_VERSION = 1

METHOD_KEYS = (
    "compute_method",
    "eigenvalue_outer_product",
    "eigenvalue_correction",
    "eigenbasis_moments",
    "relative_damping",
    "conv_factors",
    "fisher",
    "batchnorm",
)
"""Config keys that decide what a factor or decomposition holds: recorded in a checkpoint, which loads only where
they match."""

REQUIRED_KEYS = ("version", "steps", "counters", "layers")

OPTIONAL_KEYS = ("refresh", "pending_decompositions", "auto_placement")
"""Top-level keys that a state may leave out (it then has none)."""

AUTO_PLACEMENT_KEYS = ("grad_worker_fraction", "calibration")
"""``"auto_placement"``: the preset ``"grad_worker_fraction": "auto"`` chose and the calibration it chose from
(``None`` where the config named a fraction). A run whose ``"auto"`` chooses another loads no such state."""

SHAPE = "shape"
"""A layer entry's ``(a_dim, g_dim)``."""

DECOMPOSITION = "state"
"""A layer entry's decomposition: its tensors side after side, or ``None``."""

REFERENCES_SUFFIX = "_refs"

MOMENTS = "moments"
"""A layer entry's eigenbasis moments (``eigenbasis_moments``): ``None`` or a dict of :data:`MOMENT_KEYS`."""

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "step")
"""The moments' entry: ``m`` and ``v`` (``g_dim x a_dim``, in the layer's saved eigenbasis) and their update count,
named as ``torch.optim.Adam`` names its state."""


def references_key(side: str) -> str:
    """The entry key of statistic ``side``'s adaptive-refresh references, ``<side>_refs``."""
    return f"{side}{REFERENCES_SUFFIX}"


def layer_keys(statistics: Iterable[str], sides: Iterable[str], adaptive: bool, moments: bool) -> tuple[str, ...]:
    """The keys of a saved layer entry, in the order saved: the shape, each running statistic, the decomposition,
    with adaptive refresh each decomposed side's references, and with ``eigenbasis_moments`` the moments."""
    refs = tuple(map(references_key, sides)) if adaptive else ()
    return (SHAPE, *statistics, DECOMPOSITION, *refs, *((MOMENTS,) if moments else ()))


@dataclass
class LayerRecord:
    """One layer's saved state: what :meth:`to_dict` writes under its name in ``"layers"``.

    On a rank before gathering, each field holds references to what that rank has (``None`` elsewhere); once
    gathered and saved, CPU tensors."""

    statistics: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    """Each running statistic by name (``"A"``, ``"G"``, ``"S"``; ``"F"`` for a unit-wise block)."""
    decomposition: Optional[Sequence[torch.Tensor]] = None
    references: dict[str, Sequence[Optional[torch.Tensor]]] = field(default_factory=dict)
    """Adaptive refresh: per decomposed side, the statistic at its last two refreshes ``[last, before_last]``."""
    moments: Optional[Sequence[torch.Tensor]] = None
    """``eigenbasis_moments``: ``(m, v, step)``, the step count a 0-dim int64 tensor (so that it travels with them)."""
    has_moments: bool = False
    """Whether the entry has a moments key (``eigenbasis_moments``), ``None`` or not."""
    shape: Optional[tuple[int, int]] = None
    """``(a_dim, g_dim)``: set on the saved record only."""

    def to_dict(self) -> dict[str, Any]:
        """The entry as saved, keys in :func:`layer_keys`'s order (no ``shape`` while it is unset)."""
        entry: dict[str, Any] = {} if self.shape is None else {SHAPE: self.shape}
        entry.update(self.statistics)
        entry[DECOMPOSITION] = self.decomposition
        entry.update({references_key(side): refs for side, refs in self.references.items()})
        if self.has_moments:
            m = self.moments
            entry[MOMENTS] = None if m is None else dict(zip(MOMENT_KEYS, (m[0], m[1], int(m[2]))))
        return entry

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> LayerRecord:
        """The record of a saved entry that :mod:`.validation` accepted."""
        record = cls(decomposition=entry[DECOMPOSITION], shape=entry.get(SHAPE), has_moments=MOMENTS in entry)
        for key, value in entry.items():
            if key.endswith(REFERENCES_SUFFIX):
                record.references[key[: -len(REFERENCES_SUFFIX)]] = value
            elif key == MOMENTS:
                record.moments = None if value is None else tuple(value[k] for k in MOMENT_KEYS)
            elif key not in (SHAPE, DECOMPOSITION):
                record.statistics[key] = value
        return record
