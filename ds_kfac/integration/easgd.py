"""Synchronous EASGD as a DeepSpeed mode: :class:`EASGDEngine`, and :class:`KFACEASGDEngine` with K-FAC.

The engine turns off DeepSpeed's gradient all-reduce with DeepSpeed's own switch,
``engine.enable_backward_allreduce = False`` (the attribute ``DeepSpeedEngine.backward`` and ``step`` test
before ``allreduce_gradients``; DeepSpeed's pipeline engine sets it the same way), so each rank's base optimizer
steps on the gradient of its own micro-batches. Around that local step it runs the elastic update of
:class:`ds_kfac.easgd.ElasticAverager`. ZeRO stage 0 only (:func:`refuse_unsupported`).

Checkpoints: DeepSpeed's files (written by data-parallel rank 0) plus, per rank, ``easgd_rank<r>.pt`` in the
tag directory with that rank's module weights, optimizer state and the EASGD state (center, step count). On
load every rank reads and checks its file before DeepSpeed loads anything, then puts its own weights and
optimizer state back over rank 0's.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

from ..comm import create_groups
from ..config import KFACConfigError
from ..easgd import EASGDConfig, ElasticAverager
from .checkpointing import CheckpointMixin, Installer
from .engine import KFACEngine
from .files import EASGD_STATE, load_file, state_file


def _optimizer_weights(optimizer: Any) -> tuple[list[torch.Tensor], list[torch.nn.Parameter]]:
    """The tensors the base optimizer updates and the module parameters they are copied to, in the same order.

    fp32 at ZeRO 0: the module's parameters themselves. bf16 at ZeRO 0: DeepSpeed's ``FP16_UnfusedOptimizer``
    keeps fp32 masters in ``fp32_groups`` and copies them to the bf16 parameters of ``fp16_groups`` after its step.
    """
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        masters = [w for group in optimizer.fp32_groups for w in group]
        params = [p for group in optimizer.fp16_groups for p in group]
        return masters, params
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return list(params), params


def refuse_unsupported(
    cfg: DeepSpeedConfig, config: dict, model: torch.nn.Module, mpu: Any, kfac_section: Optional[dict]
) -> None:
    """One error naming every part of the setup EASGD cannot run with (``kfac_section``: the ``"kfac"`` section
    when K-FAC is enabled too)."""
    problems = []
    stage = cfg.zero_optimization_stage
    if stage != 0:
        problems.append(
            f"zero_optimization.stage={stage} (EASGD keeps different weights on each rank; ZeRO partitions assume "
            f"synchronised replicas; supported: 0)"
        )
    if cfg.float16_config.enabled:
        problems.append("fp16 (at ZeRO stage 0 DeepSpeed's fp16 wrapper does not scale the loss; use bf16)")
    if not getattr(cfg, "managed_gradient_accumulation", True):
        problems.append("managed_gradient_accumulation=false (the elastic update runs at the accumulation boundary)")
    if isinstance(model, PipelineModule) or "sequence_parallel_size" in config:
        problems.append("pipeline or sequence parallelism (EASGD averages whole data-parallel replicas)")
    if mpu is not None or cfg.tensor_parallel_config.autotp_size > 1 or cfg.hybrid_engine.enabled:
        problems.append("tensor parallelism (an mpu or tensor_parallel.autotp_size > 1) or the hybrid engine")
    for key, meaningful in (("grad_worker_fraction", (1, "comm-opt")), ("factor_reduction", ("local",))):
        if kfac_section is not None and key in kfac_section and kfac_section[key] not in meaningful:
            problems.append(
                f"kfac.{key}={kfac_section[key]!r} (with easgd each rank preconditions its own gradient with "
                f"factors of its own data: no factor or gradient is shared; leave the key out)"
            )
    if problems:
        raise KFACConfigError("EASGD does not support: " + "; ".join(problems))


class EASGDEngine(CheckpointMixin, DeepSpeedEngine):
    """``DeepSpeedEngine`` training by synchronous EASGD; the averager (center, update) is :attr:`easgd`."""

    def __init__(self, *args: Any, easgd_config: EASGDConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_backward_allreduce = False  # each rank keeps its own gradient
        weights, params = _optimizer_weights(self.optimizer)
        names = {p: n for n, p in self.module.named_parameters()}
        group = None
        if self.dp_world_size > 1:  # a group of its own: the all-reduce runs while the engine communicates
            (group,) = create_groups([tuple(dist.get_process_group_ranks(self.data_parallel_group))])
        self.easgd = ElasticAverager(weights, params, [names[p] for p in params], easgd_config, group)
        self.easgd.check_rate(self.get_lr()[0])

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        base_step = super().step
        if not self.is_gradient_accumulation_boundary():
            base_step(lr_kwargs)
            return

        def local_step() -> bool:
            base_step(lr_kwargs)
            return self.was_step_applied()

        self.easgd.step(self.get_lr()[0], local_step)

    def _easgd_file(self) -> str:
        """This rank's file in a checkpoint's tag directory, ``easgd_rank<r>.pt``."""
        return state_file(EASGD_STATE, rank=dist.get_rank(self.data_parallel_group))

    def _states_to_save(self) -> dict[str, Any]:
        """This rank's weights, optimizer and EASGD state in ``<save_dir>/<tag>/easgd_rank<r>.pt``."""
        state = {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "easgd": self.easgd.state_dict(),
        }
        return {self._easgd_file(): state, **super()._states_to_save()}

    def _read_checkpoint(self, checkpoint: str) -> list[Installer]:
        """This rank's file, checked; put back over the weights and optimizer DeepSpeed loads from rank 0's."""
        state = self._read_rank_state(os.path.join(checkpoint, self._easgd_file()))

        def install() -> None:
            self.module.load_state_dict(state["module"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.easgd.load_state_dict(state["easgd"])

        return [*super()._read_checkpoint(checkpoint), install]

    def _load_fresh(self) -> None:
        """``load_module_only=True`` or ``load_optimizer_states=False`` loaded rank 0's weights everywhere: EASGD
        restarts from them (center equal to the weights, step 0)."""
        super()._load_fresh()
        self.easgd.restart()

    def _read_rank_state(self, path: str) -> dict[str, Any]:
        """This rank's EASGD file, checked (a ``ValueError`` naming the file and key otherwise)."""
        if not os.path.isfile(path):
            saved = len(glob.glob(os.path.join(os.path.dirname(path), state_file(EASGD_STATE, rank="*"))))
            if not saved:
                raise ValueError(f"EASGD state not loaded (nothing was changed): no {path} (saved without EASGD?)")
            raise ValueError(
                f"EASGD state not loaded (nothing was changed): no {path}: the checkpoint was saved at world size "
                f"{saved} (one easgd_rank<r>.pt per rank) and this run has {self.easgd.world} data-parallel ranks; "
                f"each rank's weights are its own and cannot be redistributed: resume at world size {saved}, or pass "
                f"load_optimizer_states=False to restart EASGD from rank 0's weights"
            )
        state = load_file(path, "EASGD state")
        if not isinstance(state, dict) or set(state) != {"module", "optimizer", "easgd"}:
            raise ValueError(f"EASGD state not loaded (nothing was changed): {path}: expected module, optimizer, easgd")
        self.easgd.check_state_dict(state["easgd"], path)
        return state


class KFACEASGDEngine(EASGDEngine, KFACEngine):
    """EASGD with K-FAC: each rank preconditions its own local gradient with factors from its own micro-batches
    only (K-FAC on a single-rank process group per rank: no factor communication), then steps locally and
    applies the elastic update. K-FAC's state is saved per rank (``kfac_state_rank<r>.pt``)."""

    def _kfac_group(self) -> dist.ProcessGroup:
        # new_subgroups is collective: every rank creates every rank's group, and keeps its own.
        group, _ = dist.new_subgroups(group_size=1, group=self.data_parallel_group)
        return group

    def _kfac_state_file(self) -> str:
        return state_file(rank=dist.get_rank(self.data_parallel_group))
