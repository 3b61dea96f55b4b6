"""What K-FAC cannot run with in a DeepSpeed setup: :func:`refuse_unsupported`, called by ``ds_kfac.initialize``
before any engine is built, names every such part in one error."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch
from deepspeed import comm as ds_comm
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from ..config import KFACConfig, KFACConfigError
from ..placement.plan import zero3_problem
from ..preconditioning.build import preconditioned_parameters


def refuse_unsupported(
    cfg: DeepSpeedConfig,
    config: dict,
    kfac_config: KFACConfig,
    model: torch.nn.Module,
    mpu: Any,
    mesh_param: Any,
    mpu_problems: list[str],
    optimized: Optional[set[int]] = None,
) -> None:
    """One error naming every part of the DeepSpeed setup K-FAC does not support yet (``mpu_problems``: those of
    the model-parallel ``mpu``, ``initialize._refuse_mpu``'s; ``optimized``: the ids of the parameters the base
    optimizer steps, :func:`optimized_parameters`)."""
    stage = cfg.zero_optimization_stage
    offload = [
        name
        for name, section in (
            ("offload_optimizer", cfg.zero_config.offload_optimizer),
            ("offload_param", cfg.zero_config.offload_param),
        )
        if section is not None
        and str(getattr(section, "device", "none")).lower() not in ("none", "offloaddevicenum.none")
    ]
    problems = []
    if stage == 3:
        workers = zero3_problem(kfac_config.grad_worker_fraction, ds_comm.get_world_size())
        if workers:
            problems.append(workers)
        if kfac_config.fisher == "sampled":
            problems.append(
                'kfac.fisher="sampled" at ZeRO stage 3 (the sampled backward pass would run through ZeRO 3\'s '
                "parameter-gathering autograd functions, outside DeepSpeed's backward; use ZeRO stage 0-2)"
            )
    left_out = _layer_parameters_left_out(model, kfac_config, optimized) if stage > 0 else []
    if left_out:
        problems.append(
            f"parameters of K-FAC's layers that are not in the optimizer at ZeRO stage {stage}: {', '.join(left_out)} "
            f"(ZeRO reduces and partitions only the gradients of the optimizer's parameters, so K-FAC would find "
            f"none of theirs; at stage 0 they would stay unchanged): pass them to the optimizer, freeze them "
            f"(requires_grad=False), or name their layers in kfac.skip_layers"
        )
    if offload:
        problems.append(f"ZeRO {' and '.join(offload)}")
    if cfg.float16_config.enabled and stage == 0:
        problems.append(
            "fp16 with ZeRO stage 0 (its optimizer wrapper does not scale the loss; use stage 1/2, or bf16)"
        )
    if cfg.bfloat16_config.enabled and stage == 1 and str(cfg.grad_accum_dtype).lower() in ("fp32", "float32"):
        problems.append("bf16 with data_types.grad_accum_dtype=fp32 at ZeRO stage 1 (DeepSpeed's BF16_Optimizer)")
    if not getattr(cfg, "managed_gradient_accumulation", True):
        problems.append(
            "managed_gradient_accumulation=false (K-FAC scales G by gradient_accumulation_steps and needs "
            "the engine's micro-step count to find the accumulation boundary)"
        )
    if kfac_config.eigenbasis_moments and (isinstance(model, PipelineModule) or mpu is not None):
        problems.append(
            "kfac.eigenbasis_moments with pipeline or tensor parallelism (the raw gradients' norm would have to be "
            "completed over the model-parallel group; use data parallelism and ZeRO)"
        )
    if isinstance(model, PipelineModule):
        problems += _pipeline_problems(cfg, model, mpu)
        if kfac_config.fisher == "sampled":
            problems.append(
                'kfac.fisher="sampled" with pipeline parallelism (train_batch() computes the loss inside the engine, '
                "where no sampled backward can run)"
            )
    if mesh_param is not None or "sequence_parallel_size" in config:
        problems.append("sequence/mesh parallelism")
    problems += mpu_problems
    autotp = cfg.tensor_parallel_config.autotp_size
    if autotp > 1:
        problems.append(f"tensor_parallel.autotp_size={autotp} (AutoTP tensor parallelism; supported: 0, 1)")
    if cfg.torch_autocast_enabled:
        problems.append(
            "torch_autocast.enabled=true (K-FAC's hooks would collect A and G in the autocast dtype and, in fp16, "
            "from gradients scaled by a torch.amp.GradScaler whose scale K-FAC does not take out, and DeepSpeed "
            "would unscale_ them after K-FAC's step when gradient_clipping() > 0, as with eigenbasis_moments; "
            'use the "bf16" or "fp16" section)'
        )
    if cfg.hybrid_engine.enabled:
        problems.append("hybrid_engine.enabled=true (DeepSpeedHybridEngine, RLHF generation)")
    if problems:
        raise KFACConfigError("K-FAC does not support yet: " + "; ".join(problems))


def optimized_parameters(optimizer: Any, model_parameters: Optional[Sequence[Any]]) -> Optional[set[int]]:
    """The ids of the parameters the engine's base optimizer will step: a built optimizer's param groups', or, for
    the one DeepSpeed builds from the JSON, those of ``model_parameters`` (tensors or param-group dicts); ``None``
    where that is not known before the engine exists (an optimizer factory, or no ``model_parameters``: DeepSpeed
    then takes the model's)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups: Sequence[Any] = optimizer.param_groups
    elif optimizer is None and model_parameters is not None:
        groups = model_parameters
    else:
        return None
    ids = set()
    for item in groups:
        members = item["params"] if isinstance(item, dict) else item
        ids.update(id(p) for p in ([members] if isinstance(members, torch.Tensor) else members))
    return ids


def _layer_parameters_left_out(
    model: torch.nn.Module, kfac_config: KFACConfig, optimized: Optional[set[int]]
) -> list[str]:
    """The names of the trainable parameters of K-FAC's layers that are not in ``optimized`` (none when it is not
    known)."""
    if optimized is None:
        return []
    names = {id(p): name for name, p in model.named_parameters()}
    layers = preconditioned_parameters(model, kfac_config)
    return [names[id(p)] for p in layers if p.requires_grad and id(p) not in optimized]


def _pipeline_problems(cfg: DeepSpeedConfig, model: PipelineModule, mpu: Any) -> list[str]:
    """What K-FAC does not support with a ``PipelineModule``."""
    problems = []
    if isinstance(model, DualPipeVModule):
        problems.append("DualPipeV pipelines (DualPipeVModule; supported: PipelineModule)")
    stage = cfg.zero_optimization_stage
    if stage >= 2:
        problems.append(
            f"zero_optimization.stage={stage} with pipeline parallelism (DeepSpeed's PipelineEngine runs stages 0 "
            f"and 1 only)"
        )
    if cfg.float16_config.enabled:
        problems.append("fp16 with pipeline parallelism (not verified with K-FAC: needs CUDA; use bf16 at ZeRO 1)")
    if cfg.bfloat16_config.enabled and stage == 0:
        problems.append(
            "bf16 at ZeRO stage 0 with pipeline parallelism (DeepSpeed's pipeline then uses its BF16_Optimizer, "
            "whose gradients K-FAC does not read; use ZeRO stage 1)"
        )
    slices = model.mpu().get_slice_parallel_world_size()
    if slices > 1 and not _megatron_tensor_parallel(slices):
        problems.append(
            f"a pipeline topology with a model axis of size {slices} without megatron-core's tensor parallelism of "
            f"that size (megatron.core.parallel_state initialized with tensor_model_parallel_size={slices}): each "
            f"rank's factors would be those of its shard"
        )
    if slices > 1 and stage > 0:
        problems.append(
            f"ZeRO stage {stage} with tensor parallelism inside the pipeline (K-FAC needs each shard's whole "
            f"gradient: stage 0)"
        )
    if mpu is not None:
        problems.append(
            f"mpu={type(mpu).__name__} with a PipelineModule (the pipeline's grid is its mpu; deepspeed.initialize "
            f"refuses it too)"
        )
    return problems


def _megatron_tensor_parallel(size: int) -> bool:
    """Whether megatron-core's ``parallel_state`` is initialized with tensor-parallel size ``size`` (its layers then
    carry their tensor-parallel group, which K-FAC reads: :mod:`ds_kfac.integration.megatron`)."""
    state = sys.modules.get("megatron.core.parallel_state")
    return (
        state is not None
        and state.model_parallel_is_initialized()
        and state.get_tensor_model_parallel_world_size() == size
    )
