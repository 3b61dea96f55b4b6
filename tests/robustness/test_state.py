"""Issue 14: the state a step changes has one home (``ds_kfac.state``), so snapshot, restore, save and
load cover the same fields and a skipped step leaves no trace."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from ds_kfac import KFACPreconditioner
from ds_kfac.state import Scalars

SAVED = {"steps", "counters", "pending", "seen"}  # seen is saved as the layers whose A is present
NOT_SAVED = {"last_nu"}  # recomputed at every step (monitoring only)


def test_every_scalar_is_saved_or_declared_transient() -> None:
    """A new field of :class:`Scalars` must be added to the checkpoint (and here) deliberately."""
    assert {f.name for f in dataclasses.fields(Scalars)} == SAVED | NOT_SAVED


def _run(skip_at: set[int], steps: int = 6) -> KFACPreconditioner:
    """Train ``steps`` steps; at the steps in ``skip_at`` first run one attempt that is undone (as DeepSpeed
    does for an overflowed step), with a different batch, then the real one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    kfac = KFACPreconditioner(
        model, lr=0.1, kl_clip=0.01, damping=0.01, factor_update_steps=2, inv_update_steps="adaptive"
    )
    g, bad = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for step in range(steps):
        attempts = 2 if step in skip_at else 1
        for attempt in range(attempts):
            if attempt < attempts - 1:  # a bad step: other, large statistics that must leave no trace
                x, y = 100 * torch.randn(8, 5, generator=bad), torch.randn(8, 3, generator=bad)
            else:
                x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            snap = kfac.snapshot()
            assert kfac.precondition_gradients()
            if attempt < attempts - 1:
                kfac.restore(snap)
            else:
                kfac.finish_step()
    return kfac


def test_an_undone_step_leaves_no_trace() -> None:
    """Steps undone at a factor step, a decomposition step and a plain step: the run equals one that never
    attempted them, in every scalar, factor, decomposition and refresh field."""
    clean, undone = _run(set()), _run({0, 2, 3})
    a, b = clean.state.scalars, undone.state.scalars
    assert (a.steps, dict(a.counters), a.pending, a.seen) == (b.steps, dict(b.counters), b.pending, b.seen)
    torch.testing.assert_close(clean.last_nu, undone.last_nu, rtol=0, atol=0)
    for x, y in zip(clean.blocks, undone.blocks):
        assert torch.equal(x.a.value, y.a.value) and torch.equal(x.g.value, y.g.value)
        assert all(torch.equal(s, t) for s, t in zip(x.decomposition, y.decomposition))
    assert copy.deepcopy(clean.refresh.state_dict()) == copy.deepcopy(undone.refresh.state_dict())
