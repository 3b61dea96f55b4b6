"""A preconditioner's state out and back in: :func:`state_dict`, :func:`check_state_dict`, :func:`load_state_dict`.

The bodies of :class:`~ds_kfac.KFACPreconditioner`'s methods of the same names, which delegate here, so that
writing, checking (:mod:`.validation`) and reading the saved layout (:mod:`.record`) sit together.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from ..curvature import blocks_device
from ..placement.state_gather import gather_state
from ..state import Scalars
from .record import AUTO_PLACEMENT_KEYS, METHOD_KEYS, STATE_VERSION, LayerRecord
from .validation import CheckedState, ExpectedLayer, ExpectedState, check_state

if TYPE_CHECKING:
    from ..preconditioner import KFACPreconditioner


def state_dict(kfac: KFACPreconditioner) -> Optional[dict[str, Any]]:
    """``kfac``'s whole state on the saving rank, ``None`` on the others (:meth:`KFACPreconditioner.state_dict`)."""
    layers = gather_state(kfac.distributor, _local_state(kfac))
    if layers is None:
        return None
    scalars = kfac.state.scalars
    p = scalars.pending
    dims = {b.name: (b.adapter.a_dim, b.adapter.g_dim) for b in kfac.blocks}
    return {
        "version": STATE_VERSION,
        "steps": scalars.steps,
        **_method_keys(kfac),
        "counters": dict(scalars.counters),
        "refresh": kfac.refresh.state_dict() if kfac.refresh is not None else None,
        # Restarted on load from the saved factors, which are those it started from.
        "pending_decompositions": None if p is None else {"started": p.started, "install_at": p.install_at},
        "layers": {name: dataclasses.replace(record, shape=dims[name]).to_dict() for name, record in layers.items()},
        "auto_placement": _auto_placement(kfac),
    }


def _auto_placement(kfac: KFACPreconditioner) -> Optional[dict[str, Any]]:
    """What ``"auto"`` chose for this run (``ds_kfac.initialize`` leaves its ``calibration`` on the config it chose
    for), as saved and as a state must match; ``None`` where the config named a fraction."""
    config = kfac.config
    return (
        None
        if config.calibration is None
        else dict(zip(AUTO_PLACEMENT_KEYS, (config.grad_worker_fraction, config.calibration)))
    )


def _method_keys(kfac: KFACPreconditioner) -> dict[str, Any]:
    """This run's value of each of :data:`METHOD_KEYS`, as saved and as a state must match."""
    return {key: getattr(kfac.config, key) for key in METHOD_KEYS}


def _local_state(kfac: KFACPreconditioner) -> dict[str, LayerRecord]:
    """This rank's view of every layer's state: references to what it holds, ``None`` elsewhere."""
    state = {b.name: LayerRecord({k: s.value for k, s in b.statistics().items()}, b.decomposition) for b in kfac.blocks}
    for b in kfac.blocks:
        if b.moments is not None:
            value, steps = b.moments.value, torch.tensor(b.moments.steps, dtype=torch.int64)
            state[b.name].moments = None if value is None else (*value, steps.to(value[0].device))
            state[b.name].has_moments = True
    if kfac.refresh is not None:
        for (name, side), f in kfac.refresh.factors.items():
            state[name].references[side] = [f.last, f.before_last]
    return state


def check_state_dict(kfac: KFACPreconditioner, state: Union[dict[str, Any], CheckedState]) -> CheckedState:
    """``state`` checked against ``kfac``, changing nothing (:meth:`KFACPreconditioner.check_state_dict`)."""
    return check_state(state, _expected_state(kfac))


def _expected_state(kfac: KFACPreconditioner) -> ExpectedState:
    """What a state must hold to load into ``kfac``."""
    layers = {
        b.name: ExpectedLayer(
            b.adapter.a_dim,
            b.adapter.g_dim,
            {key: stat.shape for key, stat in b.statistics().items()},
            b.sides,
            b.method.name,
            [shape for shapes in b.side_shapes().values() for shape in shapes],
        )
        for b in kfac.blocks
    }
    return ExpectedState(
        method_keys=_method_keys(kfac),
        layers=layers,
        adaptive=kfac.refresh is not None,
        moments=kfac.config.eigenbasis_moments,
        auto_placement=_auto_placement(kfac),
    )


def load_state_dict(kfac: KFACPreconditioner, state: Union[dict[str, Any], CheckedState]) -> None:
    """Install ``state`` into ``kfac`` once all of it is checked (:meth:`KFACPreconditioner.load_state_dict`):
    each rank keeps the statistics, decompositions and references that its placement gives it."""
    state = check_state_dict(kfac, state).state
    factor_dtype, inv_dtype = kfac.config.factor_torch_dtype, kfac.config.inv_torch_dtype
    distributor = kfac.distributor
    records = {name: LayerRecord.from_dict(entry) for name, entry in state["layers"].items()}
    for b in kfac.blocks:
        record = records[b.name]
        device = b.adapter.module.weight.device
        for key, stat in b.statistics().items():
            value = record.statistics[key]
            kept = distributor.stores_factor(b, key) and value is not None
            stat.value = value.to(device, factor_dtype) if kept else None
        held = distributor.holds_decomposition(b) and record.decomposition is not None
        b.decomposition = tuple(t.to(device, inv_dtype) for t in record.decomposition) if held else None
        if b.moments is not None:
            mine = distributor.rank in distributor.preconditioners(b) and record.moments is not None
            m, v, steps = record.moments if mine else (None, None, 0)
            b.moments.value = (m.to(device, inv_dtype), v.to(device, inv_dtype)) if mine else None
            b.moments.steps = steps
    kfac.discard_step_statistics()
    if kfac.refresh is not None:
        kfac.refresh.load_state_dict(state["refresh"])
        device = blocks_device(kfac.blocks)
        for (name, side), f in kfac.refresh.factors.items():
            refs = records[name].references[side] if distributor.decomposes(name, side) else (None, None)
            f.last, f.before_last = (None if t is None else t.to(device, factor_dtype) for t in refs)
    kfac.state.scalars = Scalars(
        steps=state["steps"],
        counters=defaultdict(int, state["counters"]),
        seen=frozenset(b.name for b in kfac.blocks if records[b.name].statistics[b.sides[0]] is not None),
    )
    pending = state.get("pending_decompositions")
    if pending is not None:
        kfac.schedule.run_in_background(pending["started"], pending["install_at"])
    kfac._arm_hooks()
