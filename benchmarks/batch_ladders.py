"""The ladders of ``batch_scaling.py``: each task's arms (an optimizer's config and the keys its learning rate is set
at), its global batches, budgets and target, and how a config takes a batch, a rate and a budget.

An arm named ``ARM+LABEL`` (``kfac+fresh``) is a variant of the ladder's ``ARM``: its config and rate keys, with
its own overrides (``--set-arm kfac+fresh:kfac.factor_decay=0.8``) and grid; its runs are keyed by that name, so
variants of one optimizer share a result file and ``merge`` with each other and with the plain arm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from time_to_target import TASKS, Task, apply_overrides

WORLD = 2
KFAC = "kfac"
"""The arm whose ratios the table reports; every ladder has it."""


@dataclass(frozen=True)
class Arm:
    """One optimizer of a ladder: its config file and the keys its learning rate is set at."""

    config: str
    lr_keys: tuple[str, ...]


@dataclass(frozen=True)
class Ladder:
    """How a task's configs take a batch, a learning rate and a step budget."""

    task: Task
    arms: dict[str, Arm]  # the first is the reference the ratios divide by
    steps_keys: tuple[str, ...]
    warmup_key: Optional[str]  # a step count set to ``warmup`` of the budget (``None``: the example's own proportion)
    max_micro: int  # the largest per-rank micro-batch: beyond it the batch grows by accumulation
    samples: int
    target: float
    batches: tuple[int, ...]
    lrs: tuple[float, ...]
    smoke_args: tuple[str, ...]
    budgets: Optional[dict[int, int]] = None
    """Steps per global batch, where they replace ``samples / batch`` (a batch not listed: ``samples / batch``)."""
    targets: Optional[dict[str, float]] = None
    """The target per ``--size`` (a ladder of phase 2 at the sizes of ``benchmarks/ladder.py``)."""

    @property
    def reference(self) -> str:
        return next(iter(self.arms))


def _pair(task: Task, lr_keys: tuple[str, ...]) -> dict[str, Arm]:
    """The base optimizer and the same with K-FAC, their rates at the same keys."""
    return {"base": Arm(task.base_config, lr_keys), KFAC: Arm(task.kfac_config, lr_keys)}


RESNET_RATE = ("optimizer.params.lr", "scheduler.params.warmup_max_lr")
LADDERS = {
    "resnet": Ladder(
        TASKS["resnet"],
        _pair(TASKS["resnet"], RESNET_RATE),
        ("resnet.steps", "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_num_steps",
        128,
        122_880,
        0.95,
        (256, 1024, 4096),
        (0.2, 0.4, 0.8),
        ("--train-size", "2048", "--held-out-size", "256"),
    ),
    "resnet-peers": Ladder(
        TASKS["resnet"],
        {
            "sgd": Arm(TASKS["resnet"].base_config, RESNET_RATE),
            "soap": Arm(
                "configs/resnet_soap_cpu.json", ("client_optimizer.params.lr", "scheduler.params.warmup_max_lr")
            ),
            KFAC: Arm(TASKS["resnet"].kfac_config, RESNET_RATE),
        },
        ("resnet.steps", "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_num_steps",
        128,
        122_880,
        0.95,
        (1024, 4096),
        (0.2, 0.4, 0.8),
        ("--train-size", "2048", "--held-out-size", "256"),
        budgets={1024: 120, 4096: 60},  # the demo's 120 steps; at 4,096 its 30 (the samples) reached nothing
    ),
    "bert": Ladder(
        TASKS["bert-phase1"],
        _pair(TASKS["bert-phase1"], ("optimizer.params.lr",)),
        ("bert.max_steps",),
        None,
        32,
        64_000,
        5.75,
        (64, 256, 1024),
        (0.01, 0.02, 0.04),
        ("--eval-batches", "1"),
    ),
    "bert-phase2": Ladder(
        TASKS["bert"],
        {
            "adamw": Arm("configs/bert_cpu_phase2_base.json", ("optimizer.params.lr",)),
            "soap": Arm("configs/bert_cpu_phase2_soap.json", ("client_optimizer.params.lr",)),
            "muon": Arm("configs/bert_cpu_phase2_muon.json", ("optimizer.params.muon_lr",)),
            KFAC: Arm("configs/bert_cpu_phase2_kfac.json", ("optimizer.params.adam_lr",)),
        },
        ("bert.max_steps",),
        None,
        32,
        38_400,  # the demo's 150 steps of 256
        4.3,
        (256, 1024, 2048),
        (0.004, 0.008, 0.016),
        ("--eval-batches", "1"),
        budgets={256: 150, 1024: 75, 2048: 50, 4096: 40},
        targets={"2x128": 4.3, "2x256": 3.15, "4x256": 3.27},  # above tuned AdamW's final at 256 (ladder.json)
    ),
}
WARMUP = 0.08
"""Warm-up steps as a fraction of the budget (for a ladder with ``warmup_key``)."""


def shape(batch: int, max_micro: int) -> tuple[int, int]:
    """``(micro, accumulation)`` giving a global batch of ``batch`` on ``WORLD`` ranks."""
    per_rank = batch // WORLD
    if batch % WORLD:
        raise ValueError(f"batch {batch} is not a multiple of the {WORLD} ranks")
    micro = min(per_rank, max_micro)
    if per_rank % micro:
        raise ValueError(f"batch {batch}: {per_rank} per rank is not a multiple of the micro-batch {micro}")
    return micro, per_rank // micro


def budget(
    ladder: Ladder, batch: int, samples: int, steps: Optional[int], budgets: Optional[dict[int, int]] = None
) -> int:
    """A run's steps at ``batch``: ``steps`` when given, else its entry in ``budgets`` (``--budget``), else the
    ladder's budget for the batch, else ``samples / batch``."""
    if steps:
        return steps
    for given in (budgets, ladder.budgets):
        if given and batch in given:
            return given[batch]
    return max(1, samples // batch)


def parse_budgets(specs: Sequence[str]) -> dict[int, int]:
    """``--budget BATCH=STEPS`` values as a dict; a malformed one is refused, named."""
    out = {}
    for spec in specs:
        batch, _, steps = spec.partition("=")
        if not (batch.isdigit() and steps.isdigit() and int(batch) > 0 and int(steps) > 0):
            raise SystemExit(f"--budget {spec!r}: expected BATCH=STEPS, both positive integers")
        out[int(batch)] = int(steps)
    return out


def configure(base: dict[str, Any], ladder: Ladder, arm: str, batch: int, lr: float, steps: int) -> dict[str, Any]:
    """``base``, the config of ``arm``, at global ``batch`` with learning rate ``lr`` and a budget of ``steps``."""
    micro, accumulation = shape(batch, ladder.max_micro)
    sets = [f"train_micro_batch_size_per_gpu={micro}", f"gradient_accumulation_steps={accumulation}"]
    sets += [f"{key}={lr}" for key in arm_spec(ladder, arm).lr_keys] + [f"{key}={steps}" for key in ladder.steps_keys]
    if ladder.warmup_key:
        sets.append(f"{ladder.warmup_key}={max(1, round(WARMUP * steps))}")
    config = apply_overrides(base, sets)
    config.pop("train_batch_size", None)
    return config


VARIANT = "+"
"""Separates a variant's label from the ladder arm it varies (``kfac+fresh``)."""


def base_arm(name: str) -> str:
    """The ladder arm an arm name varies (the name itself for a plain arm)."""
    return name.partition(VARIANT)[0]


def arm_spec(ladder: Ladder, name: str) -> Arm:
    """The config and rate keys of arm ``name`` (a variant takes its ladder arm's); an unknown arm is refused, named."""
    arm, sep, label = name.partition(VARIANT)
    if arm not in ladder.arms or (sep and not label.replace("-", "").replace("_", "").isalnum()):
        expected = f"ARM or ARM{VARIANT}LABEL (LABEL: letters, digits, - and _) with ARM one of {list(ladder.arms)}"
        raise ValueError(f"arm {name!r}: expected {expected}")
    return ladder.arms[arm]


def ordered(ladder: Ladder, names: Sequence[str]) -> list[str]:
    """``names`` (arms and variants, checked) in the ladder's order, each variant after its arm in first-given order:
    the reference first, as the ratios divide by it."""
    unique = list(dict.fromkeys(names))
    for name in unique:
        arm_spec(ladder, name)
    rank = list(ladder.arms)
    return sorted(unique, key=lambda name: (rank.index(base_arm(name)), name != base_arm(name), unique.index(name)))
