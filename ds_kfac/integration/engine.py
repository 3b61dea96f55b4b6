"""A DeepSpeed engine that preconditions gradients with K-FAC.

:class:`KFACEngine` is a subclass of ``deepspeed.DeepSpeedEngine`` (as
DeepSpeed's own pipeline and hybrid engines are): nothing in DeepSpeed is
patched. The user's loop stays ``engine.backward(loss); engine.step()``:

* module hooks gather factors during every micro-batch's forward and backward
  (``G`` unscaled by ``gradient_accumulation_steps`` and the loss scale);
* at the accumulation boundary, :meth:`step` preconditions the gradients after
  DeepSpeed has reduced them and before DeepSpeed clips them
  (``gradient_clipping``) and runs the base optimizer; under ZeRO 1/2 each
  rank preconditions the gradient partition it owns (see
  :mod:`ds_kfac.placement.gradients`); with fewer gradient workers than ranks,
  a layer's workers are the KAISA columns of the ranks owning its partition,
  and ZeRO's parameter all-gather delivers the result;
* if DeepSpeed then skips the step (fp16/bf16 overflow), the step's K-FAC
  statistics are discarded and its curvature updates undone;
* a checkpoint keeps K-FAC's state in a file of its own, written by
  data-parallel rank 0 alone and, on load, checked on every rank before
  DeepSpeed loads anything.

All of this but the place of the step lives in :class:`KFACEngineMixin`, which
:class:`~ds_kfac.integration.pipeline.KFACPipelineEngine` shares.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from ..checkpoint import CheckedState
from ..comm import all_reduce_sum_
from ..config import KFACConfig
from ..placement import GradientLayout
from ..preconditioner import KFACPreconditioner
from ..preconditioning.build import moment_rule
from .checkpointing import CheckpointMixin, Installer
from .files import KFAC_STATE, load_file, state_file
from .layouts import zero_layout

STATE_FILE = state_file()
"""K-FAC's state in a checkpoint: ``<save_dir>/<tag>/kfac_state.pt``, beside DeepSpeed's files."""


class KFACEngineMixin(CheckpointMixin):
    """What every K-FAC engine adds to its DeepSpeed engine class: the preconditioner (:attr:`kfac`), the
    precondition-step-finish/restore sequence around the engine's model step (:meth:`_kfac_step`), the check
    that preconditioning reached the gradients, monitor events, and K-FAC's state in checkpoints.

    Mixed in before a ``DeepSpeedEngine`` subclass: :class:`KFACEngine` (``engine.step()``) and
    :class:`~ds_kfac.integration.pipeline.KFACPipelineEngine` (``engine.train_batch()``).
    """

    kfac: KFACPreconditioner
    raw_gradient_clipping: float = 0.0
    """With ``eigenbasis_moments``: DeepSpeed's ``gradient_clipping`` (its default when the config omits it), applied
    here to the raw gradients before K-FAC turns them into directions (``ds_kfac.initialize`` sets DeepSpeed's own to
    0). 0 (the class default) while DeepSpeed's ``__init__`` builds its optimizers, which must not clip."""

    def __init__(self, *args: Any, kfac_config: KFACConfig, raw_gradient_clipping: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw_gradient_clipping = raw_gradient_clipping
        self._clipped = [p for p in self.module.parameters() if p.requires_grad] if raw_gradient_clipping > 0 else []
        """The parameters whose gradients :attr:`raw_gradient_clipping` clips (found once, not every step)."""
        self.kfac = KFACPreconditioner(
            self.module,
            self._kfac_config(kfac_config),
            lr=lambda step: self.get_lr()[0],
            accumulation_steps=self.gradient_accumulation_steps(),
            loss_scale=self._loss_scale,
            boundary=self._last_micro_batch(),
            micro_batch=self._micro_batch_index(),
            process_group=self._kfac_group(),
            layout=self._gradient_layout(),
            moments=moment_rule(kfac_config, None, self.basic_optimizer),
            model_parallel_group=self._model_parallel_group(),
        )
        self._preconditioning_verified = False

    def gradient_clipping(self) -> float:
        """The norm the step clips the global gradient to: DeepSpeed's ``gradient_clipping``, or with
        ``eigenbasis_moments`` :attr:`raw_gradient_clipping`, the same value read from the same config with the same
        default, which the engine applies itself before preconditioning."""
        return self.raw_gradient_clipping or super().gradient_clipping()

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's clip at ZeRO stage 0 (fp32), which its step calls when :meth:`gradient_clipping` is positive:
        skipped when the engine clipped the raw gradients already (it would clip K-FAC's directions)."""
        if not self.raw_gradient_clipping:
            super().clip_fp32_gradients()

    def _kfac_config(self, config: KFACConfig) -> KFACConfig:
        """The configuration the preconditioner gets: the user's."""
        return config

    def _last_micro_batch(self) -> Optional[Callable[[], bool]]:
        """Whether the micro-batch being back-propagated ends the optimizer step (for overlapped factor
        reduction): DeepSpeed's accumulation boundary."""
        return self.is_gradient_accumulation_boundary

    def _micro_batch_index(self) -> Callable[[], int]:
        """The 0-based index in the optimizer step of the micro-batch being run (``factor_micro_batches``):
        DeepSpeed's micro-step count, which ``engine.step()`` advances after every micro-batch."""
        return lambda: self.micro_steps % self.gradient_accumulation_steps()

    def _gradient_layout(self) -> Optional[GradientLayout]:
        """Where this engine's ZeRO stage 1-3 keeps the reduced gradients (:mod:`ds_kfac.integration.layouts`);
        ``None`` at stage 0: each parameter's whole ``.grad``, the preconditioner's default (which also knows
        tensor-parallel layers)."""
        stage = self.zero_optimization_stage()
        if stage == 0:
            return None
        return zero_layout(stage, self.optimizer.dp_process_group, self._loss_scale)

    def _kfac_group(self) -> dist.ProcessGroup:
        """The ranks whose factors K-FAC combines: the data-parallel group."""
        return self.data_parallel_group

    def _model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the other parts of this rank's model replica (``mpu.get_model_parallel_group()``
        of Megatron's ``parallel_state`` or DeepSpeed's pipeline grid), or ``None`` when the model is whole."""
        if self.mpu is None:
            return None
        group = self.mpu.get_model_parallel_group()
        return group if dist.get_world_size(group) > 1 else None

    def _loss_scale(self) -> float:
        """The scale the gradients carry: ZeRO 1-3 scale the loss in ``engine.backward`` (fp16)."""
        return float(self.optimizer.loss_scale) if self.zero_optimization_stage() > 0 else 1.0

    def _kfac_step(self, model_step: Callable[[], None]) -> None:
        """Precondition the reduced gradients, run ``model_step`` (DeepSpeed's clipping and base optimizer),
        then advance K-FAC, or undo its step if DeepSpeed skipped the update (fp16/bf16 overflow)."""
        snapshot = self.kfac.snapshot()
        if self.raw_gradient_clipping > 0:
            self.kfac.layout.clip_by_norm(self._clipped, self.raw_gradient_clipping)
        preconditioned = self.kfac.precondition_gradients()
        if preconditioned and not self._preconditioning_verified:
            self._verify_preconditioning()
        model_step()
        if not preconditioned:
            return
        if self.was_step_applied():
            self.kfac.finish_step()
            self._write_monitor_events()
        else:
            self.kfac.restore(snapshot)
            self.kfac.health.skipped_step()

    def _verify_preconditioning(self) -> None:
        """Raise if a layer that has a decomposition was preconditioned on no data-parallel rank.

        That is how a renamed DeepSpeed internal would show: the ZeRO gradient layout finds no
        gradient, and K-FAC silently passes every gradient through. One small all-reduce per
        step until the first step at which some layer has a decomposition (step 0, unless
        decompositions run in the background), checked then, and never again.
        """
        blocks = self.kfac.blocks
        done = set(self.kfac.preconditioned)
        flags = torch.tensor(
            [[b.decomposition is not None for b in blocks], [b.name in done for b in blocks]],
            dtype=torch.int32,
            device=self.device,
        )
        all_reduce_sum_([flags], self.kfac.process_group)
        decomposed, preconditioned = flags.tolist()
        if not any(decomposed):
            return
        self._preconditioning_verified = True
        missed = [b.name for b, d, p in zip(blocks, decomposed, preconditioned) if d and not p]
        if missed:
            stage = self.zero_optimization_stage()
            where = {
                0: "param.grad",
                3: "deepspeed.utils.safe_get_local_grad, integration/layouts.py::Zero3Gradients",
            }.get(stage, "param._hp_mapping, integration/layouts.py::Zero12Gradients")
            raise RuntimeError(
                f"K-FAC layers {missed} have decompositions but no data-parallel rank preconditioned their "
                f"gradients: ds_kfac found none of their gradient where it reads DeepSpeed's (ZeRO stage {stage}: "
                f"{where}), so K-FAC would silently do nothing. A DeepSpeed internal it relies on has probably "
                f"changed in DeepSpeed {deepspeed.__version__}: see the table in docs/maintainers.md"
            )

    def _write_monitor_events(self) -> None:
        if not self.monitor.enabled:
            return
        step = self.global_samples
        self.monitor.write_events([(name, value, step) for name, value in self.kfac.metrics().items()])

    # ------------------------------------------------------------ checkpoints
    def _states_to_save(self) -> dict[str, Any]:
        """K-FAC's state in ``<save_dir>/<tag>/kfac_state.pt`` (:meth:`_kfac_state_file`), gathered to and written
        by data-parallel rank 0 only (collective: every rank gathers)."""
        state = self.kfac.state_dict()
        mine = {} if state is None else {self._kfac_state_file(): state}
        return {**mine, **super()._states_to_save()}

    def _read_checkpoint(self, checkpoint: str) -> list[Installer]:
        """K-FAC's state, read and checked on every rank: a state that cannot be loaded (another model or
        method, malformed, not finite) raises a ``ValueError``. As with the optimizer,
        ``load_optimizer_states=False`` or ``load_module_only=True`` start K-FAC fresh (e.g. BERT phase 2 from
        phase 1)."""
        checked = self._checked_state(checkpoint)
        return [*super()._read_checkpoint(checkpoint), lambda: self.kfac.load_state_dict(checked)]

    def _checked_state(self, checkpoint: str) -> CheckedState:
        """K-FAC's state in tag directory ``checkpoint``, read and checked against this preconditioner."""
        return self.kfac.check_state_dict(_read_state(checkpoint, self._kfac_state_file()))

    def _kfac_state_file(self) -> str:
        """The name of K-FAC's state file in a checkpoint's tag directory: ``kfac_state.pt``, or with tensor
        parallelism one per tensor-parallel rank ``r`` of ``n``, ``kfac_state_tp<r>of<n>.pt``, holding the whole
        factors of the layers that rank preconditions (those it owns under ``exact``)."""
        return state_file(tensor_parallel=self._tensor_parallel_rank())

    def _tensor_parallel_rank(self) -> tuple[int, int]:
        """This rank's tensor-parallel rank and the tensor-parallel size (1 without tensor parallelism)."""
        size = bwc_tensor_model_parallel_world_size(self.mpu)
        return (self.mpu.get_tensor_model_parallel_rank() if size > 1 else 0), size


class KFACEngine(KFACEngineMixin, DeepSpeedEngine):
    """``DeepSpeedEngine`` plus K-FAC; the preconditioner is :attr:`kfac`.

    Built by :func:`ds_kfac.initialize`, which first refuses the setups this
    engine does not support (ZeRO 3 without mem-opt, offload, tensor parallelism other than
    Megatron's at ZeRO stage 0, the hybrid engine, fp16 at stage 0).
    """

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        base_step = super().step
        if not self.is_gradient_accumulation_boundary():
            base_step(lr_kwargs)
            return
        self._kfac_step(lambda: base_step(lr_kwargs))


def _read_state(checkpoint: str, name: str = STATE_FILE) -> dict[str, Any]:
    """K-FAC's state from file ``name`` of a checkpoint's tag directory, as saved (CPU tensors, plain containers
    only)."""
    path = os.path.join(checkpoint, name)
    others = sorted(f for f in os.listdir(checkpoint) if f.startswith(KFAC_STATE)) if os.path.isdir(checkpoint) else []
    if not os.path.isfile(path) and others:
        raise ValueError(
            f"checkpoint {checkpoint} has no {name} but {others}: it was saved at another tensor-parallel size, and "
            f"K-FAC's per-rank state cannot be resharded; resume at the same size, or pass "
            f"load_optimizer_states=False to start K-FAC fresh from its weights"
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"checkpoint {checkpoint} has no K-FAC state (no {name}: saved without ds_kfac, with K-FAC "
            f"disabled, or by a ds_kfac that kept it in DeepSpeed's client_state); pass load_optimizer_states=False "
            f"to start K-FAC fresh from its weights"
        )
    return load_file(path, "K-FAC state")
