"""The K-FAC preconditioner: hooks collect, ranks average, blocks decompose and precondition.

One optimizer step is a pipeline of named stages, run top to bottom by
:meth:`KFACPreconditioner.precondition_gradients`:

1. **collect** (:class:`~ds_kfac.collection.FactorCollector`'s module hooks, during forward/backward of every
   micro-batch of a factor-update step): each registered layer adds its micro-batch factors ``A`` and ``G`` to its
   accumulators, counting a forward call only once its output gets a backward;
2. **reduce** (factor-update steps): the ranks agree on which layers gathered factors, and the step's factors are
   averaged over data-parallel ranks in bucketed collectives (:mod:`ds_kfac.placement.factors`) and folded into
   the running averages;
3. **decompose** (as :class:`~ds_kfac.preconditioning.DecompositionSchedule` says: a fixed cadence, spread over
   the cycle, adaptive, or in the background): eigenbases (:class:`~ds_kfac.curvature.BasisSolver`) or damped
   inverses of the factors, shared with the ranks that precondition the layer;
4. **gather gradients**: each layer whose reduced gradient this rank holds becomes a
   :class:`~ds_kfac.placement.LayerWork`, with its whole gradient matrix ``g`` where this rank preconditions it;
5. **precondition**: ``g`` becomes ``P(g)`` (with ``eigenbasis_moments``, the base optimizer's normalised
   direction from moments kept in the eigenbasis, :mod:`ds_kfac.curvature.moments`);
6. **clip**: every ``P(g)`` is scaled by the KL-clip factor ``nu`` (:mod:`ds_kfac.placement.kl_clip`);
7. **share**: gradient workers broadcast their results to the ranks that hold the gradient but do not precondition
   it (not under ZeRO's partitions);
8. **write**: the results go back where the gradients lie, for the base optimizer.

Communication is the placement's and comm's (:mod:`ds_kfac.placement`); this module issues no collective itself.
The conventions (factor scaling, averaging, step counting) are the public contract documented in
``docs/conventions.md`` and pinned by ``tests/``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .checkpoint import CheckedState
from .checkpoint import io as checkpoint_io
from .collection import FactorCollector, LossScale
from .comm import DEFAULT_BUCKET_BYTES, data_parallel_rank
from .config import KFACConfig, resolve
from .curvature import AdaptiveRefresh, StackedStates
from .curvature.moments import MomentRule
from .health import Health
from .layers import SkippedLayer
from .placement import (
    Distributor,
    GradientLayout,
    KLClip,
    WholeGradients,
    all_finite_fragments,
    blocks_of,
    gather_work,
    write_work,
)
from .preconditioning import DecompositionSchedule, Reporting, SampledFisher, checked_config, register_layers
from .preconditioning.build import carried_scale, moment_rule, refuse_unflagged
from .state import Snapshot, TrainingState
from .timing import PhaseTimer


def _every_backward_ends_a_step() -> bool:
    return True


class KFACPreconditioner(SampledFisher, Reporting):
    """K-FAC gradient preconditioning for a model's ``nn.Linear`` and ``nn.Conv2d`` layers (and, with ``batchnorm:
    "unit-wise"``, the unit-wise natural gradient of its BatchNorm layers).

    Standalone use (plain PyTorch or DistributedDataParallel)::

        kfac = KFACPreconditioner(model, optimizer=optimizer, damping=0.003)
        loss.backward()
        kfac.step()        # preconditions p.grad in place
        optimizer.step()

    Args:
        model: the module whose layers are preconditioned (the unwrapped model
            or a DDP wrapper; hooks go on the inner modules).
        config: a :class:`KFACConfig`, or a dict with the keys of the JSON ``"kfac"`` section.
        optimizer: the base optimizer; its ``param_groups[0]["lr"]`` is the
            learning rate of the KL clip unless ``lr`` is given.
        lr: learning rate for the KL clip, a constant or a callable of the step.
        accumulation_steps: micro-batches per optimizer step; the loss of each
            is assumed divided by it (as DeepSpeed does), which the ``G`` scaling undoes.
        loss_scale: callable returning the loss scale current for the micro-batch
            being back-propagated (mixed precision); 1 when ``None``.
        boundary: callable telling whether the micro-batch being back-propagated is
            the last of the optimizer step; with it (or with ``accumulation_steps=1``)
            each layer's factors start their reduction during that backward pass
            (``overlap_factor_comm``), otherwise at :meth:`step`.
        micro_batch: callable giving the 0-based index, within the optimizer step, of the
            micro-batch whose forward pass is running; required when the ``factor_micro_batches``
            key is fewer than ``accumulation_steps`` (only the last ones gather factors).
        process_group: data-parallel group over which factors are averaged
            (the default group when distributed is initialized).
        layout: where the reduced gradients lie at the step (:mod:`ds_kfac.placement.gradients`);
            the default is each parameter's whole ``.grad`` (plain PyTorch, DDP, ZeRO stage 0; with
            tensor-parallel layers, :class:`~ds_kfac.placement.TensorParallelGradients`). The
            :class:`ds_kfac.KFACEngine` passes the layout of its ZeRO stage 1-3.
        moments: with ``eigenbasis_moments``, the base optimizer's per-element rule applied in the eigenbasis;
            default: read from ``optimizer`` (:func:`ds_kfac.optimizers.moment_settings`), whose groups flagged
            by :func:`ds_kfac.optimizers.split_groups` must hold exactly the registered layers' parameters.
            The :class:`ds_kfac.KFACEngine` passes the rule of the optimizer it built.
        model_parallel_group: the ranks holding the other parts of this rank's model replica
            (tensor-parallel shards, pipeline stages; Megatron's and DeepSpeed's
            ``mpu.get_model_parallel_group()``). The KL clip's sum is completed over it, so every
            rank scales by the same ``nu``; each rank's sum must count only the layers it is
            responsible for. ``None``: the model is whole on every rank, or, with tensor-parallel
            layers (Megatron's, :mod:`ds_kfac.integration.megatron`), their tensor-parallel group.
        **keys: the ``"kfac"`` keys, as an alternative to ``config``.

    Construction is collective over ``process_group`` (it checks that every rank registers the same layers).
    """

    def __init__(
        self,
        model: nn.Module,
        config: Union[KFACConfig, dict[str, Any], None] = None,
        *,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr: Union[float, Callable[[int], float], None] = None,
        accumulation_steps: int = 1,
        loss_scale: Optional[LossScale] = None,
        boundary: Optional[Callable[[], bool]] = None,
        micro_batch: Optional[Callable[[], int]] = None,
        process_group: Optional[ProcessGroup] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        layout: Optional[GradientLayout] = None,
        moments: Optional[MomentRule] = None,
        model_parallel_group: Optional[ProcessGroup] = None,
        **keys: Any,
    ) -> None:
        self.config = checked_config(config, keys, optimizer, lr, accumulation_steps, micro_batch)
        self.moment_rule = moment_rule(self.config, moments, optimizer)
        """The base optimizer's rule that ``eigenbasis_moments`` applies in the eigenbasis (else ``None``)."""
        self.optimizer = optimizer
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        if boundary is None and accumulation_steps == 1:
            boundary = _every_backward_ends_a_step
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes
        warn = data_parallel_rank(process_group) == 0  # no layer registered, tied layers: said once, by rank 0
        registered = register_layers(model, self.config, process_group, layout, model_parallel_group, warn)
        self.skipped_layers, self.blocks = registered.skipped, registered.blocks
        if self.moment_rule is not None and moments is None:
            refuse_unflagged(self.blocks, optimizer)
        self.model_parallel_group = registered.model_parallel_group
        self.layout = registered.layout or WholeGradients()
        """Where the reduced gradients lie (built once; it alone knows partitions and holders)."""
        if layout is None and loss_scale is not None:  # standalone: the scale the gradients still carry at step()
            self.layout.grad_scale = carried_scale(loss_scale, optimizer)
        holders = self.layout.block_holders(self.blocks)
        self.distributor = Distributor(self.blocks, self.config, process_group, bucket_bytes, holders)
        factor_keys = [(b.name, side) for b in self.blocks for side in b.sides]
        adaptive = self.config.inv_update_steps == "adaptive"
        self.refresh = AdaptiveRefresh(factor_keys, self.config.adaptive_threshold) if adaptive else None
        self.state = TrainingState(self.blocks, self.refresh)
        """All that a step changes and a checkpoint holds (:mod:`ds_kfac.state`)."""
        self.health = Health(self.state, kl_clip=self.config.kl_clip is not None, factor_dtype=self.config.factor_dtype)
        self.preconditioned: tuple[str, ...] = ()
        """Layers this rank preconditioned with a decomposition in the last :meth:`precondition_gradients`."""
        self.finite_gradients = True
        """With ``eigenbasis_moments``, whether the gradients of the last :meth:`precondition_gradients` were finite
        (not: they were left as they were and no moment changed; :meth:`step` then undoes the step)."""
        self.timer = PhaseTimer()
        self._stacks = StackedStates()
        self.schedule = DecompositionSchedule(
            self.config, self.blocks, self.distributor, self.state, self.health, self.timer
        )
        """When factors are updated and decomposed (fixed, adaptive, background), and the decompositions."""
        self.kl_clip = KLClip(self.layout, self.distributor, self.model_parallel_group)
        self.collector = FactorCollector(
            self.blocks,
            self.distributor,
            self.timer,
            accumulation_steps=accumulation_steps,
            loss_scale=loss_scale,
            last_micro_batch=boundary if self.config.overlap_factor_comm else None,
            relays=registered.relays,
            factor_micro_batches=self.config.factor_micro_batches,
            micro_batch=micro_batch,
            sampled=self.config.fisher == "sampled",
        )

    @property
    def collecting(self) -> bool:
        """Whether the hooks gather factors for the step in progress (``steps % factor_update_steps == 0``)."""
        return self.collector.collecting

    @property
    def steps(self) -> int:
        """Optimizer steps preconditioned so far (the step in progress has this index)."""
        return self.state.scalars.steps

    @property
    def counters(self) -> dict[str, int]:
        """Counts of the run, saved in checkpoints: what K-FAC skipped or could not do (:mod:`ds_kfac.health`) and,
        with ``fisher: "sampled"``, the factor-update steps (``sampled_factor_steps``) and the sampled backward
        passes they took ``G`` from (``sampled_passes``)."""
        return self.state.scalars.counters

    @property
    def last_nu(self) -> Optional[torch.Tensor]:
        """The KL clip's factor of the last preconditioned step (``None`` without ``kl_clip``)."""
        return self.state.scalars.last_nu

    def discard_step_statistics(self) -> None:
        """Forget the factors gathered for the step in progress (e.g. it overflowed and is skipped).
        Collective when factors are reduced during backward: call it on every rank."""
        self.distributor.discard_statistics()
        self.collector.discard()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> None:
        """Update curvature as scheduled; precondition every registered layer's gradient in place (:attr:`layout`)."""
        snap = self.snapshot()
        if self.precondition_gradients():
            if self.finite_gradients:
                self.finish_step()
            else:  # a step the base optimizer's GradScaler skips: undone, as DeepSpeed's skipped steps are
                self.restore(snap)

    @torch.no_grad()
    def precondition_gradients(self) -> bool:
        """The step in progress as the pipeline of the module docstring (stages 2-8; the hooks ran stage 1),
        without advancing the step counter.

        Returns whether it ran: a step with no backward through any registered layer since the
        last one (``step()`` called twice) would precondition the same gradients again, so it is
        skipped with a warning and counted as ``steps_without_backward``."""
        if not self.collector.backward_seen:
            return self._no_backward()
        self._count_sampled_passes()
        self.update_curvature()  # 2-3: reduce the factors the hooks collected (1), decompose as scheduled
        s = self.steps
        work = gather_work(self.layout, self.blocks, self.distributor)  # 4: gather gradients
        mine = [w for w in work if w.grad_worker]
        blocks = blocks_of(mine)
        self.preconditioned = tuple(b.name for b in blocks if b.decomposition is not None)
        self.finite_gradients = self.moment_rule is None or all_finite_fragments(work)
        if self._stacks.stale(blocks):
            with self.timer.phase("stack"):  # after a refresh: stack the new decompositions
                self._stacks.prepare(blocks)
        with self.timer.phase("precondition"):
            damping = self.config.at("damping", s)
            graft = self.config.grafting == "gradient"
            grads = [w.grad for w in mine]
            scale = self.layout.grad_scale() if self.moment_rule is not None else 1.0
            if scale != 1.0:  # the moments see unscaled gradients; the direction is written with the scale
                grads = [g / scale for g in grads]
            if self.finite_gradients:
                results = self._stacks.precondition(blocks, grads, damping, graft, self.moment_rule)  # 5: precondition
                for w, result in zip(mine, results):
                    w.result = result if scale == 1.0 else result.mul_(scale)
            else:  # the moments stay as they were; the gradients stay non-finite, so the step is skipped
                for w in mine:
                    w.result = w.grad
            if self.config.kl_clip is not None:  # 6: clip
                lr = resolve(self.lr, s) if self.lr is not None else self.optimizer.param_groups[0]["lr"]
                self.state.scalars.last_nu = self.kl_clip.clip(work, self.config.at("kl_clip", s), lr)
            if not self.layout.sharded:  # 7: share (sharded: each rank writes what it holds, so nothing is shared)
                self.distributor.share_preconditioned(work)
            write_work(self.layout, work)  # 8: write
        return True

    @torch.no_grad()
    def update_curvature(self) -> None:
        """Stages 2 and 3 of the flow: fold in this step's factors, decompose when scheduled."""
        s = self.steps
        if self.collector.collecting:  # before any new eigenbasis: the step's S was projected on the current one
            self._reduce_factors(self.config.at("factor_decay", s))
        self.schedule.decompose(s)

    def _reduce_factors(self, decay: float) -> None:
        """Stage 2: average the step's factors of the layers whose hooks fired on every rank, and fold them in;
        report (once) and reset the layers whose hooks did not fire."""
        with self.timer.phase("factor_comm"):
            ready, missing = self.distributor.agree_present(self.blocks)
            if missing:
                self.health.missing_layers(missing)
            self.state.scalars.seen |= {b.name for b in ready}
            reduced = self.distributor.reduce_factors(ready)
        with self.timer.phase("factors"):
            bad = self.distributor.fold_factors(reduced, decay)
        if bad:
            self.health.nonfinite_factors(bad)
        unanswered = self.collector.unanswered()
        if unanswered:
            self.health.unanswered_forwards(unanswered)

    def _no_backward(self) -> bool:
        """A step no registered layer's backward preceded: refused where the hooks never ran although the layers
        have gradients (a compiled graph built without them); else skipped with a warning."""
        if not self.collector.ever_fired and self.layout.has_gradients(self.blocks):
            raise RuntimeError(
                f"K-FAC's module hooks have never run, yet its layers {self.layer_names} have gradients: the model "
                f"ran without them. Either it ran a torch.compile graph built before K-FAC attached its hooks (also "
                f"through the compile cache of another instance of the same class): attach K-FAC first, then "
                f"compile (fullgraph=False), or call torch._dynamo.reset() before compiling; or these layers are "
                f"called through a functional path (F.linear on their weight): list them in skip_layers"
            )
        self.health.step_without_backward(self.steps, self.collector)
        return False

    def finish_step(self) -> None:
        """Advance the step counter and arm the hooks for the next step."""
        self.state.scalars.steps += 1
        self._arm_hooks()

    def _arm_hooks(self) -> None:
        """Collect factors during the step in progress iff ``steps % factor_update_steps == 0``."""
        self.collector.arm(self.schedule.is_factor_step(self.steps))

    def snapshot(self) -> Snapshot:
        """References to all state a step changes (steps never modify tensors in place), to
        :meth:`restore` if the step is then skipped, e.g. by DeepSpeed for fp16 overflow."""
        return self.state.snapshot()

    def restore(self, snap: Snapshot) -> None:
        """Undo everything since :meth:`snapshot`, dropping the statistics gathered for that step."""
        self.state.restore(snap)
        self.discard_step_statistics()
        self._arm_hooks()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Optional[dict[str, Any]]:
        """All K-FAC state, world-size and placement independent (whole factors and decompositions per layer, CPU
        tensors), on rank 0 of the process group, the rank that saves; ``None`` on the other ranks, which receive
        nothing. Each piece is sent once, by one rank holding it. Collective: call it on every rank."""
        return checkpoint_io.state_dict(self)

    def check_state_dict(self, state: Union[dict[str, Any], CheckedState]) -> CheckedState:
        """Check a :meth:`state_dict` against this preconditioner, changing nothing: one ``ValueError`` names every
        problem (:mod:`ds_kfac.checkpoint`). :meth:`load_state_dict` takes the result."""
        return checkpoint_io.check_state_dict(self, state)

    def load_state_dict(self, state: Union[dict[str, Any], CheckedState]) -> None:
        """Restore :meth:`state_dict`, checked first (:meth:`check_state_dict`, not again for a state already
        checked here): nothing changes unless all of it is valid."""
        checkpoint_io.load_state_dict(self, state)

    def __repr__(self) -> str:
        skipped = ", ".join(s.name for s in self.skipped_layers) or "none"
        return f"KFACPreconditioner({len(self.blocks)} layers, skipped: {skipped}, {self.config})"


__all__ = ["KFACPreconditioner", "SkippedLayer"]
