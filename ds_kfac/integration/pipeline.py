"""A DeepSpeed pipeline engine that preconditions gradients with K-FAC.

:class:`KFACPipelineEngine` is a subclass of ``deepspeed.runtime.pipe.PipelineEngine``; the user's loop stays
``engine.train_batch()``. Each stage's rank preconditions the layers of its own stage:

* module hooks gather factors during every micro-batch's forward and backward (the last stage back-propagates
  ``loss / gradient_accumulation_steps`` through ``DeepSpeedEngine.backward``, the other stages the gradients
  they receive from the next stage, which carry the same scale: ``G`` is unscaled by the micro-batch count);
* the pipeline's ``OptimizerStep`` instruction runs ``PipelineEngine._exec_optimizer_step``, which calls
  :meth:`_take_model_step` after the ``ReduceTiedGrads`` and ``ReduceGrads`` instructions have reduced the
  gradients over the stage's data-parallel group: K-FAC preconditions there, before DeepSpeed clips them and
  runs the base optimizer, with the same skip-step handling as :class:`~ds_kfac.KFACEngine`;
* factors are averaged, and placement balances work, over the stage's data-parallel group (the grid's
  ``get_data_parallel_group()``); the KL clip's sum is completed over the pipeline's stages (the grid's
  ``get_model_parallel_group()``), so every rank scales by the same ``nu``;
* the pipeline engine's ``is_gradient_accumulation_boundary()`` is False during every backward pass: the last
  micro-batch is found by counting the stage's backward passes in :meth:`train_batch`, so a layer's factors
  start their reduction during the last micro-batch's backward pass through it (``overlap_factor_comm``);
* layers tied across stages (``TiedLayerSpec``) are skipped with a warning: each stage would precondition its
  copy with factors of its own uses only, and the copies' all-reduced gradient would no longer agree;
* every stage must have a layer K-FAC preconditions (checked when the engine is built);
* a checkpoint keeps each stage's K-FAC state in ``kfac_state_pp<stage>.pt``, written by the stage's
  data-parallel rank 0; a checkpoint of another number of stages is refused.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..checkpoint import CheckedState
from ..comm import all_reduce_sum_
from ..config import KFACConfig
from .engine import KFACEngineMixin
from .files import STAGE_STATE_FILE, state_file


class KFACPipelineEngine(KFACEngineMixin, PipelineEngine):
    """``PipelineEngine`` plus K-FAC on this rank's stage; the preconditioner is :attr:`kfac`.

    Built by :func:`ds_kfac.initialize` for a ``PipelineModule``, which first refuses the setups this engine
    does not support (see docs/pipeline.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backwards_this_batch = 0
        self._forwards_this_batch = 0
        self.module.register_forward_pre_hook(self._count_forward)
        self.module.register_forward_hook(self._watch_output)
        self._refuse_stages_without_layers()

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """``PipelineEngine.train_batch``: one optimizer step over ``gradient_accumulation_steps()``
        micro-batches (their backward passes on this stage are counted from here)."""
        self._backwards_this_batch = self._forwards_this_batch = 0
        return super().train_batch(data_iter)

    def _count_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        """Count the stage's training forward passes of this batch: the pipeline runs them in micro-batch order."""
        if module.training and torch.is_grad_enabled():
            self._forwards_this_batch += 1

    def _micro_batch_index(self) -> Callable[[], int]:
        """The micro-batch whose forward pass runs on this stage (the engine's micro-step count does not
        advance within ``train_batch``)."""
        return lambda: self._forwards_this_batch - 1

    def _watch_output(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        """The stage's output with its first differentiable tensor replaced by a view of it whose gradient hook
        counts the micro-batch's backward pass: that view is the root of the pass, so the hook runs before any
        layer's (the last layer's output is the stage's output, and its K-FAC hook was registered first)."""
        if not (module.training and torch.is_grad_enabled()):
            return None
        if isinstance(output, torch.Tensor):
            return self._counted(output)
        if isinstance(output, tuple):
            i = next((i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if i is not None:
                return (*output[:i], self._counted(output[i]), *output[i + 1 :])
        return None

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        root = tensor.view_as(tensor)
        root.register_hook(self._count_backward)
        return root

    def _count_backward(self, grad: torch.Tensor) -> None:
        self._backwards_this_batch += 1

    def _refuse_stages_without_layers(self) -> None:
        """Raise on every rank if some stage registered no K-FAC layer: its preconditioner would skip every step,
        leaving the others' per-step collectives over the stages (the KL clip's sum) without it."""
        counts = torch.zeros(self.num_stages, dtype=torch.int32, device=self.device)
        counts[self.stage_id] = len(self.kfac.blocks)
        all_reduce_sum_([counts], self.grid.get_pipe_parallel_group())
        empty = [stage for stage, n in enumerate(counts.tolist()) if n == 0]
        if empty:
            raise ValueError(
                f"pipeline stages {empty} have no layer K-FAC preconditions (all skipped, tied across stages, or of "
                f"no supported type; see the warnings): K-FAC needs one on every stage. Partition the model "
                f"otherwise (PipelineModule's partition_method) or change skip_layers"
            )

    def _kfac_config(self, config: KFACConfig) -> KFACConfig:
        """The user's configuration, with the layers tied across stages added to ``skip_layers``."""
        tied = sorted(f"tied_modules.{key}" for key, comm in self.module.tied_comms.items() if len(comm["ranks"]) > 1)
        if not tied:
            return config
        if self.grid.get_data_parallel_rank() == 0:
            warnings.warn(
                f"K-FAC skips the layers tied across pipeline stages (TiedLayerSpec) {tied}: each stage would "
                f"precondition its copy with the factors of its own uses only; the base optimizer trains them",
                UserWarning,
                stacklevel=2,
            )
        patterns = [rf"^{re.escape(name)}(\.|$)" for name in tied]
        return config.model_copy(update={"skip_layers": [*config.skip_layers, *patterns]})

    def _last_micro_batch(self) -> Optional[Callable[[], bool]]:
        """Whether the backward pass in progress on this stage is the batch's last (its ``micro_batches``-th).

        The pipeline's ``is_gradient_accumulation_boundary()`` cannot tell: it is False during every backward
        pass (True only inside its ``ReduceGrads`` and ``OptimizerStep`` instructions)."""
        return lambda: self._backwards_this_batch == self.micro_batches

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """``DeepSpeedEngine._take_model_step`` (clipping, base optimizer, scheduler) on preconditioned gradients:
        ``PipelineEngine._exec_optimizer_step`` calls it after the data-parallel and tied-gradient reductions."""
        base_step = super()._take_model_step
        self._kfac_step(lambda: base_step(lr_kwargs))

    # ------------------------------------------------------------ checkpoints
    def _kfac_state_file(self) -> str:
        """``kfac_state_pp<stage>.pt``, one per stage (per stage and tensor-parallel rank with a model axis:
        ``kfac_state_pp<stage>_tp<r>of<n>.pt``)."""
        return state_file(stage=self.stage_id, tensor_parallel=self._tensor_parallel_rank())

    def _checked_state(self, checkpoint: str) -> CheckedState:
        """This stage's K-FAC state, checked; a checkpoint of another number of stages, or a state that fails
        its check on any stage, raises ``ValueError`` on every rank before DeepSpeed loads anything."""
        names = os.listdir(checkpoint) if os.path.isdir(checkpoint) else []
        matches = [m for m in map(STAGE_STATE_FILE.fullmatch, names) if m]
        saved = sorted(m.string for m in matches)
        stages = {m.group(1) for m in matches}
        if saved and len(stages) != self.num_stages:
            raise ValueError(
                f"checkpoint {checkpoint} holds the K-FAC state of {len(stages)} pipeline stages ({', '.join(saved)}) "
                f"but this pipeline has {self.num_stages}: resume with the number of stages it was saved with, or "
                f"pass load_optimizer_states=False to start K-FAC fresh from its weights"
            )
        checked: Optional[CheckedState] = None
        try:
            checked = super()._checked_state(checkpoint)
        finally:  # the stages read different files: all of them learn whether one failed
            failed = torch.tensor([checked is None], dtype=torch.int32, device=self.device)
            all_reduce_sum_([failed], self.grid.get_pipe_parallel_group())
        if int(failed[0]):  # another stage failed (this one would have raised its own error above)
            raise ValueError(
                f"the K-FAC state of another pipeline stage in checkpoint {checkpoint} cannot be loaded (its ranks "
                f"raised the reason); nothing was loaded"
            )
        return checked
