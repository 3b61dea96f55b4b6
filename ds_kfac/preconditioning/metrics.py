"""What a preconditioner reports: bytes held by category, and the scalars of a training log."""

from __future__ import annotations

from typing import Optional

import torch

from ..config import KFACConfig
from ..curvature import REFRESH_KINDS, AdaptiveRefresh, CurvatureBlock, KFACBlock, StackedStates, UnitWiseBlock
from ..timing import PhaseTimer


class Reporting:
    """The inspection methods of a preconditioner with these attributes."""

    config: KFACConfig
    blocks: list[CurvatureBlock]
    refresh: Optional[AdaptiveRefresh]
    timer: PhaseTimer
    _stacks: StackedStates
    steps: int
    counters: dict[str, int]
    last_nu: Optional[torch.Tensor]

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per phase since the last ``timings.clear()`` (see :mod:`ds_kfac.timing`)."""
        return self.timer.seconds

    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by category: running factors, decompositions, the
        accumulators of the step in progress (independent of the number of micro-batches),
        the factor snapshots adaptive refresh compares against (on the decomposing rank), and
        what preconditioning keeps between steps (``eigen-outer``'s ``D`` on gradient workers) and, with
        ``eigenvalue_correction``, the running corrections ``S`` (on gradient workers; their step accumulators
        count as accumulators) and, with ``eigenbasis_moments``, the moments ``m`` and ``v`` (on the ranks that
        precondition each layer)."""
        usage = {"factors": 0, "decompositions": 0, "accumulators": 0, "refresh_references": 0}
        usage["preconditioning_cache"] = self._stacks.cache_bytes()
        if self.config.eigenvalue_correction:
            usage["eigenvalue_corrections"] = 0
        if self.config.eigenbasis_moments:
            usage["eigenbasis_moments"] = sum(
                t.numel() * t.element_size()
                for b in self.blocks
                if b.moments is not None
                for t in b.moments.value or ()
            )
        for b in self.blocks:
            for side, stat in b.statistics().items():
                running, accumulator = stat.nbytes()
                usage["eigenvalue_corrections" if side == "S" else "factors"] += running
                usage["accumulators"] += accumulator
            usage["decompositions"] += sum(t.numel() * t.element_size() for t in (b.decomposition or ()))
        if self.refresh is not None:
            references = [t for f in self.refresh.factors.values() for t in (f.last, f.before_last) if t is not None]
            usage["refresh_references"] = sum(t.numel() * t.element_size() for t in references)
        return usage

    def metrics(self) -> dict[str, float]:
        """K-FAC's scalars by name, for a training log: ``kfac/steps``, ``kfac/nu`` (with ``kl_clip``),
        ``kfac/seconds/<phase>`` (:attr:`timings`), ``kfac/count/<counter>`` (:attr:`counters`), the curvature
        options (:meth:`option_metrics`), ``kfac/refresh/full``, ``kfac/refresh/subspace`` and ``kfac/refresh/kept``
        (the sides this process decomposed in full, updated by a subspace step or kept, ``basis_update``),
        ``kfac/refresh/drift_mean`` and ``kfac/refresh/drift_max`` (over the warm starts' drift tests so far; where
        some ran) and, with adaptive refresh, ``kfac/interval/<layer>.<A/G>``. DeepSpeed's monitor and
        ``ds_kfac.hf.KFACTrainer`` both write these."""
        metrics = {"kfac/steps": float(self.steps), **self.option_metrics()}
        if self.last_nu is not None:
            metrics["kfac/nu"] = float(self.last_nu)
        metrics.update({f"kfac/seconds/{phase}": float(t) for phase, t in self.timings.items()})
        metrics.update({f"kfac/count/{name}": float(n) for name, n in self.counters.items()})
        if self.refresh is not None:
            metrics.update({f"kfac/interval/{key}": float(n) for key, n in self.refresh.intervals().items()})
        solvers = {id(s): s for b in self.blocks if (s := getattr(b.method, "solver", None)) is not None}
        for how in REFRESH_KINDS:  # this process's refreshes by how they were computed (basis_update)
            metrics[f"kfac/refresh/{how}"] = float(sum(s.counts[how] for s in solvers.values()))
        tested = sum(s.drifts["count"] for s in solvers.values())
        if tested:
            metrics["kfac/refresh/drift_mean"] = sum(s.drifts["sum"] for s in solvers.values()) / tested
            metrics["kfac/refresh/drift_max"] = max(s.drifts["max"] for s in solvers.values())
        return metrics

    def option_metrics(self) -> dict[str, float]:
        """Which curvature options the run uses and how many of this rank's blocks they reach (the same on every
        data-parallel rank), so that a training log says what it measured: ``kfac/option/fisher_sampled``,
        ``kfac/option/eigenvalue_correction``, ``kfac/option/batchnorm_unit_wise`` and
        ``kfac/option/eigenbasis_moments`` (1 on, 0 off), and the
        registered blocks ``kfac/blocks/kronecker`` (Linear and Conv2d), ``kfac/blocks/eigenvalue_corrected`` (those
        of them with a correction ``S``) and ``kfac/blocks/unit_wise`` (BatchNorm)."""
        config = self.config
        kronecker = [b for b in self.blocks if isinstance(b, KFACBlock)]
        return {
            "kfac/option/fisher_sampled": float(config.fisher == "sampled"),
            "kfac/option/eigenvalue_correction": float(config.eigenvalue_correction),
            "kfac/option/batchnorm_unit_wise": float(config.batchnorm == "unit-wise"),
            "kfac/option/eigenbasis_moments": float(config.eigenbasis_moments),
            "kfac/blocks/kronecker": float(len(kronecker)),
            "kfac/blocks/eigenvalue_corrected": float(sum(b.correction is not None for b in kronecker)),
            "kfac/blocks/unit_wise": float(sum(isinstance(b, UnitWiseBlock) for b in self.blocks)),
        }

    @property
    def layer_names(self) -> list[str]:
        return [b.name for b in self.blocks]
