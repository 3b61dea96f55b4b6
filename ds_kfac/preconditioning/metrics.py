"""What a preconditioner reports: bytes held by category, and the scalars of a training log."""

from __future__ import annotations

from typing import Optional

import torch

from ..config import KFACConfig
from ..curvature import AdaptiveRefresh, CurvatureBlock, KFACBlock, StackedStates, UnitWiseBlock


def memory_usage(
    config: KFACConfig, blocks: list[CurvatureBlock], stacks: StackedStates, refresh: Optional[AdaptiveRefresh]
) -> dict[str, int]:
    """Bytes held on this rank by category (:meth:`ds_kfac.KFACPreconditioner.memory_usage`)."""
    usage = {"factors": 0, "decompositions": 0, "accumulators": 0, "refresh_references": 0}
    usage["preconditioning_cache"] = stacks.cache_bytes()
    if config.eigenvalue_correction:
        usage["eigenvalue_corrections"] = 0
    for b in blocks:
        for side, stat in b.statistics().items():
            running, accumulator = stat.nbytes()
            usage["eigenvalue_corrections" if side == "S" else "factors"] += running
            usage["accumulators"] += accumulator
        usage["decompositions"] += sum(t.numel() * t.element_size() for t in (b.state or ()))
    if refresh is not None:
        references = [t for f in refresh.factors.values() for t in (f.last, f.before_last) if t is not None]
        usage["refresh_references"] = sum(t.numel() * t.element_size() for t in references)
    return usage


def step_metrics(
    steps: int,
    last_nu: Optional[torch.Tensor],
    timings: dict[str, float],
    counters: dict[str, int],
    refresh: Optional[AdaptiveRefresh],
    options: dict[str, float],
) -> dict[str, float]:
    """K-FAC's scalars by name (:meth:`ds_kfac.KFACPreconditioner.metrics`)."""
    metrics = {"kfac/steps": float(steps), **options}
    if last_nu is not None:
        metrics["kfac/nu"] = float(last_nu)
    metrics.update({f"kfac/seconds/{phase}": float(t) for phase, t in timings.items()})
    metrics.update({f"kfac/count/{name}": float(n) for name, n in counters.items()})
    if refresh is not None:
        metrics.update({f"kfac/interval/{key}": float(n) for key, n in refresh.intervals().items()})
    return metrics


def option_metrics(config: KFACConfig, blocks: list[CurvatureBlock]) -> dict[str, float]:
    """The curvature options and the blocks they reach (:meth:`ds_kfac.KFACPreconditioner.option_metrics`)."""
    kronecker = [b for b in blocks if isinstance(b, KFACBlock)]
    return {
        "kfac/option/fisher_sampled": float(config.fisher == "sampled"),
        "kfac/option/eigenvalue_correction": float(config.eigenvalue_correction),
        "kfac/option/batchnorm_unit_wise": float(config.batchnorm == "unit-wise"),
        "kfac/blocks/kronecker": float(len(kronecker)),
        "kfac/blocks/eigenvalue_corrected": float(sum(b.correction is not None for b in kronecker)),
        "kfac/blocks/unit_wise": float(sum(isinstance(b, UnitWiseBlock) for b in blocks)),
    }
