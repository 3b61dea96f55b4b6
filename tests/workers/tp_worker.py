"""Tensor-parallel worker for ``test_tensor_parallel.py``: megatron-core layers over gloo (TP=2, optionally x DP=2).

The model is ``ColumnParallelLinear(IN, HIDDEN) -> tanh -> RowParallelLinear(HIDDEN, OUT) -> tanh -> nn.Linear(OUT,
CLASSES)`` (the head replicated on every tensor-parallel rank), its weights the shards of :func:`full_weights`.
Every step the data-parallel rank ``d`` of ``D`` trains on rows ``[d B/D, (d+1) B/D)`` of :func:`batch`.

Scenario keys: ``mode`` (``tensor_parallel_factors``), ``bias`` (column and row biases), ``skip_bias_add`` (the
row layer returns its bias, added here), ``kfac`` (more K-FAC keys), ``dtype`` (:data:`DTYPES`), ``engine`` (``ds_kfac.initialize(mpu=parallel_state)`` instead of the
standalone preconditioner), ``save`` (``{"dir", "at"}``), ``load`` (a checkpoint dir to resume from). Records the
full weights (shards gathered), every step's ``nu`` and the tensor-parallel bytes sent.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

IN, HIDDEN, OUT, CLASSES, BATCH, STEPS, LR = 8, 6, 4, 3, 8, 5, 0.1
DTYPES = {"float64": torch.float64, "float32": torch.float32}
"""A scenario's ``dtype``: of the model, its data and K-FAC's factors and decompositions (the weights and data drawn
in float32, then cast). float64 by default: in float32 the shards' matmuls round otherwise than the whole layer's, by
amounts that depend on the CPU's kernels and that 5 steps of eigendecompositions amplify to over 1e-6. The DeepSpeed
engine reduces no float64 gradients: its scenarios run in float32."""
KFAC = {
    "damping": 0.01,
    "kl_clip": 0.01,
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "factor_decay": 0.9,
    "basis_update": "eigh",
}


def full_weights(bias: bool) -> dict[str, torch.Tensor]:
    """The unsharded model's parameters (``col``, ``row``, ``head``; ``.weight`` / ``.bias``)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (o, i) in {"col": (HIDDEN, IN), "row": (OUT, HIDDEN), "head": (CLASSES, OUT)}.items():
        out[f"{name}.weight"] = torch.randn(o, i, generator=g) / i**0.5
        if bias or name == "head":
            out[f"{name}.bias"] = torch.randn(o, generator=g) * 0.1
    return out


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g).to(dtype), torch.randn(BATCH, CLASSES, generator=g).to(dtype)


def loss_fn(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


class Reference(nn.Module):
    """The unsharded model in plain ``nn.Linear`` layers; with ``tp`` > 1 each shard is a layer of its own (what
    ``shard`` preconditions), the row layer's bias a parameter outside them (which ``shard`` leaves to the base
    optimizer)."""

    def __init__(self, bias: bool, tp: int, dtype: torch.dtype) -> None:
        super().__init__()
        w = full_weights(bias)
        self.col = nn.ModuleList(nn.Linear(IN, HIDDEN // tp, bias=bias) for _ in range(tp))
        self.row = nn.ModuleList(nn.Linear(HIDDEN // tp, OUT, bias=bias and tp == 1) for _ in range(tp))
        self.row_bias = nn.Parameter(w["row.bias"].clone()) if bias and tp > 1 else None
        self.head = nn.Linear(OUT, CLASSES)
        with torch.no_grad():
            for r in range(tp):
                self.col[r].weight.copy_(w["col.weight"].chunk(tp, 0)[r])
                if bias:
                    self.col[r].bias.copy_(w["col.bias"].chunk(tp, 0)[r])
                self.row[r].weight.copy_(w["row.weight"].chunk(tp, 1)[r])
            if bias and tp == 1:
                self.row[0].bias.copy_(w["row.bias"])
            self.head.weight.copy_(w["head.weight"])
            self.head.bias.copy_(w["head.bias"])
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = [torch.tanh(c(x)) for c in self.col]
        y = sum(r(part) for r, part in zip(self.row, h))
        if self.row_bias is not None:
            y = y + self.row_bias
        return self.head(torch.tanh(y))

    def full(self) -> dict[str, torch.Tensor]:
        out = {
            "col.weight": torch.cat([c.weight for c in self.col], 0),
            "row.weight": torch.cat([r.weight for r in self.row], 1),
            "head.weight": self.head.weight,
            "head.bias": self.head.bias,
        }
        if self.col[0].bias is not None:
            out["col.bias"] = torch.cat([c.bias for c in self.col], 0)
            out["row.bias"] = self.row_bias if self.row_bias is not None else self.row[0].bias
        return {k: v.detach().clone() for k, v in out.items()}


class TPModel(nn.Module):
    def __init__(self, bias: bool, skip_bias_add: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig, parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        tp = parallel_state.get_tensor_model_parallel_world_size()
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        init = nn.init.normal_
        self.col = ColumnParallelLinear(IN, HIDDEN, config=cfg, init_method=init, bias=bias, gather_output=False)
        self.row = RowParallelLinear(
            HIDDEN, OUT, config=cfg, init_method=init, bias=bias, input_is_parallel=True, skip_bias_add=skip_bias_add
        )
        self.head = nn.Linear(OUT, CLASSES)
        r, w = parallel_state.get_tensor_model_parallel_rank(), full_weights(bias)
        with torch.no_grad():
            self.col.weight.copy_(w["col.weight"].chunk(tp, 0)[r])
            self.row.weight.copy_(w["row.weight"].chunk(tp, 1)[r])
            if bias:
                self.col.bias.copy_(w["col.bias"].chunk(tp, 0)[r])
                self.row.bias.copy_(w["row.bias"])
            self.head.weight.copy_(w["head.weight"])
            self.head.bias.copy_(w["head.bias"])
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.col(x)
        y, b = self.row(torch.tanh(h))
        if b is not None:
            y = y + b
        return self.head(torch.tanh(y))

    def full(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters (shards all-gathered over the tensor-parallel group)."""
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        out = {}
        for name, p in self.named_parameters():
            value = p.detach().clone()
            dim = {"col.weight": 0, "col.bias": 0, "row.weight": 1}.get(name)
            if dim is not None:
                parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, value.contiguous(), group=group)
                value = torch.cat(parts, dim)
            out[name] = value
        return out


def refusals(scenario: dict[str, Any]) -> dict[str, str]:
    """The error of each unsupported setup: layer variants, ZeRO 1, and a checkpoint of another tensor-parallel
    size (``scenario["resharded"]``: ``from``, a checkpoint saved here, copied to ``to`` with its K-FAC files
    named as at size 4)."""
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    import ds_kfac

    cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    seq = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True, sequence_parallel=True)
    init = nn.init.normal_
    layers = {
        "gather_output": lambda: ColumnParallelLinear(IN, HIDDEN, config=cfg, init_method=init, gather_output=True),
        "input_is_parallel": lambda: RowParallelLinear(
            HIDDEN, OUT, config=cfg, init_method=init, bias=True, input_is_parallel=False, skip_bias_add=False
        ),
        "sequence_parallel": lambda: ColumnParallelLinear(IN, HIDDEN, config=seq, init_method=init),
    }
    out = {}
    for name, make in layers.items():
        try:
            ds_kfac.KFACPreconditioner(make(), lr=LR, process_group=parallel_state.get_data_parallel_group())
        except ValueError as err:
            out[name] = str(err)
    config = {"train_batch_size": BATCH, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "kfac": KFAC}
    try:
        ds_kfac.initialize(
            model=TPModel(True, False), config={**config, "zero_optimization": {"stage": 1}}, mpu=parallel_state
        )
    except ds_kfac.KFACConfigError as err:
        out["zero1"] = str(err)
    engine, *_ = ds_kfac.initialize(
        model=TPModel(True, False), config={**config, "gradient_clipping": 0.0}, mpu=parallel_state
    )
    paths = scenario["resharded"]
    if dist.get_rank() == 0:
        shutil.copytree(paths["from"], paths["to"])
        for f in Path(paths["to"], "ckpt").glob("kfac_state_tp*of2.pt"):
            f.rename(f.with_name(f.name.replace("of2", "of4")))
    dist.barrier()
    try:
        engine.load_checkpoint(paths["to"], tag="ckpt")
    except ValueError as err:
        out["resharded"] = str(err)
    return out


def train(scenario: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state

    import ds_kfac
    from ds_kfac.comm import STATS

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    if "resharded" in scenario:
        return refusals(scenario)
    dp_group = parallel_state.get_data_parallel_group()
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    torch.manual_seed(0)
    dtype = scenario.get("dtype", "float64")
    model = TPModel(scenario.get("bias", True), scenario.get("skip_bias_add", False), DTYPES[dtype])
    kfac_keys = {**KFAC, "tensor_parallel_factors": scenario.get("mode", "exact"), **scenario.get("kfac", {})}
    kfac_keys.update(factor_dtype=dtype, inv_dtype=dtype)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    nus, before = [], dict(STATS)
    if scenario.get("engine"):
        config = {
            "train_batch_size": BATCH,
            "train_micro_batch_size_per_gpu": BATCH // dp,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0,
            "kfac": kfac_keys,
        }
        engine, *_ = ds_kfac.initialize(model=model, config=config, mpu=parallel_state)
        if "load" in scenario:
            engine.load_checkpoint(scenario["load"], tag="ckpt")
        for step in range(engine.global_steps, STEPS):
            x, y = batch(step, DTYPES[dtype])
            engine.backward(loss_fn(engine(x[rows]), y[rows]))
            engine.step()
            nus.append(engine.kfac.last_nu.item())
            if scenario.get("save") and step + 1 == scenario["save"]["at"]:
                engine.save_checkpoint(scenario["save"]["dir"], tag="ckpt")
        kfac = engine.kfac
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        kfac = ds_kfac.KFACPreconditioner(model, kfac_keys, optimizer=optimizer, process_group=dp_group)
        for step in range(STEPS):
            x, y = batch(step, DTYPES[dtype])
            optimizer.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            for p in model.parameters():  # data-parallel gradient averaging (what DDP does)
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp)
            kfac.step()
            optimizer.step()
            nus.append(kfac.last_nu.item())
    return {
        "params": model.full(),
        "nus": nus,
        "bytes": {k: STATS[k] - before.get(k, 0) for k in ("tp_gather", "tp_scatter")},
        "blocks": [b.name for b in kfac.blocks],
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }


if __name__ == "__main__":
    import ds_worker

    ds_worker.main(train)
