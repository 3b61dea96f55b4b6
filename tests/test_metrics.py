"""``metrics()`` reports the curvature options (docs/conventions.md, the "Metrics" items of "Eigenvalue correction",
"Sampled Fisher" and "Unit-wise BatchNorm"): exact counts on a small model over a known schedule, and the phase
timer's accounting of a phase inside another against a scripted clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_kfac import KFACPreconditioner, timing
from ds_kfac.timing import PhaseTimer

pytestmark = pytest.mark.timeout(60)

STEPS, GA, FACTOR_EVERY = 7, 3, 2
OPTIONS = ("fisher_sampled", "eigenvalue_correction", "batchnorm_unit_wise")


def _model() -> nn.Module:
    """Two Linear layers (Kronecker blocks) around a BatchNorm1d (a unit-wise block with ``batchnorm``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 4))


def _run(
    model: nn.Module, kfac: KFACPreconditioner, steps: range, micro: list[int], finish: bool = True
) -> tuple[int, int]:
    """``GA`` micro-batches per step, ``sample_fisher`` called on each; returns the passes it reported running and
    the steps with at least one. ``finish=False``: precondition without finishing the step (as the engine does
    before it knows whether DeepSpeed skips the step)."""
    passes = steps_with_passes = 0
    for step in steps:
        ran = 0
        for micro[0] in range(GA):
            g = torch.Generator().manual_seed(100 * step + micro[0])
            x, y = torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)
            out = model(x)
            ran += kfac.sample_fisher(out, "cross_entropy")
            (F.cross_entropy(out, y) / GA).backward()
        if finish:
            kfac.step()
        else:
            kfac.precondition_gradients()
        model.zero_grad()
        passes, steps_with_passes = passes + ran, steps_with_passes + (ran > 0)
    return passes, steps_with_passes


def _build(factor_micro_batches: Optional[int] = None, **keys) -> tuple[nn.Module, KFACPreconditioner, list[int]]:
    model, micro = _model(), [0]
    kfac = KFACPreconditioner(
        model,
        lr=0.1,
        accumulation_steps=GA,
        micro_batch=lambda: micro[0],
        factor_update_steps=FACTOR_EVERY,
        inv_update_steps=2,
        factor_micro_batches=factor_micro_batches,
        **keys,
    )
    return model, kfac, micro


@pytest.mark.parametrize("gathering", [None, 1], ids=["all_micro_batches", "last_micro_batch"])
def test_every_option_on_counts_blocks_and_sampled_passes(gathering: Optional[int]) -> None:
    """All three options on, 7 steps of 3 micro-batches, factors every 2 steps (steps 0, 2, 4, 6) from every
    micro-batch or the last: as many passes as ``sample_fisher`` said it ran (4 x 3 or 4 x 1), in 4 factor steps.
    A factor step that DeepSpeed would skip (snapshot, precondition, restore) leaves the counts as they were."""
    model, kfac, micro = _build(gathering, fisher="sampled", eigenvalue_correction=True, batchnorm="unit-wise")
    passes, factor_steps = _run(model, kfac, range(STEPS), micro)
    per_step = GA if gathering is None else gathering
    assert (passes, factor_steps) == (len(range(0, STEPS, FACTOR_EVERY)) * per_step, len(range(0, STEPS, 2)))
    metrics = kfac.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith(("kfac/option/", "kfac/blocks/"))} == {
        **{f"kfac/option/{name}": 1.0 for name in OPTIONS},
        "kfac/option/eigenbasis_moments": 0.0,
        "kfac/blocks/kronecker": 2.0,
        "kfac/blocks/eigenvalue_corrected": 2.0,
        "kfac/blocks/unit_wise": 1.0,
    }
    assert metrics["kfac/count/sampled_passes"] == passes and metrics["kfac/count/sampled_factor_steps"] == 4
    assert metrics["kfac/steps"] == STEPS and metrics["kfac/seconds/sampled_backward"] > 0
    _run(model, kfac, range(STEPS, STEPS + 1), micro)  # step 7 updates no factors; step 8 does
    before = dict(kfac.counters)
    snapshot = kfac.snapshot()
    _run(model, kfac, range(STEPS + 1, STEPS + 2), micro, finish=False)
    assert kfac.counters["sampled_passes"] == passes + per_step
    kfac.restore(snapshot)
    assert dict(kfac.counters) == before


def test_without_the_options_nothing_is_sampled_or_corrected() -> None:
    """The defaults: every option reported off, BatchNorm not registered, no sampled pass, phase or count."""
    model, kfac, micro = _build()
    assert _run(model, kfac, range(3), micro) == (0, 0)
    metrics = kfac.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith(("kfac/option/", "kfac/blocks/"))} == {
        **{f"kfac/option/{name}": 0.0 for name in (*OPTIONS, "eigenbasis_moments")},
        "kfac/blocks/kronecker": 2.0,
        "kfac/blocks/eigenvalue_corrected": 0.0,
        "kfac/blocks/unit_wise": 0.0,
    }
    assert not [k for k in metrics if k.startswith(("kfac/count/sampled", "kfac/seconds/sampled"))]


def test_a_phase_inside_another_counts_in_the_inner_one_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted clock: outer 0-10 s containing inner 2-5 s (containing innermost 3-4 s) and inner 6-7 s. Each
    phase gets its own time less its nested phases', so the total is the outer phase's wall time."""
    clock = iter([0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 10.0])
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timer = PhaseTimer()
    with timer.phase("outer"):
        with timer.phase("inner"):
            with timer.phase("innermost"):
                pass
        with timer.phase("inner"):
            pass
    assert dict(timer.seconds) == {"outer": 10.0 - 3.0 - 1.0, "inner": 3.0 - 1.0 + 1.0, "innermost": 1.0}
    assert sum(timer.seconds.values()) == 10.0
