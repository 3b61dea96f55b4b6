"""The K-FAC preconditioner: hooks collect, ranks average, blocks decompose and precondition.

One optimizer step flows one way:

1. **collect** (module hooks, during forward/backward of every micro-batch of
   a factor-update step): each registered layer adds its micro-batch factors
   ``A`` and ``G`` to its accumulators;
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

import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .comm import DEFAULT_BUCKET_BYTES, all_reduce_sum_, data_parallel_world
from .config import KFACConfig, KFACConfigError, resolve
from .curvature import AdaptiveRefresh, Background, KFACBlock, StackedStates, all_finite, blocks_device, method_for
from .layers import SkippedLayer, find_layers
from .placement import Distributor, GradientLayout
from .timing import PhaseTimer

LossScale = Callable[[], Union[float, torch.Tensor]]


@dataclass
class Snapshot:
    """What :meth:`KFACPreconditioner.restore` needs to undo a step (references, not copies)."""

    steps: int
    blocks: list[tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[tuple]]]
    counters: dict[str, int]
    last_nu: Optional[torch.Tensor]
    refresh: Optional[dict]
    pending: Optional["PendingDecompositions"]


@dataclass
class PendingDecompositions:
    """Decompositions running in the background (``async_decompositions``): started from the
    factors of step ``started``, installed at the start of step ``install_at``."""

    started: int
    install_at: int
    blocks: list[KFACBlock]
    job: Background


STATE_VERSION = 1


def _every_backward_ends_a_step() -> bool:
    return True


METHOD_KEYS = ("compute_method", "eigenvalue_outer_product", "relative_damping", "conv_factors")
"""Config keys that decide what a factor or decomposition holds: recorded in a checkpoint, which loads only where
they match."""


class KFACPreconditioner:
    """K-FAC gradient preconditioning for a model's ``nn.Linear`` and ``nn.Conv2d`` layers.

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
        process_group: data-parallel group over which factors are averaged
            (the default group when distributed is initialized).
        gradient_holders: the data-parallel ranks holding each parameter's reduced
            gradient when it is partitioned (ZeRO 1/2); with ``mem-opt`` they become
            the layer's gradient workers. Set by :class:`ds_kfac.KFACEngine`.
        **keys: the ``"kfac"`` keys, as an alternative to ``config``.
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
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        gradient_holders: Optional[dict[nn.Parameter, tuple[int, ...]]] = None,
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
        self.optimizer = optimizer
        self.lr = lr
        self.accumulation_steps = accumulation_steps
        self.loss_scale = loss_scale
        if boundary is None and accumulation_steps == 1:
            boundary = _every_backward_ends_a_step
        self._last_micro_batch = boundary if self.config.overlap_factor_comm else None
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes

        layers, self.skipped_layers = find_layers(
            model, self.config.skip_layers, self.config.max_factor_dim, conv_factors=self.config.conv_factors
        )
        method = method_for(self.config)
        self.blocks = [
            KFACBlock(name, adapter, method, self.config.factor_torch_dtype, self.config.inv_torch_dtype)
            for name, adapter in layers
        ]
        holders = None
        if gradient_holders is not None:
            holders = {
                b.name: tuple(sorted({r for p in b.adapter.params() for r in gradient_holders[p]})) for b in self.blocks
            }
        self.distributor = Distributor(self.blocks, self.config, method, process_group, bucket_bytes, holders)
        self._by_name = {b.name: b for b in self.blocks}
        factor_keys = [(b.name, side) for b in self.blocks for side in ("A", "G")]
        adaptive = self.config.inv_update_steps == "adaptive"
        self.refresh = AdaptiveRefresh(factor_keys, self.config.adaptive_threshold) if adaptive else None
        self.steps = 0
        self.last_nu: Optional[torch.Tensor] = None
        self.preconditioned: tuple[str, ...] = ()
        """Layers this rank preconditioned with a decomposition in the last :meth:`precondition_gradients`."""
        self.counters: dict[str, int] = defaultdict(int)
        self.timer = PhaseTimer()
        self._pending: Optional[PendingDecompositions] = None
        self._stacks = StackedStates()
        self._reported_missing: set[str] = set()
        self._seen: set[str] = set()  # layers that have had factors (the same set on every rank)
        self._collecting = True
        self._handles = [
            block.adapter.module.register_forward_hook(partial(self._forward_hook, block)) for block in self.blocks
        ]

    # ------------------------------------------------------------------ hooks
    def _forward_hook(self, block: KFACBlock, module: nn.Module, inputs: tuple, output: Any) -> None:
        if not (self._collecting and module.training and torch.is_grad_enabled()):
            return
        if not self.distributor.collects(block):
            return
        with self.timer.phase("hooks"):
            self._refuse_after_hand_over(block)
            x = inputs[0]
            block.a.accumulate(block.adapter.input_rows(x), bias_column=block.adapter.has_bias)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(partial(self._output_grad_hook, block, block.adapter.batch_size(x)))

    def _output_grad_hook(self, block: KFACBlock, batch_size: int, grad: torch.Tensor) -> None:
        with self.timer.phase("hooks"):
            # c = B * accumulation_steps / loss_scale: per-example gradients of the unscaled loss.
            self._refuse_after_hand_over(block)
            scale = self.loss_scale() if self.loss_scale is not None else 1.0
            block.g.accumulate(block.adapter.output_grad_rows(grad), batch_size * self.accumulation_steps / scale)
            # Complete once every forward call of the step has had its backward (counts, so that
            # a layer called several times per micro-batch waits for its last call).
            done = self._last_micro_batch is not None and block.g.pending == block.a.pending
            if done and self._last_micro_batch():
                self.distributor.statistics_ready(block)

    def _refuse_after_hand_over(self, block: KFACBlock) -> None:
        if self.distributor.handed_over(block):
            raise RuntimeError(
                f"K-FAC layer {block.name!r} ran again after its factors for this step were final and sent "
                f"(at the last micro-batch's backward). If one optimizer step runs several forward/backward "
                f"passes, pass accumulation_steps (and boundary), or set overlap_factor_comm to false"
            )

    @property
    def collecting(self) -> bool:
        """Whether the hooks gather factors for the step in progress (``steps % factor_update_steps == 0``)."""
        return self._collecting

    def discard_step_statistics(self) -> None:
        """Forget the factors gathered for the step in progress (e.g. it overflowed and is skipped).
        Collective when factors are reduced during backward: call it on every rank."""
        self.distributor.discard_statistics()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, layout: Optional[GradientLayout] = None) -> None:
        """Update curvature as scheduled and precondition every registered layer's gradient in place.

        ``layout`` says where the reduced gradients lie; the default is each
        parameter's whole ``.grad`` (plain PyTorch, DDP, ZeRO stage 0).
        """
        self.precondition_gradients(layout or GradientLayout())
        self.finish_step()

    @torch.no_grad()
    def precondition_gradients(self, layout: GradientLayout) -> None:
        """Steps 2-4 of the flow for the step in progress, without advancing the step counter."""
        self.update_curvature()
        s = self.steps
        distributor = self.distributor
        blocks, grads, fragments = layout.gather(self.blocks)
        mine = [distributor.is_grad_worker(b) for b in blocks]
        chosen = [i for i, m in enumerate(mine) if m]
        mine_blocks = [blocks[i] for i in chosen]
        self.preconditioned = tuple(b.name for b in mine_blocks if b.state is not None)
        if self._stacks.stale(mine_blocks):
            with self.timer.phase("decompose"):  # after a refresh: stack the new decompositions
                self._stacks.prepare(mine_blocks)
        with self.timer.phase("precondition"):
            damping = resolve(self.config.damping, s)
            graft = self.config.grafting == "gradient"
            results = self._stacks.precondition(mine_blocks, [grads[i] for i in chosen], damping, graft)
            out: list[Optional[torch.Tensor]] = [None] * len(blocks)
            for i, result in zip(chosen, results):
                out[i] = result
            kl_clip = self.config.kl_clip
            if kl_clip is not None:
                lr = resolve(self.lr, s) if self.lr is not None else self.optimizer.param_groups[0]["lr"]
                counted = [
                    i for i, b in enumerate(blocks) if mine[i] and (layout.sharded or distributor.counts_in_kl_sum(b))
                ]
                vg = layout.dot(
                    [blocks[i] for i in counted],
                    [fragments[i] for i in counted],
                    [out[i] for i in counted],
                    [grads[i] for i in counted],
                )
                if layout.sharded or not distributor.plan.replicated:
                    vg = vg.to(torch.float32).reshape(1)
                    all_reduce_sum_([vg], self.process_group)
                    vg = vg[0]
                scale = layout.grad_scale()
                nu = torch.sqrt(resolve(kl_clip, s) / (lr**2 * (vg / (scale * scale)).abs())).clamp(max=1.0)
                self.last_nu = nu
                out = [None if p is None else p.mul_(nu.to(p.dtype)) for p in out]
            layout.write(blocks, fragments, distributor.share_preconditioned(blocks, out, grads))

    @torch.no_grad()
    def update_curvature(self) -> None:
        """Steps 2 and 3 of the flow: fold in this step's factors, decompose when scheduled."""
        s = self.steps
        if self._pending is not None and s >= self._pending.install_at:
            with self.timer.phase("decompose"):
                self._adopt(*self.distributor.share_sides(self._pending.blocks, *self._pending.job.result()))
            self._pending = None
        if self._collecting:
            self._update_factors(resolve(self.config.factor_decay, s))
        damping = resolve(self.config.damping, s)
        if self.refresh is not None:
            due = [key for key in self.refresh.due(s) if key[0] in self._seen]
            if due:
                with self.timer.phase("decompose"):
                    intervals = self.distributor.agree_intervals(due, self.refresh.decide)
                    self._update_decompositions(damping, set(due))
                    for (name, side), interval in zip(due, intervals):
                        factor = self._by_name[name].a if side == "A" else self._by_name[name].g
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
        damping = resolve(self.config.damping, started)
        job = Background(partial(self.distributor.compute_sides, seen, damping), blocks_device(self.blocks))
        self._pending = PendingDecompositions(started, install_at, seen, job)

    def _seen_blocks(self) -> list[KFACBlock]:
        """The blocks that have had factors (the same on every rank): those that are decomposed."""
        return [b for b in self.blocks if b.name in self._seen]

    def _is_factor_step(self, step: int) -> bool:
        return step % resolve(self.config.factor_update_steps, step) == 0

    def _is_decomposition_step(self, step: int) -> bool:
        return step % resolve(self.config.inv_update_steps, step) == 0

    def finish_step(self) -> None:
        """Advance the step counter and arm the hooks for the next step."""
        self.steps += 1
        self._arm_hooks()

    def _arm_hooks(self) -> None:
        """Collect factors during the step in progress iff ``steps % factor_update_steps == 0``."""
        self._collecting = self._is_factor_step(self.steps)

    def _update_factors(self, decay: float) -> None:
        with self.timer.phase("factor_comm"):
            reduced = self.distributor.reduce_factors(self._blocks_with_statistics())
        with self.timer.phase("factors"):
            bad = self.distributor.fold_factors(reduced, decay)
        if bad:
            self.counters["nonfinite_factor_updates"] += bad
            warnings.warn(
                f"K-FAC skipped {bad} non-finite factor update(s) (each keeps its previous running average)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _blocks_with_statistics(self) -> list[KFACBlock]:
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
                b.a.discard_step()
                b.g.discard_step()
        if missing:
            self.counters["missing_layer_updates"] += len(missing)
            new = set(missing) - self._reported_missing
            if new:
                self._reported_missing |= new
                warnings.warn(
                    f"K-FAC layers whose hooks did not fire this step (called through a functional path, "
                    f"unused, or without grad?): {sorted(new)}; their gradients pass through unpreconditioned "
                    f"until they have factors",
                    RuntimeWarning,
                    stacklevel=3,
                )
        ready = [b for b, ok in zip(self.blocks, present) if ok]
        self._seen.update(b.name for b in ready)
        return ready

    def _update_decompositions(self, damping: float, due: Optional[set[tuple[str, str]]] = None) -> None:
        self._adopt(*self.distributor.decompose(self._seen_blocks(), damping, due))

    def _adopt(self, chosen: list[KFACBlock], states: list[tuple]) -> None:
        """Install the candidate decompositions that are finite; keep the previous ones of the others."""
        candidates = list(zip(chosen, states))
        if not candidates:
            return
        flags = [all_finite(state).to(blocks_device(self.blocks)) for _, state in candidates]
        ok = torch.stack(flags).tolist()  # the one host sync of a decomposition step
        failed = []
        for (block, state), good in zip(candidates, ok):
            if good:
                block.state = state
            else:
                failed.append(block.name)
        if failed:
            self.counters["failed_decompositions"] += len(failed)
            warnings.warn(
                f"K-FAC decomposition not finite for {failed}; keeping the previous one "
                f"(or passing the gradient through)",
                RuntimeWarning,
                stacklevel=3,
            )

    def snapshot(self) -> "Snapshot":
        """References to all state a step changes (steps never modify tensors in place), to
        :meth:`restore` if the step is then skipped, e.g. by DeepSpeed for fp16 overflow."""
        return Snapshot(
            steps=self.steps,
            blocks=[(b.a.value, b.g.value, b.state) for b in self.blocks],
            counters=dict(self.counters),
            last_nu=self.last_nu,
            refresh=self.refresh.snapshot() if self.refresh is not None else None,
            pending=self._pending,
        )

    def restore(self, snap: "Snapshot") -> None:
        """Undo everything since :meth:`snapshot`, dropping the statistics gathered for that step."""
        for b, (a, g, state) in zip(self.blocks, snap.blocks):
            b.a.value, b.g.value, b.state = a, g, state
        self.discard_step_statistics()
        self.steps = snap.steps
        self.counters = defaultdict(int, snap.counters)
        self.last_nu = snap.last_nu
        if self.refresh is not None:
            self.refresh.restore(snap.refresh)
        self._pending = snap.pending
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
        what preconditioning keeps between steps (``eigen-outer``'s ``D`` on gradient workers)."""
        usage = {"factors": 0, "decompositions": 0, "accumulators": 0, "refresh_references": 0}
        usage["preconditioning_cache"] = self._stacks.cache_bytes()
        for b in self.blocks:
            for factor in (b.a, b.g):
                running, accumulator = factor.nbytes()
                usage["factors"] += running
                usage["accumulators"] += accumulator
            usage["decompositions"] += sum(t.numel() * t.element_size() for t in (b.state or ()))
        if self.refresh is not None:
            references = [t for f in self.refresh.factors.values() for t in (f.last, f.before_last) if t is not None]
            usage["refresh_references"] = sum(t.numel() * t.element_size() for t in references)
        return usage

    @property
    def layer_names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """All K-FAC state, world-size and placement independent: whole factors and
        decompositions per layer, gathered from the ranks that hold them. Collective:
        call it on every rank (as ``engine.save_checkpoint`` is)."""
        p = self._pending
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            **{key: getattr(self.config, key) for key in METHOD_KEYS},
            "counters": dict(self.counters),
            "refresh": self.refresh.state_dict() if self.refresh is not None else None,
            # Restarted on load from the saved factors, which are those it started from.
            "pending_decompositions": None if p is None else {"started": p.started, "install_at": p.install_at},
            "layers": {
                name: {"shape": (self._by_name[name].adapter.a_dim, self._by_name[name].adapter.g_dim), **entry}
                for name, entry in self.distributor.gather_state(self._local_state()).items()
            },
        }

    def _local_state(self) -> dict[str, dict[str, Any]]:
        state = {
            # Cloned: a state is a view into its shape's stack, which would be saved whole.
            b.name: {"A": b.a.value, "G": b.g.value, "state": None if b.state is None else [t.clone() for t in b.state]}
            for b in self.blocks
        }
        if self.refresh is not None:
            for (name, side), f in self.refresh.factors.items():
                state[name][f"{side}_refs"] = [f.last, f.before_last]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a mismatch (other model, layers, method) raises naming what differs."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"K-FAC state has version {state.get('version')!r}, expected {STATE_VERSION}")
        for key in METHOD_KEYS:
            # A checkpoint from before a key existed was saved with its default.
            then, now = state.get(key, KFACConfig.model_fields[key].default), getattr(self.config, key)
            if then != now:
                raise ValueError(f"K-FAC state was saved with {key}={then!r}, this run uses {now!r}")
        saved, here = set(state["layers"]), set(self.layer_names)
        if saved != here:
            raise ValueError(
                f"K-FAC state does not match this model's layers: missing from the checkpoint {sorted(here - saved)}, "
                f"not in this model {sorted(saved - here)}"
            )
        for b in self.blocks:
            entry = state["layers"][b.name]
            if tuple(entry["shape"]) != (b.adapter.a_dim, b.adapter.g_dim):
                raise ValueError(
                    f"K-FAC layer {b.name!r}: checkpoint factors are (A, G) = {tuple(entry['shape'])}, "
                    f"this model has {(b.adapter.a_dim, b.adapter.g_dim)}"
                )
            a_shapes, g_shapes = b.method.side_shapes(b.adapter.a_dim, b.adapter.g_dim)
            saved_shapes = None if entry["state"] is None else [tuple(t.shape) for t in entry["state"]]
            if saved_shapes is not None and saved_shapes != a_shapes + g_shapes:
                raise ValueError(
                    f"K-FAC layer {b.name!r}: checkpoint decomposition has tensors of shapes {saved_shapes}, "
                    f"{b.method.name!r} holds {a_shapes + g_shapes} (saved by another ds_kfac version?)"
                )
        if (self.refresh is None) != (state.get("refresh") is None):
            raise ValueError(
                f"K-FAC state was saved with inv_update_steps {'adaptive' if state.get('refresh') else 'fixed'}, "
                f"this run uses {self.config.inv_update_steps!r}"
            )
        for b in self.blocks:
            entry = state["layers"][b.name]
            device = b.adapter.module.weight.device
            a, g = (None if t is None else t.to(device) for t in (entry["A"], entry["G"]))
            b.a.value = a if self.distributor.keeps(b, "A") else None
            b.g.value = g if self.distributor.keeps(b, "G") else None
            worker = self.distributor.is_grad_worker(b) and entry["state"] is not None
            b.state = tuple(t.to(device) for t in entry["state"]) if worker else None
        self.distributor.discard_statistics()
        self._seen = {name for name, entry in state["layers"].items() if entry["A"] is not None}
        if self.refresh is not None:
            self.refresh.load_state_dict(state["refresh"])
            device = blocks_device(self.blocks)
            for (name, side), f in self.refresh.factors.items():
                refs = state["layers"][name].get(f"{side}_refs") if self.distributor.holds(name, side) else None
                f.last, f.before_last = (
                    (None, None) if refs is None else (None if t is None else t.to(device) for t in refs)
                )
        self.steps = state["steps"]
        self.counters = defaultdict(int, state["counters"])
        pending = state.get("pending_decompositions")
        self._pending = None
        if pending is not None:
            self._run_in_background(pending["started"], pending["install_at"])
        self._arm_hooks()

    def __repr__(self) -> str:
        skipped = ", ".join(s.name for s in self.skipped_layers) or "none"
        return f"KFACPreconditioner({len(self.blocks)} layers, skipped: {skipped}, {self.config})"


__all__ = ["KFACPreconditioner", "SkippedLayer"]
