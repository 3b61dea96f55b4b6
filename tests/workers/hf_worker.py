"""Hugging Face worker: ``ds_kfac.hf.KFACTrainer`` and the same training through ``ds_kfac.initialize``.

Runs the scenarios of a JSON spec under the deepspeed launcher, each saving per-rank results to
``<out>/<index>_rank<r>.pt``. Scenario keys: ``run`` (``"trainer"``: KFACTrainer for ``steps`` optimizer steps,
saving a Trainer checkpoint every ``save_steps``; ``"direct"``: the engine of ``ds_kfac.initialize`` driven by
hand on the same data), ``resume`` (a step: the Trainer resumes from that checkpoint of the plain ``"trainer"``
run), ``stage`` (ZeRO), ``bf16`` (Trainer's ``bf16=True`` with ``"bf16": {"enabled": "auto"}``; bf16 inputs for
``"direct"``), ``fisher``, ``eigenbasis`` (a JSON AdamW with ``"eigenbasis_moments": true``), ``dir`` (where the
Trainer runs write, each in a directory of its own).

The Trainer runs read the DeepSpeed config with ``"auto"`` values; the direct run gets them written out
(:func:`direct_config`). Trainer's data order is sequential (``train_sampling_strategy="sequential"``), and
accelerate deals the micro-batches round-robin: rank ``r``'s micro-batch ``m`` of step ``s`` is the dataset's
batch ``(s * GA + m) * world + r`` of ``MICRO`` rows (:func:`rows`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import ds_worker  # noqa: E402
import problem  # noqa: E402

import ds_kfac  # noqa: E402

MICRO, GA, LR, CLIP = 2, 2, 0.05, 1.0
KFAC = {"factor_update_steps": 1, "inv_update_steps": 2, "damping": 0.01, "kl_clip": 0.01, "basis_update": "eigh"}
ADAMW = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # TrainingArguments' defaults, which Trainer checks


def sections(fisher: str, eigenbasis: bool, lr: object) -> dict:
    """The config's ``"optimizer"`` and ``"kfac"`` sections: SGD and K-FAC, or AdamW with the eigenbasis moments."""
    if eigenbasis:
        kfac = {key: v for key, v in KFAC.items() if key != "kl_clip"}
        return {
            "optimizer": {"type": "AdamW", "params": {"lr": lr, **ADAMW}},
            "kfac": {**kfac, "fisher": fisher, "eigenbasis_moments": True},
        }
    return {"optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}, "kfac": {**KFAC, "fisher": fisher}}


class Regression(nn.Module):
    """:func:`problem.make_model` with Trainer's calling convention: ``model(x=..., labels=...)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = problem.make_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": problem.loss_fn(out, labels), "logits": out}


def dataset(steps: int, world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    n = steps * GA * world * MICRO
    x, y = torch.randn(n, problem.IN, generator=g), torch.randn(n, problem.OUT, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def rows(step: int, micro_step: int, world: int, rank: int) -> slice:
    batch = (step * GA + micro_step) * world + rank
    return slice(batch * MICRO, (batch + 1) * MICRO)


def trainer_config(stage: int, fisher: str = "empirical", eigenbasis: bool = False) -> dict:
    return {
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        **sections(fisher, eigenbasis, "auto"),
    }


def direct_config(stage: int, world: int, bf16: bool, fisher: str, eigenbasis: bool) -> dict:
    """:func:`trainer_config` with the values Trainer puts in place of ``"auto"``."""
    return {
        **trainer_config(stage, fisher, eigenbasis),
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GA,
        "train_batch_size": MICRO * GA * world,
        "gradient_clipping": CLIP,
        **sections(fisher, eigenbasis, LR),
    }


def run_trainer(scenario: dict, world: int) -> dict:
    from transformers import TrainingArguments

    from ds_kfac.hf import KFACTrainer

    resume, bf16, fisher = scenario.get("resume"), scenario.get("bf16", False), scenario.get("fisher", "empirical")
    eigenbasis = scenario.get("eigenbasis", False)
    name = "resumed" if resume else "bf16" if bf16 else "eigenbasis" if eigenbasis else "trainer"
    name = name if fisher == "empirical" else "sampled"
    out_dir = Path(scenario["dir"]) / name
    if bf16:
        # transformers refuses bf16 on a CPU-only machine unless use_cpu=True, which turns DeepSpeed off in
        # accelerate: let it believe the device has bf16 (DeepSpeed's CPU engine has).
        monkeypatch_bf16_check()
    args = TrainingArguments(
        output_dir=str(out_dir),
        deepspeed=trainer_config(scenario["stage"], fisher, eigenbasis),
        max_steps=scenario["steps"],
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GA,
        learning_rate=LR,
        max_grad_norm=CLIP,
        bf16=bf16,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        save_strategy="steps",
        save_steps=scenario["save_steps"],
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = KFACTrainer(
        model=Regression(), args=args, train_dataset=dataset(scenario["steps"], world), fisher_loss="mse"
    )
    checkpoint = str(Path(scenario["dir"]) / "trainer" / f"checkpoint-{resume}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    engine = trainer.model_wrapped
    return {
        "params": [p.detach().float().cpu().clone() for p in trainer.model.parameters()],
        "global_step": trainer.state.global_step,
        "kfac_steps": trainer.kfac.steps,
        "engine": type(engine).__name__,
        "optimizer": type(engine.basic_optimizer).__name__,
        "filled": {
            "train_batch_size": engine.train_batch_size(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "gradient_clipping": engine.gradient_clipping(),
            "lr": engine.get_lr()[0],
            "kfac_in_deepspeed_config": "kfac" in engine._config._param_dict,
            "bf16": engine.bfloat16_enabled(),
            "dtype": str(next(engine.module.parameters()).dtype),
        },
        "logs": [
            {k: v for k, v in log.items() if k == "step" or k.startswith("kfac/")}
            for log in trainer.state.log_history
            if "loss" in log
        ],
        "kfac_files": sorted(str(p.relative_to(out_dir)) for p in out_dir.glob("checkpoint-*/global_step*/kfac_*")),
    }


def monkeypatch_bf16_check() -> None:
    import transformers.training_args

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True


def run_direct(scenario: dict, world: int) -> dict:
    rank, bf16, fisher = dist.get_rank(), scenario.get("bf16", False), scenario.get("fisher", "empirical")
    model = Regression()
    config = direct_config(scenario["stage"], world, bf16, fisher, scenario.get("eigenbasis", False))
    engine, *_ = ds_kfac.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = torch.bfloat16 if bf16 else torch.float32  # Trainer casts float inputs to DeepSpeed's dtype
    data = dataset(scenario["steps"], world)
    for step in range(scenario["steps"]):
        for m in range(GA):
            batch = data[rows(step, m, world, rank)]
            x = torch.stack([d["x"] for d in batch]).to(dtype)
            y = torch.stack([d["labels"] for d in batch]).to(dtype)
            out = engine(x, y)
            engine.kfac.sample_fisher(out["logits"], "mse")  # nothing unless fisher is "sampled"
            engine.backward(out["loss"])
            engine.step()
    return {
        "params": [p.detach().float().cpu().clone() for p in model.parameters()],
        "global_step": engine.global_steps,
        "kfac_steps": engine.kfac.steps,
    }


def run(scenario: dict) -> dict:
    """The scenario's ``run`` at this job's world size."""
    return (run_direct if scenario["run"] == "direct" else run_trainer)(scenario, dist.get_world_size())


if __name__ == "__main__":
    ds_worker.main(run)
