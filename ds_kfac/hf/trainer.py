"""``KFACTrainer``: ``transformers.Trainer`` whose DeepSpeed engine is a :class:`ds_kfac.KFACEngine`.

A user changes only the class: the ``"kfac"`` section sits in the DeepSpeed
JSON given as ``TrainingArguments(deepspeed=...)``, whose ``"auto"`` values
Trainer fills as usual. Under DeepSpeed, accelerate calls ``engine.backward()``
and ``engine.step()`` itself, so no Trainer callback runs between DeepSpeed's
gradient reduction and its optimizer step. K-FAC therefore runs inside the
engine: the engine accelerate builds for training is ds_kfac's, built by
``ds_kfac.initialize`` (see :func:`ds_kfac.integration.substitute.kfac_initialize_once`),
which takes the ``"kfac"`` section out before DeepSpeed parses the config.

Trainer's DeepSpeed checkpoints go through ``engine.save_checkpoint`` /
``load_checkpoint``, so ``resume_from_checkpoint`` restores K-FAC's state
(``<checkpoint>/global_step<N>/kfac_state.pt``) with the model and optimizer.
Each training log gains K-FAC's metrics (:meth:`ds_kfac.KFACPreconditioner.metrics`).

With ``"fisher": "sampled"`` the sampled Fisher's extra backward runs in :meth:`KFACTrainer.compute_loss`, on the
outputs' ``logits`` (and the ``labels``, whose ignored positions it leaves out), before Trainer's backward.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from accelerate.utils import DeepSpeedPlugin, DistributedType, DummyOptim
from transformers import Trainer, TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from ..config import KFACConfig
from ..curvature import FisherLoss
from ..curvature.fisher import LOSSES
from ..integration.engine import KFACEngine
from ..integration.substitute import kfac_initialize_once
from ..preconditioner import KFACPreconditioner


class KFACTrainer(Trainer):
    """``transformers.Trainer`` with K-FAC preconditioning at each optimizer step (DeepSpeed only).

    Takes Trainer's arguments unchanged, and ``fisher_loss``: the loss whose targets the sampled Fisher draws
    (``"cross_entropy"``: classification and language modelling; ``"mse"``: regression), used only with
    ``"fisher": "sampled"``. The preconditioner of the running engine is :attr:`kfac`.
    """

    def __init__(self, *args: Any, fisher_loss: FisherLoss = "cross_entropy", **kwargs: Any) -> None:
        if fisher_loss not in LOSSES:  # refused now, not at the first factor-update step of the sampled Fisher
            raise ValueError(f"KFACTrainer: fisher_loss must be one of {LOSSES}, got {fisher_loss!r}")
        self.fisher_loss = fisher_loss
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, whose training ``prepare`` builds the engine with ``ds_kfac.initialize``."""
        _count_cpu_deepspeed_ranks(self.args)
        super().create_accelerator_and_postprocess()
        if not self.is_deepspeed_enabled:
            raise ValueError(
                "KFACTrainer runs K-FAC inside DeepSpeed: pass TrainingArguments(deepspeed=<config with a 'kfac' "
                "section>), or use transformers.Trainer without K-FAC"
            )
        section = self.accelerator.state.deepspeed_plugin.deepspeed_config.get("kfac")
        if section is None:
            warnings.warn(
                "KFACTrainer: the DeepSpeed config has no 'kfac' section, so K-FAC is off (plain DeepSpeed)",
                UserWarning,
                stacklevel=3,
            )
        KFACConfig.parse(section)  # a bad section fails here, before anything is trained
        self.accelerator.prepare = _preparing_with_kfac(self.accelerator.prepare)

    @property
    def kfac(self) -> Optional[KFACPreconditioner]:
        """The running engine's K-FAC preconditioner (``None`` before training starts, or with K-FAC disabled)."""
        engine = self.model_wrapped
        return engine.kfac if isinstance(engine, KFACEngine) else None

    def compute_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs: Any
    ) -> Any:
        """Trainer's loss; with ``"fisher": "sampled"``, in training, first the sampled Fisher's backward on the
        outputs' logits (:meth:`ds_kfac.KFACPreconditioner.sample_fisher`), which leaves every ``.grad`` as it is."""
        kfac = self.kfac
        if kfac is None or kfac.config.fisher != "sampled" or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        labels = inputs.get("labels")  # Trainer's loss may pop it
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
        kfac.sample_fisher(_logits(outputs), self.fisher_loss, labels=labels)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's ``log``, with K-FAC's metrics (``kfac/steps``, ``kfac/nu``, ...) in each training log."""
        if "loss" in logs and self.kfac is not None:
            logs = {**logs, **self.kfac.metrics()}
        super().log(logs, *args, **kwargs)


def _logits(outputs: Any) -> torch.Tensor:
    """The model outputs' ``logits`` (a dict's key, or a tuple's second entry after the loss, as Trainer reads the
    loss from the first), for the sampled Fisher; a ``ValueError`` naming what the outputs hold otherwise."""
    if isinstance(outputs, dict):
        if "logits" in outputs:
            return outputs["logits"]
        found = f"outputs with keys {list(outputs)}"
    elif isinstance(outputs, (tuple, list)) and len(outputs) > 1 and torch.is_tensor(outputs[1]):
        return outputs[1]
    else:
        found = f"outputs of type {type(outputs).__name__}"
    raise ValueError(
        f'KFACTrainer with "fisher": "sampled" samples targets from the model\'s "logits" output (a dict key, or a '
        f"tuple's second entry after the loss); the model returned {found}: return its logits (cross_entropy) or "
        f'prediction (mse) as "logits"'
    )


def _preparing_with_kfac(prepare: Callable[..., Any]) -> Callable[..., Any]:
    """accelerate's ``prepare``, building the engine with ``ds_kfac.initialize`` when it is given an optimizer
    (training); dataloaders and evaluation-only models are prepared as before."""

    def prepare_with_kfac(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, (torch.optim.Optimizer, DummyOptim)) for a in args):
            return prepare(*args, **kwargs)
        with kfac_initialize_once() as built:
            prepared = prepare(*args, **kwargs)
        if not built:
            raise RuntimeError(
                "accelerate prepared the model without calling deepspeed.initialize, so the engine is not "
                "ds_kfac's and K-FAC would not run (an accelerate version that builds its engine another way, or "
                "an fp8 backend with its own initialize); see docs/maintainers.md"
            )
        return prepared

    return prepare_with_kfac


def _count_cpu_deepspeed_ranks(args: TrainingArguments) -> None:
    """Give accelerate's process state the DeepSpeed job's ranks when it missed them (DeepSpeed on CPU).

    accelerate 1.15 sets up DeepSpeed's process group but takes its ranks from a CUDA-like backend only: on
    CPU every rank thinks it is process 0 of 1, so each would train on the whole dataset, write every
    checkpoint file, and Trainer fills ``"train_batch_size": "auto"`` for one rank. Here the shared state
    gets the process group's ranks, and the DeepSpeed config's ``"auto"`` values are filled again, as
    ``Trainer`` itself does for hyperparameter search. A no-op wherever accelerate counted the ranks (GPUs).
    """
    state = args.distributed_state
    if (
        state is None
        or state.distributed_type != DistributedType.DEEPSPEED
        or state.backend is not None
        or not dist.is_initialized()
        or dist.get_world_size() == state.num_processes
    ):
        return
    state.backend = dist.get_backend()
    state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    args.hf_deepspeed_config.trainer_config_process(args)
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)
