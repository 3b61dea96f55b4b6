"""The K-FAC preconditioner: hooks collect, ranks average, blocks decompose and precondition.

One optimizer step flows one way:

1. **collect** (:class:`~ds_kfac.collection.FactorCollector`'s module hooks,
   during forward/backward of every micro-batch of a factor-update step): each
   registered layer adds its micro-batch factors ``A`` and ``G`` to its
   accumulators, counting a forward call only once its output gets a backward;
2. **reduce** (``step()``, factor-update steps): the step's factors are
   averaged over data-parallel ranks in bucketed collectives and folded into
   the running averages;
3. **decompose** (decomposition steps): eigendecompositions or damped inverses
   of the factors;
4. **precondition**: each gradient matrix ``g`` becomes ``P(g)``, scaled by the
   KL-clip factor ``nu``, and is written back for the base optimizer.

The conventions (factor scaling, averaging, step counting) are the public
contract documented in ``docs/conventions.md`` and pinned by ``tests/``.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import CheckedState
from .checkpoint import io as checkpoint_io
from .collection import FactorCollector, LossScale
from .comm import DEFAULT_BUCKET_BYTES, all_reduce_sum_, data_parallel_rank, data_parallel_world
from .config import KFACConfig, KFACConfigError, resolve
from .curvature import (
    AdaptiveRefresh,
    Background,
    CurvatureBlock,
    FisherLoss,
    KFACBlock,
    StackedStates,
    UnitWiseBlock,
    UnitWiseInverse,
    all_finite,
    blocks_device,
    curvature_floor,
    method_for,
    sampled_loss,
)
from .health import Health
from .layers import BatchNormAdapter, LayerAdapter, SkippedLayer, find_layers
from .placement import Distributor, GradientLayout, TensorParallelGradients, WholeGradients, split_tensor_parallel
from .state import PendingDecompositions, Snapshot, TrainingState
from .timing import PhaseTimer


def _every_backward_ends_a_step() -> bool:
    return True


def _refuse_layers_differing_between_ranks(
    layers: list[tuple[str, LayerAdapter]],
    skipped: list[SkippedLayer],
    group: Optional[dist.ProcessGroup],
    model: nn.Module,
) -> None:
    """Raise on every rank, naming the layers, when the layers K-FAC registers differ between the data-parallel ranks
    of ``group``, whose models must be replicas: a parameter frozen on some ranks only skips its layer there or
    changes its ``A``, and the first factor collective would not match (a rank then aborted with signal 6).

    Two small all-reduces (max of each value and of its negation), at construction only: a digest of the names of
    the layers K-FAC looked at, then each one's factor sizes (0 where skipped)."""
    if data_parallel_world(group) == 1:
        return
    sizes = {name: (adapter.a_dim, adapter.g_dim) for name, adapter in layers} | {s.name: (0, 0) for s in skipped}
    names = sorted(sizes)
    device = next(model.parameters(), torch.empty(0)).device

    def extremes(values: list[int]) -> tuple[list[int], list[int]]:
        both = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        got = both.tolist()
        return got[: len(values)], [-v for v in got[len(values) :]]

    digest = int.from_bytes(hashlib.sha256("\n".join(names).encode()).digest()[:7], "big")
    high, low = extremes([digest])
    if high != low:
        raise ValueError(
            "the data-parallel ranks' models have layers of different names (K-FAC's layers differ): they must be "
            "replicas of one model"
        )
    high, low = extremes([d for name in names for d in sizes[name]])
    problems = []
    for i, name in enumerate(names):
        (a_high, g_high), (a_low, g_low) = high[2 * i : 2 * i + 2], low[2 * i : 2 * i + 2]
        if a_low == 0 < a_high:
            problems.append(f"{name!r}: registered on some ranks, skipped on others (its weight frozen on some?)")
        elif (a_low, g_low) != (a_high, g_high):
            problems.append(
                f"{name!r}: A of size {a_low} on some ranks, {a_high} on others (its bias frozen on some?)"
                if a_low != a_high
                else f"{name!r}: G of size {g_low} on some ranks, {g_high} on others"
            )
    if problems:
        raise ValueError(
            "K-FAC's layers differ between the data-parallel ranks, whose models must be replicas (parameters "
            "frozen differently on different ranks?): " + "; ".join(problems)
        )


def _uncurved(block: CurvatureBlock, state: Optional[tuple], no: torch.Tensor) -> torch.Tensor:
    """Whether ``state``, a candidate decomposition of ``block``, has no usable curvature (a device bool; ``no``
    where its method cannot tell, or there is no state)."""
    flag = None if state is None else block.method.uncurved(state)
    return no if flag is None else flag.to(no.device)


class KFACPreconditioner:
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
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        layout: Optional[GradientLayout] = None,
        model_parallel_group: Optional[dist.ProcessGroup] = None,
        **keys: Any,
    ) -> None:
        if isinstance(config, KFACConfig):
            if keys:
                raise KFACConfigError("pass either a KFACConfig or keyword keys, not both")
            self.config = config
        else:
            self.config = KFACConfig.parse({**(config or {}), **keys}, where="KFACPreconditioner")
        if self.config.kl_clip is not None and optimizer is None and lr is None:
            raise KFACConfigError("kl_clip needs the learning rate: pass optimizer= or lr= (or set kl_clip=None)")
        if accumulation_steps < 1:
            raise KFACConfigError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        subset = self.config.factor_micro_batches
        if subset is not None and subset < accumulation_steps and micro_batch is None:
            raise KFACConfigError(
                f"factor_micro_batches={subset} with accumulation_steps={accumulation_steps}: pass micro_batch= "
                f"(a callable giving the 0-based index in the step of the micro-batch being run), so the hooks "
                f"know which micro-batches are the last {subset}"
            )
        self.optimizer = optimizer
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        if boundary is None and accumulation_steps == 1:
            boundary = _every_backward_ends_a_step
        self.process_group = process_group
        self.model_parallel_group = model_parallel_group
        self.bucket_bytes = bucket_bytes

        layers, self.skipped_layers = find_layers(
            model,
            self.config.skip_layers,
            self.config.max_factor_dim,
            conv_factors=self.config.conv_factors,
            warn=data_parallel_rank(process_group) == 0,  # no layer registered, tied layers: said once, by rank 0
            tensor_parallel_factors=self.config.tensor_parallel_factors,
            batchnorm=self.config.batchnorm == "unit-wise",
        )
        _refuse_layers_differing_between_ranks(layers, self.skipped_layers, process_group, model)
        relays = []
        tensor_parallel = split_tensor_parallel(layers)
        if tensor_parallel is not None:
            self._check_tensor_parallel(layout, process_group, exact=bool(tensor_parallel.exact))
            layers, relays = tensor_parallel.kept, tensor_parallel.relays
            layout = TensorParallelGradients(tensor_parallel.exact, tensor_parallel.group)
            if model_parallel_group is None:
                self.model_parallel_group = model_parallel_group = tensor_parallel.group
        self.blocks = [self._block(name, adapter) for name, adapter in layers]
        self.layout = layout or WholeGradients()
        """Where the reduced gradients lie (built once; it alone knows partitions and holders)."""
        holders = self.layout.block_holders(self.blocks)
        self.distributor = Distributor(self.blocks, self.config, process_group, bucket_bytes, holders)
        self._by_name = {b.name: b for b in self.blocks}
        factor_keys = [(b.name, side) for b in self.blocks for side in b.sides]
        adaptive = self.config.inv_update_steps == "adaptive"
        self.refresh = AdaptiveRefresh(factor_keys, self.config.adaptive_threshold) if adaptive else None
        self.state = TrainingState(self.blocks, self.refresh)
        """All that a step changes and a checkpoint holds (:mod:`ds_kfac.state`)."""
        self.health = Health(self.state, kl_clip=self.config.kl_clip is not None, factor_dtype=self.config.factor_dtype)
        self.preconditioned: tuple[str, ...] = ()
        """Layers this rank preconditioned with a decomposition in the last :meth:`precondition_gradients`."""
        self.timer = PhaseTimer()
        self._stacks = StackedStates()
        self.collector = FactorCollector(
            self.blocks,
            self.distributor,
            self.timer,
            accumulation_steps=accumulation_steps,
            loss_scale=loss_scale,
            last_micro_batch=boundary if self.config.overlap_factor_comm else None,
            relays=relays,
            factor_micro_batches=self.config.factor_micro_batches,
            micro_batch=micro_batch,
            sampled=self.config.fisher == "sampled",
        )

    def _block(self, name: str, adapter: LayerAdapter) -> CurvatureBlock:
        """The curvature block of a registered layer: unit-wise for BatchNorm, Kronecker-factored otherwise."""
        factor_dtype, inv_dtype = self.config.factor_torch_dtype, self.config.inv_torch_dtype
        if isinstance(adapter, BatchNormAdapter):
            return UnitWiseBlock(name, adapter, UnitWiseInverse(self.config.relative_damping), factor_dtype, inv_dtype)
        return KFACBlock(
            name,
            adapter,
            method_for(self.config),
            factor_dtype,
            inv_dtype,
            eigenvalue_correction=self.config.eigenvalue_correction,
        )

    def _check_tensor_parallel(
        self, layout: Optional[GradientLayout], process_group: Optional[dist.ProcessGroup], exact: bool
    ) -> None:
        """Refuse what tensor-parallel layers cannot run with, naming it."""
        problems = []
        if layout is not None:
            problems.append(
                f"gradient layout {type(layout).__name__} (ZeRO stage 1-3): tensor-parallel layers need each "
                f"shard's whole gradient (ZeRO stage 0)"
            )
        if process_group is None and data_parallel_world() > 1:
            problems.append(
                "process_group=None: pass the data-parallel group (megatron.core.parallel_state."
                "get_data_parallel_group()), over which factors are averaged"
            )
        if exact and self.config.factor_reduction == "local":
            problems.append('factor_reduction="local" with tensor_parallel_factors="exact"')
        if self.config.eigenvalue_correction:
            problems.append("eigenvalue_correction (per-example gradients of sharded layers are not gathered)")
        if self.config.fisher == "sampled":
            problems.append('fisher="sampled" (the sharded layers\' rows travel in every backward pass)')
        if problems:
            raise KFACConfigError("K-FAC with tensor-parallel layers does not support: " + "; ".join(problems))

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

    # ------------------------------------------------------------ sampled Fisher
    def sample_fisher(
        self,
        output: torch.Tensor,
        loss: FisherLoss = "cross_entropy",
        labels: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        generator: Optional[torch.Generator] = None,
    ) -> bool:
        """With ``fisher: "sampled"``, take this micro-batch's factors from a loss whose targets are sampled from the
        model's predictive distribution (SP-NGD's one-sample Fisher); call it after the forward pass, before the
        training loss's backward (``engine.backward(loss)``), on every micro-batch.

        On the micro-batches that gather factors it samples the targets (:func:`~ds_kfac.curvature.fisher.sampled_loss`:
        ``output`` the model's logits for ``"cross_entropy"``, its prediction for ``"mse"``; ``labels`` leave out
        the positions the training loss ignores) and back-propagates that loss to the registered layers' outputs
        only, keeping the graph: every ``.grad`` stays what the training loss makes it. Elsewhere (other steps,
        ``fisher: "empirical"``, evaluation) it does nothing. Returns whether it ran a backward pass.

        ``generator``: the sampling's random numbers; by default a generator seeded from the step, the number of
        sampled passes in it and the global rank, so a run (and one resumed from a checkpoint) samples the same
        targets."""
        if not self.collector.sampled or not self.collector.collecting:
            return False

        def scaled(detached: torch.Tensor) -> torch.Tensor:
            """The sampled loss, scaled as the training loss (divided by the accumulation, times the loss scale),
            which the hooks undo."""
            scale = self.collector.loss_scale() if self.collector.loss_scale is not None else 1.0
            sampler = generator if generator is not None else self._sampling_generator(output.device)
            return sampled_loss(detached, loss, sampler, labels, ignore_index) * (scale / self.accumulation_steps)

        with self.timer.phase("sampled_backward"):
            return self.collector.sampled_backward(output, scaled)

    def _sampling_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded from the step, the sampled passes so far in it and the global rank: the same targets
        in a run and in one resumed from a checkpoint, other targets on each rank and micro-batch."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        seed = (self.steps * 4099 + self.collector.sampled_passes) * 65537 + rank
        return torch.Generator(device).manual_seed(seed)

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> None:
        """Update curvature as scheduled and precondition every registered layer's gradient in place
        (where :attr:`layout` says the reduced gradients lie)."""
        if self.precondition_gradients():
            self.finish_step()

    @torch.no_grad()
    def precondition_gradients(self) -> bool:
        """Steps 2-4 of the flow for the step in progress, without advancing the step counter.

        Returns whether it ran: a step with no backward through any registered layer since the
        last one (``step()`` called twice) would precondition the same gradients again, so it is
        skipped with a warning and counted as ``steps_without_backward``."""
        if not self.collector.backward_seen:
            return self._no_backward()
        if self.collector.sampled and self.collector.collecting and not self.collector.sampled_passes:
            raise RuntimeError(
                f'K-FAC step {self.steps} updates factors with fisher="sampled", but no sampled backward pass reached '
                f"a registered layer: call kfac.sample_fisher(logits, loss) after each forward pass, before the "
                f"training loss's backward, in training mode (not with reentrant activation checkpointing, whose "
                f"layer outputs it cannot reach)"
            )
        if self.collector.sampled and self.collector.collecting:
            self.counters["sampled_factor_steps"] += 1
            self.counters["sampled_passes"] += self.collector.sampled_passes
        self.update_curvature()
        s, layout, distributor = self.steps, self.layout, self.distributor
        blocks, grads, fragments = layout.gather(self.blocks, distributor.grad_workers)
        mine = [distributor.is_grad_worker(b) for b in blocks]
        chosen = [i for i, m in enumerate(mine) if m]
        mine_blocks = [blocks[i] for i in chosen]
        self.preconditioned = tuple(b.name for b in mine_blocks if b.state is not None)
        if self._stacks.stale(mine_blocks):
            with self.timer.phase("decompose"):  # after a refresh: stack the new decompositions
                self._stacks.prepare(mine_blocks)
        with self.timer.phase("precondition"):
            damping = self.config.at("damping", s)
            graft = self.config.grafting == "gradient"
            results = self._stacks.precondition(mine_blocks, [grads[i] for i in chosen], damping, graft)
            out: list[Optional[torch.Tensor]] = [None] * len(blocks)
            for i, result in zip(chosen, results):
                out[i] = result
            kl_clip = self.config.kl_clip
            if kl_clip is not None:
                lr = resolve(self.lr, s) if self.lr is not None else self.optimizer.param_groups[0]["lr"]
                counted = [
                    i
                    for i, b in enumerate(blocks)
                    if mine[i] and (layout.sharded or distributor.counts_in_kl_sum(b)) and layout.counts(b)
                ]
                vg = layout.dot(
                    [blocks[i] for i in counted],
                    [fragments[i] for i in counted],
                    [out[i] for i in counted],
                    [grads[i] for i in counted],
                )
                vg = self._complete_kl_sum(vg, data_parallel=layout.sharded or not distributor.plan.replicated)
                scale = layout.grad_scale()
                nu = torch.sqrt(self.config.at("kl_clip", s) / (lr**2 * (vg / (scale * scale)).abs())).clamp(max=1.0)
                self.state.scalars.last_nu = nu
                out = [None if p is None else p.mul_(nu.to(p.dtype)) for p in out]
            if not layout.sharded:  # sharded: each rank writes what it holds, so no result is shared
                out = distributor.share_preconditioned(blocks, out, grads)
            layout.write(blocks, fragments, out)
        return True

    def _complete_kl_sum(self, vg: torch.Tensor, data_parallel: bool) -> torch.Tensor:
        """This rank's part of the KL clip's ``sum(P(g) * g)`` summed over the data-parallel ranks (when
        they hold different parts of it) and then over :attr:`model_parallel_group`: the same on every rank."""
        groups = ([self.process_group] if data_parallel else []) + (
            [self.model_parallel_group] if self.model_parallel_group is not None else []
        )
        if not groups:
            return vg
        vg = vg.to(torch.float32).reshape(1)
        for group in groups:
            all_reduce_sum_([vg], group)
        return vg[0]

    def _no_backward(self) -> bool:
        """A step that no registered layer's backward preceded: refuse a model whose hooks never ran although
        its layers have gradients (a compiled graph built without them); otherwise skip it with a warning."""
        if not self.collector.ever_fired and self.layout.has_gradients(self.blocks):
            raise RuntimeError(
                f"K-FAC's module hooks have never run, yet its layers {self.layer_names} have gradients: the model "
                f"ran without them. Either it ran a torch.compile graph built before K-FAC attached its hooks (also "
                f"through the compile cache of another instance of the same class): attach K-FAC first, then "
                f"compile (fullgraph=False), or call torch._dynamo.reset() before compiling; or these layers are "
                f"called through a functional path (F.linear on their weight): list them in skip_layers"
            )
        self.health.step_without_backward(self.steps)
        return False

    @torch.no_grad()
    def update_curvature(self) -> None:
        """Steps 2 and 3 of the flow: fold in this step's factors, decompose when scheduled."""
        s, scalars = self.steps, self.state.scalars
        if self.collector.collecting:  # before any new eigenbasis: the step's S was projected on the current one
            self._update_factors(self.config.at("factor_decay", s))
        if scalars.pending is not None and s >= scalars.pending.install_at:
            with self.timer.phase("decompose"):
                self._adopt(*self.distributor.share_sides(scalars.pending.blocks, *scalars.pending.job.result()))
            scalars.pending = None
        damping = self.config.at("damping", s)
        if self.refresh is not None:
            due = [key for key in self.refresh.due(s) if key[0] in self.state.scalars.seen]
            if due:
                with self.timer.phase("decompose"):
                    intervals = self.distributor.agree_intervals(due, self.refresh.decide)
                    self._update_decompositions(damping, set(due))
                    for (name, side), interval in zip(due, intervals):
                        factor = self._by_name[name].statistics()[side]
                        held = self.distributor.holds(name, side)
                        self.refresh.refreshed((name, side), s, interval, factor.value if held else None)
        elif self._is_decomposition_step(s):
            with self.timer.phase("decompose"):
                if self.config.async_decompositions:
                    self._start_decompositions(s)
                else:
                    self._update_decompositions(damping)

    def _start_decompositions(self, started: int) -> None:
        """Start the decompositions of step ``started``'s factors in the background, to be installed at
        the next step that updates factors or decomposes (every rank computes the same step, so ranks
        agree). The factors are not changed before then, so a checkpoint in between can restart it."""
        install_at = started + 1
        while not (self._is_factor_step(install_at) or self._is_decomposition_step(install_at)):
            install_at += 1
        self._run_in_background(started, install_at)

    def _run_in_background(self, started: int, install_at: int) -> None:
        seen = self._seen_blocks()
        damping = self.config.at("damping", started)
        # The factors as they are now: the next step folds new ones in (never in place) before installing.
        factors = {b.name: {side: b.statistics()[side].value for side in b.sides} for b in seen}
        job = Background(
            partial(self.distributor.compute_sides, seen, damping, factors=factors), blocks_device(self.blocks)
        )
        self.state.scalars.pending = PendingDecompositions(started, install_at, seen, job)

    def _seen_blocks(self) -> list[CurvatureBlock]:
        """The blocks that have had factors (the same on every rank): those that are decomposed."""
        return [b for b in self.blocks if b.name in self.state.scalars.seen]

    def _is_factor_step(self, step: int) -> bool:
        return step % self.config.at("factor_update_steps", step) == 0

    def _is_decomposition_step(self, step: int) -> bool:
        return step % self.config.at("inv_update_steps", step) == 0

    def finish_step(self) -> None:
        """Advance the step counter and arm the hooks for the next step."""
        self.state.scalars.steps += 1
        self._arm_hooks()

    def _arm_hooks(self) -> None:
        """Collect factors during the step in progress iff ``steps % factor_update_steps == 0``."""
        self.collector.arm(self._is_factor_step(self.steps))

    def _update_factors(self, decay: float) -> None:
        with self.timer.phase("factor_comm"):
            reduced = self.distributor.reduce_factors(self._blocks_with_statistics())
        with self.timer.phase("factors"):
            bad = self.distributor.fold_factors(reduced, decay)
        if bad:
            self.health.nonfinite_factors(bad)
        unanswered = self.collector.unanswered()
        if unanswered:
            self.health.unanswered_forwards(unanswered)

    def _blocks_with_statistics(self) -> list[CurvatureBlock]:
        """Blocks whose hooks fired this step, agreed on by all ranks; report (once) and
        reset those whose did not. In ``local`` mode only a layer's owner collects."""
        present = [self.distributor.has_statistics(b) for b in self.blocks]
        world = data_parallel_world(self.process_group)
        if world > 1:
            counts = torch.tensor(present, dtype=torch.int32, device=blocks_device(self.blocks))
            all_reduce_sum_([counts], self.process_group)
            expected = 1 if self.config.factor_reduction == "local" else world
            counts = counts.tolist()
            partial_names = [b.name for b, c in zip(self.blocks, counts) if 0 < c < expected]
            if partial_names:
                raise RuntimeError(f"K-FAC hooks fired on some data-parallel ranks but not others for {partial_names}")
            present = [c == expected for c in counts]
        missing = [b.name for b, ok in zip(self.blocks, present) if not ok]
        for b, ok in zip(self.blocks, present):
            if not ok:
                for stat in b.statistics().values():
                    stat.discard_step()
        if missing:
            self.health.missing_layers(missing)
        ready = [b for b, ok in zip(self.blocks, present) if ok]
        self.state.scalars.seen |= {b.name for b in ready}
        return ready

    def _update_decompositions(self, damping: float, due: Optional[set[tuple[str, str]]] = None) -> None:
        self._adopt(*self.distributor.decompose(self._seen_blocks(), damping, due))

    def _adopt(self, chosen: list[CurvatureBlock], states: list[tuple]) -> None:
        """Install the candidate decompositions that are finite; keep the previous ones of the others."""
        candidates = list(zip(chosen, states))
        if not candidates:
            return
        device = blocks_device(self.blocks)
        no = torch.zeros((), dtype=torch.bool, device=device)
        flags = [
            torch.stack([all_finite(state).to(device), _uncurved(block, state, no)]) for block, state in candidates
        ]
        ok = torch.stack(flags).tolist()  # the one host sync of a decomposition step
        failed, uncurved = [], []
        for (block, state), (good, flat) in zip(candidates, ok):
            if good:
                block.install(state)
                if flat:
                    uncurved.append(block.name)
            else:
                failed.append(block.name)
        if failed:
            self.health.failed_decompositions(failed)
        if uncurved:
            self.health.uncurved_blocks(uncurved, curvature_floor(self.config.inv_torch_dtype))

    def snapshot(self) -> Snapshot:
        """References to all state a step changes (steps never modify tensors in place), to
        :meth:`restore` if the step is then skipped, e.g. by DeepSpeed for fp16 overflow."""
        return self.state.snapshot()

    def restore(self, snap: Snapshot) -> None:
        """Undo everything since :meth:`snapshot`, dropping the statistics gathered for that step."""
        self.state.restore(snap)
        self.discard_step_statistics()
        self._arm_hooks()

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per phase since the last ``timings.clear()`` (see :mod:`ds_kfac.timing`)."""
        return self.timer.seconds

    # ------------------------------------------------------------ inspection
    def memory_usage(self) -> dict[str, int]:
        """Bytes held on this rank, by category: running factors, decompositions, the
        accumulators of the step in progress (independent of the number of micro-batches),
        the factor snapshots adaptive refresh compares against (on the decomposing rank), and
        what preconditioning keeps between steps (``eigen-outer``'s ``D`` on gradient workers) and, with
        ``eigenvalue_correction``, the running corrections ``S`` (on gradient workers; their step accumulators
        count as accumulators)."""
        usage = {"factors": 0, "decompositions": 0, "accumulators": 0, "refresh_references": 0}
        usage["preconditioning_cache"] = self._stacks.cache_bytes()
        if self.config.eigenvalue_correction:
            usage["eigenvalue_corrections"] = 0
        for b in self.blocks:
            for side, stat in b.statistics().items():
                running, accumulator = stat.nbytes()
                usage["eigenvalue_corrections" if side == "S" else "factors"] += running
                usage["accumulators"] += accumulator
            usage["decompositions"] += sum(t.numel() * t.element_size() for t in (b.state or ()))
        if self.refresh is not None:
            references = [t for f in self.refresh.factors.values() for t in (f.last, f.before_last) if t is not None]
            usage["refresh_references"] = sum(t.numel() * t.element_size() for t in references)
        return usage

    def metrics(self) -> dict[str, float]:
        """K-FAC's scalars by name, for a training log: ``kfac/steps``, ``kfac/nu`` (with ``kl_clip``),
        ``kfac/seconds/<phase>`` (:attr:`timings`), ``kfac/count/<counter>`` (:attr:`counters`), the curvature
        options (:meth:`option_metrics`) and, with adaptive refresh, ``kfac/interval/<layer>.<A/G>``. DeepSpeed's
        monitor and ``ds_kfac.hf.KFACTrainer`` both write these."""
        metrics = {"kfac/steps": float(self.steps), **self.option_metrics()}
        if self.last_nu is not None:
            metrics["kfac/nu"] = float(self.last_nu)
        metrics.update({f"kfac/seconds/{phase}": float(t) for phase, t in self.timings.items()})
        metrics.update({f"kfac/count/{name}": float(n) for name, n in self.counters.items()})
        if self.refresh is not None:
            metrics.update({f"kfac/interval/{key}": float(n) for key, n in self.refresh.intervals().items()})
        return metrics

    def option_metrics(self) -> dict[str, float]:
        """Which curvature options the run uses and how many of this rank's blocks they reach (the same on every
        data-parallel rank), so that a training log says what it measured: ``kfac/option/fisher_sampled``,
        ``kfac/option/eigenvalue_correction`` and ``kfac/option/batchnorm_unit_wise`` (1 on, 0 off), and the
        registered blocks ``kfac/blocks/kronecker`` (Linear and Conv2d), ``kfac/blocks/eigenvalue_corrected`` (those
        of them with a correction ``S``) and ``kfac/blocks/unit_wise`` (BatchNorm)."""
        config = self.config
        kronecker = [b for b in self.blocks if isinstance(b, KFACBlock)]
        return {
            "kfac/option/fisher_sampled": float(config.fisher == "sampled"),
            "kfac/option/eigenvalue_correction": float(config.eigenvalue_correction),
            "kfac/option/batchnorm_unit_wise": float(config.batchnorm == "unit-wise"),
            "kfac/blocks/kronecker": float(len(kronecker)),
            "kfac/blocks/eigenvalue_corrected": float(sum(b.correction is not None for b in kronecker)),
            "kfac/blocks/unit_wise": float(sum(isinstance(b, UnitWiseBlock) for b in self.blocks)),
        }

    @property
    def layer_names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def remove_hooks(self) -> None:
        self.collector.remove()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Optional[dict[str, Any]]:
        """All K-FAC state, world-size and placement independent (whole factors and decompositions
        per layer, CPU tensors), on rank 0 of the process group, the rank that saves; ``None`` on the
        other ranks, which receive nothing. Each piece is sent once, by one rank holding it.
        Collective: call it on every rank (as ``engine.save_checkpoint`` does)."""
        return checkpoint_io.state_dict(self)

    def check_state_dict(self, state: Union[dict[str, Any], CheckedState]) -> CheckedState:
        """Check a :meth:`state_dict` against this preconditioner, changing nothing: one ``ValueError``
        names every problem (see :mod:`ds_kfac.checkpoint`). :meth:`load_state_dict` takes the result."""
        return checkpoint_io.check_state_dict(self, state)

    def load_state_dict(self, state: Union[dict[str, Any], CheckedState]) -> None:
        """Restore :meth:`state_dict`. The whole state is checked first (:meth:`check_state_dict`, not
        again for a state already checked here), and nothing changes unless all of it is valid."""
        checkpoint_io.load_state_dict(self, state)

    def __repr__(self) -> str:
        skipped = ", ".join(s.name for s in self.skipped_layers) or "none"
        return f"KFACPreconditioner({len(self.blocks)} layers, skipped: {skipped}, {self.config})"


__all__ = ["KFACPreconditioner", "SkippedLayer"]
