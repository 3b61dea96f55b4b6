"""Where every millisecond of a K-FAC step goes: per-phase cost of base vs base+K-FAC, and the arithmetic floor.

Runs the standalone :class:`ds_kfac.KFACPreconditioner` on real models (the BERT
example's ``BertForPreTraining`` at BERT-mini size and at the CPU demo's size, and the ResNet example's
CIFAR ResNet-20 and the demo's ResNet-8) on 1 or 2 CPU processes (gloo, one thread each)::

    python benchmarks/step_cost.py run                                   # everything: 4 workloads x 3 GA x
                                                                         # (world 1, world 2 comm-opt/mem-opt)
    python benchmarks/step_cost.py run --workloads bert-demo --worlds 2 --placements comm-opt --ga 4 \
        --set factor_update_steps=1 --set inv_update_steps=10           # the BERT demo's phase 2 (its config's
                                                                         # "kfac" section and base optimizer)
    python benchmarks/step_cost.py run --base-optimizer configs/bert_cpu_phase1_lamb.json ...  # LAMB, both arms
    python benchmarks/step_cost.py run --workloads resnet20 --worlds 2 --ga 4 --cycles 5
    python benchmarks/step_cost.py run --set inv_update_steps=20 --set damping=0.01   # K-FAC key overrides
    python benchmarks/step_cost.py run --set fisher='"sampled"'          # the sampled Fisher's extra backward
    python benchmarks/step_cost.py run --smoke --out /tmp/smoke.json     # BERT-tiny, ResNet-8 at 16x16 (CI)
    python benchmarks/step_cost.py run --device cuda --workloads bert-base --worlds 1 --ga 8  # BERT-base shapes
                                                                         # on a GPU (benchmarks/gpu/run.py)
    python benchmarks/step_cost.py run --workloads bert-base-l2 bert-large-l2 --worlds 2 --ga 8 32 --cycles 1 \
        --warmup-steps 1 --set factor_update_steps=2 --set inv_update_steps=4   # BERT-base and BERT-large layer
                                                                         # shapes (2 layers), micro-batch 1 x 128
    python benchmarks/step_cost.py table benchmarks/results/step_cost.json

Method. Every configuration (workload, world, placement, gradient accumulation
GA) runs in fresh processes. Both arms live in each process with identical
initial weights (two models from one state dict, each with its own base
optimizer) and are fed the same batches. Data-parallel averaging is done here,
not by DDP: after the last micro-batch's backward, one ``all_reduce`` of all
gradients flattened into one buffer, divided by the world size, so that
gradient communication is a phase of its own; the K-FAC arm then calls
``kfac.step()`` (which gets its own process group, so factor and gradient
collectives do not queue behind each other), then ``optimizer.step()``. The
arms alternate in chunks of one decomposition cycle (``inv_update_steps``
optimizer steps: every phase of the schedule once): a warm-up per arm, not
counted (one cycle, or ``--warmup-steps``), then ``--cycles`` x (base cycle,
K-FAC cycle). Timings are rank 0's
``time.perf_counter`` (on CUDA, after synchronising the step's stream at every
phase boundary: the device time of the step's own work, while ``async_decompositions``' side stream
runs on).

Phases of one optimizer step:

* ``forward_backward``: zero_grad and all micro-batches' forward and backward,
  minus K-FAC's ``hooks`` and ``sampled_backward`` (reported separately);
* ``grad_comm``: the gradient all-reduce (0 on one process);
* K-FAC's own phases, read from ``kfac.timings`` (whatever keys it has:
  ``hooks``, ``sampled_backward``, ``factor_comm``, ``factors``, ``decompose``,
  ``precondition``). Every micro-batch of the K-FAC arm calls
  ``kfac.sample_fisher`` on its logits (the BERT workload: the masked-LM
  logits, its ``-100`` labels left out), which does nothing unless
  ``--set fisher='"sampled"'``; then, on the micro-batches that gather factors,
  the sampled Fisher's extra backward (the sampling and the pass) is its own
  phase, ``sampled_backward``, timed by K-FAC less the hooks that run inside it
  (those stay in ``hooks``); the floor below does not count that pass;
* ``base_optimizer``: ``optimizer.step()``.

The step itself is timed end to end; ``coverage = sum(phases) / step``: the
time K-FAC's ``step()`` spends outside its named phases is the gap
(``untimed_ms``). Steps are classed by their index ``s`` in the K-FAC schedule:
``decomposition`` (``s % inv_update_steps == 0``), ``factor``
(``s % factor_update_steps == 0``), ``plain``; the base arm's steps get the
class of the same index, for comparison.

The floor: FLOPs counted from the Linear/Conv2d shapes seen in one forward
pass, per rank and optimizer step:

* base: forward + backward = 3 x 2 x multiply-adds of every Linear/Conv2d
  (K-FAC's skipped layers included; attention's batched matmuls, norms and
  activations not counted);
* ``factors``: 2 n a^2 + 2 n g^2 per registered layer and micro-batch (``n`` rows:
  tokens for Linear, B x H_out x W_out for Conv2d, B with ``conv_factors``
  "reduce"; ``a`` includes the bias column), divided by ``factor_update_steps``;
  measured as ``hooks + factors``;
* ``precondition`` (eigen): 4 g a (g + a) per layer (two GEMMs on each side), x
  gradient workers / world (``comm-opt``: every rank preconditions every layer;
  ``mem-opt``: one rank per layer);
* ``decompose``: 9 d^3 per factor (symmetric eigendecomposition with vectors),
  divided by ``inv_update_steps`` and by world (perfect balance).

``floor ratio = 1 + K-FAC FLOPs / base FLOPs`` (the step-time ratio if K-FAC's
FLOPs ran at the base step's FLOP rate); ``overhead_vs_floor = (ratio - 1) /
(floor ratio - 1)``. Per phase, ``floor_ms = phase FLOPs / base FLOPs x base
mean step``.

Memory: ``kfac.memory_usage()`` on every rank, after the measured steps and
during one more factor step (after its last backward, before ``kfac.step()``:
the step's statistics held; the table's "K-FAC state" is the largest rank's
total then), and each rank's peak RSS
(``ru_maxrss``) in its fresh process after the base arm's warm-up cycle, before
the K-FAC arm exists, and again after the K-FAC arm's warm-up. The difference
includes the K-FAC arm's model copy and optimizer state, not only K-FAC's.

Output (``--out FILE.json``, a PNG beside it, and the Markdown table on stdout)::

    {"benchmark": "step_cost", "command", "settings": {workloads, worlds, placements, ga, cycles, set,
     smoke, device, seed, timeout}, "versions": {python, torch, deepspeed, ds_kfac, ds_kfac_commit, cpus},
     "load_average": {"before", "after"} (1, 5, 15 min), "floor_constants": {...},
     "configurations": [{
       "workload", "world", "placement", "ga", "load_before", "kfac_config": {the "kfac" keys used},
       "layers": {"registered": [names], "skipped": [names]},
       "arms": {"base" | "kfac": {
          "mean_ms" (amortized over whole cycles), "median_ms", "slowest_ms", "coverage",
          "phases_ms": {phase: amortized mean}, "untimed_ms" (kfac only),
          "classes": {"plain" | "factor" | "decomposition": {"count", "mean_ms", "phases_ms", "coverage"}},
          "step_ms": [[every measured step of cycle 1], ...] (step i of a cycle has schedule index i)}},
       "ratio": {"mean" (the headline: kfac mean_ms / base mean_ms), "median", "min", "max",
                 "per_cycle": [kfac / base mean step of each measured cycle],
                 "recipe_cadence": {the workload config's own factor_update_steps, inv_update_steps},
                 "at_recipe_cadence": K-FAC's per-class means amortized at that cadence / base mean},
       "floor": {"flops_per_step": {"forward_backward", "factors", "precondition", "decompose"}, "ratio",
                 "overhead_vs_floor", "phases": {"factors" | "precondition" | "decompose":
                 {"floor_ms", "measured_ms", "measured_phases", "times_floor"}}},
       "refreshes": [per rank: {"full", "subspace", "kept"}: the sides it decomposed in full, by a subspace step
                     or kept (basis_keep_drift), warm-up and untimed steps included; "drift_mean", "drift_max" of
                     its drift tests where some ran],
       "timed_refreshes": [per rank: {"full", "subspace", "kept"} in the measured cycles only],
       "memory": {"kfac_state_bytes": [per rank: {category: bytes}] (after the last step),
                  "kfac_state_bytes_in_step": [per rank] (during a factor step, statistics held), "model_param_bytes",
                  "peak_rss_bytes": {"base_only": [per rank], "with_kfac": [per rank]}}}]}
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import launch  # noqa: E402  (tests/launch.py: timed, session-isolated subprocess launches)
from time_to_target import apply_overrides, free_port, portable, versions  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac import KFACConfig, KFACPreconditioner, Lamb, build_optimizer  # noqa: E402
from ds_kfac.comm import network  # noqa: E402
from ds_kfac.config.schema import DTYPES  # noqa: E402
from ds_kfac.curvature import REFRESH_KINDS  # noqa: E402
from ds_kfac.optimizers import resolve_lamb, split_groups  # noqa: E402
from ds_kfac.placement.plan import workers_per_layer  # noqa: E402
from ds_kfac.planning import plan_job, read_job  # noqa: E402
from ds_kfac.planning.calibrate import Timed, calibrate  # noqa: E402
from ds_kfac.planning.predict import REPORTED_PHASES, Calibration, PlacementTime, predict_plan, reported  # noqa: E402
from ds_kfac.preconditioning.build import preconditioned_parameters  # noqa: E402
from ds_kfac.timing import PHASES as KFAC_PHASES  # noqa: E402

Batch = dict[str, torch.Tensor]
Record = dict[str, Any]
"""One optimizer step: ``cycle``, ``class``, ``step`` (s), ``phases`` ({name: s}), ``untimed`` (s, K-FAC arm)."""

CADENCE = {"factor_update_steps": 10, "inv_update_steps": 100}  # KAISA's
SMOKE_CADENCE = {"factor_update_steps": 2, "inv_update_steps": 4}
CLASSES = ("plain", "factor", "decomposition")
ARMS = ("base", "kfac")
EIGH_FLOPS_PER_DIM3 = 9
"""FLOPs per d^3 of a symmetric eigendecomposition with eigenvectors: Golub & Van Loan's count for the
symmetric QR algorithm (about 9 d^3 with eigenvectors, 4/3 d^3 for the eigenvalues alone)."""
FLOOR_PHASES = {
    "factors": ("hooks", "factors"),
    "precondition": ("precondition",),
    "decompose": ("decompose", "rebase", "stack"),
}
"""Floor phase -> the measured phases doing its arithmetic (factor outer products run in the hooks)."""
POOL = 16  # distinct micro-batches per rank, reused in turn


# ---------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Outputs:
    """A micro-batch's training loss, and the logits the sampled Fisher draws targets from (``labels``: the
    positions the loss leaves out are ``-100``; ``None``: none)."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Workload:
    """A model, its base optimizer, its batches and forward pass, and the config whose ``"kfac"`` section it uses."""

    kfac_config: str
    build: Callable[[bool], nn.Module]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    batch: Callable[[bool, torch.Generator], Batch]
    forward: Callable[[nn.Module, Batch], Outputs]


BERT_MINI = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
BERT_DATA = {"seq": 64, "micro": 8, "vocab": 8192}  # the BERT example's default vocabulary
BERT_DEMO_DATA = {"seq": 64, "micro": 32, "vocab": 1024}  # the CPU demo's (configs/bert_cpu_phase2_*.json)
BERT_SMOKE_DATA = {"seq": 32, "micro": 8, "vocab": 512}
BERT_BASE = json.loads((ROOT / "configs/bert/bert-base.json").read_text())  # 12 x 768
BERT_BASE_DATA = {"seq": 128, "micro": 16, "vocab": 30522}  # BERT's WordPiece vocabulary, phase 1's sequence
BERT_LARGE = json.loads((ROOT / "configs/bert/bert-large.json").read_text())  # 24 x 1024
BERT_SHAPES_CPU_DATA = {"seq": 128, "micro": 1, "vocab": 30522}  # users' shapes at the smallest micro-batch


def with_depth(config: dict[str, Any], depth: int) -> dict[str, Any]:
    """``config`` with ``depth`` of its encoder layers: every layer has the same shapes, so the per-layer costs of
    the full model are measured on a few (the CPU cannot run BERT-large's 24 in a working session)."""
    return {**config, "num_hidden_layers": depth}


def build_bert(size: Optional[dict[str, int]], data: dict[str, int]) -> Callable[[bool], nn.Module]:
    """``BertForPreTraining`` as ``examples/bert/pretrain.py`` builds it (``configs/bert/bert-tiny.json``'s
    activation, dropout and initialisation), resized by ``size`` (``None``: bert-tiny's own, hidden 128, 2
    layers, the CPU demo's model), for ``data``'s vocabulary and sequence length (bert-tiny in smoke mode)."""

    def build(smoke: bool) -> nn.Module:
        from transformers import BertConfig, BertForPreTraining

        shapes = BERT_SMOKE_DATA if smoke else data
        config = json.loads((ROOT / "configs/bert/bert-tiny.json").read_text())
        if size is not None and not smoke:
            config.update(size)
        config.update(
            vocab_size=shapes["vocab"],
            max_position_embeddings=max(config.get("max_position_embeddings", 512), shapes["seq"]),
        )
        return BertForPreTraining(BertConfig(**config))

    return build


def bert_batch(data: dict[str, int]) -> Callable[[bool, torch.Generator], Batch]:
    """Random tokens of ``data``'s shapes, two segments, 15% of positions as masked-LM targets, random
    next-sentence labels."""

    def batch(smoke: bool, generator: torch.Generator) -> Batch:
        return _bert_batch(BERT_SMOKE_DATA if smoke else data, generator)

    return batch


def _bert_batch(d: dict[str, int], generator: torch.Generator) -> Batch:
    shape = (d["micro"], d["seq"])
    ids = torch.randint(0, d["vocab"], shape, generator=generator)
    masked = torch.rand(shape, generator=generator) < 0.15
    return {
        "input_ids": ids,
        "token_type_ids": (torch.arange(d["seq"]) >= d["seq"] // 2).long().expand(shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "labels": torch.where(masked, ids, torch.full_like(ids, -100)),
        "next_sentence_label": torch.randint(0, 2, (d["micro"],), generator=generator),
    }


def bert_outputs(model: nn.Module, batch: Batch) -> Outputs:
    """Pre-training loss (masked LM and next sentence); the sampled Fisher draws from the masked-LM logits."""
    out = model(**batch)
    return Outputs(out.loss, out.prediction_logits, batch["labels"])


def build_resnet(depth: int) -> Callable[[bool], nn.Module]:
    """``examples/resnet/train.py``'s ``ResNet`` of this depth (ResNet-8 in smoke mode)."""

    def build(smoke: bool) -> nn.Module:
        sys.path.insert(0, str(ROOT / "examples/resnet"))
        from train import ResNet

        return ResNet(depth=8 if smoke else depth, in_channels=3, classes=10)

    return build


def resnet_batch(micro: int) -> Callable[[bool, torch.Generator], Batch]:
    """Random 3x32x32 images (16x16 in smoke mode) and labels, ``micro`` per micro-batch (64 in smoke mode)."""

    def batch(smoke: bool, generator: torch.Generator) -> Batch:
        n, side = (64, 16) if smoke else (micro, 32)
        return {
            "x": torch.randn(n, 3, side, side, generator=generator),
            "y": torch.randint(0, 10, (n,), generator=generator),
        }

    return batch


def resnet_outputs(model: nn.Module, batch: Batch) -> Outputs:
    logits = model(batch["x"])
    return Outputs(F.cross_entropy(logits, batch["y"]), logits)


def json_optimizer(config: str) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """The base optimizer of a config's JSON ``"optimizer"`` section, as ``ds_kfac.initialize`` builds it."""

    def build(params: Iterable[Any]) -> torch.optim.Optimizer:
        section = json.loads((ROOT / config).read_text())["optimizer"]
        return build_optimizer(section["type"], params, section.get("params", {}))

    return build


WORKLOADS = {
    "bert-mini": Workload(
        "configs/bert_cpu_phase1_kfac.json",
        build_bert(BERT_MINI, BERT_DATA),
        lambda params: Lamb(params, lr=1e-3),
        bert_batch(BERT_DATA),
        bert_outputs,
    ),
    "bert-base": Workload(  # BERT-base shapes for a GPU (--device cuda); LAMB as resolve_lamb picks it (FusedLamb)
        "configs/bert_cpu_phase1_kfac.json",
        build_bert(BERT_BASE, BERT_BASE_DATA),
        lambda params: resolve_lamb(params, lr=1e-3),
        bert_batch(BERT_BASE_DATA),
        bert_outputs,
    ),
    **{
        f"{name}-l2": Workload(  # users' layer shapes on the CPU, 2 of the layers (LAMB: the phase-1 recipe)
            "configs/bert_cpu_phase1_kfac.json",
            build_bert(with_depth(size, 2), BERT_SHAPES_CPU_DATA),
            lambda params: Lamb(params, lr=1e-3),
            bert_batch(BERT_SHAPES_CPU_DATA),
            bert_outputs,
        )
        for name, size in (("bert-base", BERT_BASE), ("bert-large", BERT_LARGE))
    },
    "bert-demo": Workload(  # the BERT demo's model, micro-batch and phase-2 base optimizer
        "configs/bert_cpu_phase2_kfac.json",
        build_bert(None, BERT_DEMO_DATA),
        json_optimizer("configs/bert_cpu_phase2_base.json"),
        bert_batch(BERT_DEMO_DATA),
        bert_outputs,
    ),
    "resnet20": Workload(
        "configs/resnet_kfac_cpu.json",
        build_resnet(20),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        resnet_batch(64),
        resnet_outputs,
    ),
    "resnet8-demo": Workload(  # the ResNet demo's model and micro-batch (configs/resnet_kfac_cpu.json)
        "configs/resnet_kfac_cpu.json",
        build_resnet(8),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        resnet_batch(128),
        resnet_outputs,
    ),
}
PLACEMENTS = ("comm-opt", "hybrid-opt", "mem-opt")
GPU_WORKLOADS = ("bert-base",)
"""Too large for the CPU machine: left out of the default ``--workloads`` (benchmarks/gpu/ runs them)."""
SHAPE_WORKLOADS = ("bert-base-l2", "bert-large-l2")
"""BERT-base's and BERT-large's layer shapes at a few layers: minutes per configuration, so named explicitly."""


def shipped_section(workload: str) -> dict[str, Any]:
    """The workload config's ``"kfac"`` section as the file has it."""
    return json.loads((ROOT / WORKLOADS[workload].kfac_config).read_text())["kfac"]


def kfac_section(workload: str, smoke: bool, overrides: Sequence[str], placement: str) -> dict[str, Any]:
    """The workload config's ``"kfac"`` section at KAISA's cadence (smoke: 2/4), ``--set`` applied, then the placement."""
    section = shipped_section(workload)
    section.update(SMOKE_CADENCE if smoke else CADENCE)
    section = apply_overrides(section, overrides, new_top_keys=True)  # keys of the "kfac" section itself
    section["grad_worker_fraction"] = placement
    for key in CADENCE:
        value = section[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SystemExit(
                f"step_cost needs an integer {key} >= 1 (cycles are whole decomposition periods), got {value!r}"
            )
    return section


def recipe_cadence(workload: str) -> dict[str, int]:
    """The workload config's own factor and decomposition intervals (its recipe's), before ``CADENCE`` and ``--set``."""
    section = shipped_section(workload)
    return {key: section.get(key, CADENCE[key]) for key in CADENCE}


# ---------------------------------------------------------------- the floor
@dataclass(frozen=True)
class LayerWork:
    """One Linear/Conv2d per micro-batch: forward multiply-adds, K-FAC factor rows and factor dimensions."""

    name: str
    macs: int
    rows: int
    a_dim: int
    g_dim: int


def count_layers(
    model: nn.Module,
    batch: Batch,
    forward: Callable[[nn.Module, Batch], Any],
    conv_factors: str = "expand",
) -> list[LayerWork]:
    """The work of every Linear/Conv2d in one ``forward`` pass of ``batch`` (summed over calls of a module).
    Conv2d factor rows are its output positions (K-FAC-expand), or its examples with ``conv_factors="reduce"``."""
    seen: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    dims: dict[str, tuple[int, int]] = {}

    def hook(name: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, nn.Linear):
            positions = rows = inputs[0].numel() // module.in_features
            fan_in = module.in_features
        else:
            positions = output.numel() // module.out_channels
            rows = (output.shape[0] if output.dim() == 4 else 1) if conv_factors == "reduce" else positions
            fan_in = module.in_channels // module.groups * math.prod(module.kernel_size)
        out = module.weight.shape[0]
        seen[name][0] += positions * fan_in * out
        seen[name][1] += rows
        dims[name] = (fan_in + int(module.bias is not None), out)

    handles = [
        m.register_forward_hook(lambda mod, i, o, name=name: hook(name, mod, i, o))
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
    ]
    try:
        with torch.no_grad():
            forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return [LayerWork(name, macs, rows, *dims[name]) for name, (macs, rows) in seen.items()]


def flops_per_step(
    layers: Sequence[LayerWork],
    registered: Iterable[str],
    ga: int,
    factor_every: int,
    inv_every: int,
    world: int,
    grad_workers: int,
) -> dict[str, float]:
    """FLOPs per rank and optimizer step, amortized over the schedule: the base arm's forward/backward
    and K-FAC's factors, preconditioning and decompositions (see the module docstring)."""
    mine = set(registered)
    reg = [w for w in layers if w.name in mine]
    return {
        "forward_backward": 6.0 * ga * sum(w.macs for w in layers),
        "factors": ga * sum(2.0 * w.rows * (w.a_dim**2 + w.g_dim**2) for w in reg) / factor_every,
        "precondition": sum(4.0 * w.g_dim * w.a_dim * (w.g_dim + w.a_dim) for w in reg) * grad_workers / world,
        "decompose": sum(EIGH_FLOPS_PER_DIM3 * (w.a_dim**3 + w.g_dim**3) for w in reg) / inv_every / world,
    }


def floor_summary(
    flops: dict[str, float], base_mean_ms: float, kfac_phases_ms: dict[str, float], ratio: float
) -> dict[str, Any]:
    """Floor ratio, measured overhead in units of the floor's, and each floor phase against its measured phases."""
    base = flops["forward_backward"]
    extra = sum(flops[p] for p in FLOOR_PHASES)
    floor_ratio = 1.0 + extra / base
    phases = {}
    for phase, measured_by in FLOOR_PHASES.items():
        floor_ms = flops[phase] / base * base_mean_ms
        measured = sum(kfac_phases_ms.get(p, 0.0) for p in measured_by)
        phases[phase] = {
            "floor_ms": floor_ms,
            "measured_ms": measured,
            "measured_phases": list(measured_by),
            "times_floor": measured / floor_ms if floor_ms > 0 else None,
        }
    return {
        "flops_per_step": flops,
        "ratio": floor_ratio,
        "overhead_vs_floor": (ratio - 1.0) / (floor_ratio - 1.0) if extra > 0 else None,
        "phases": phases,
    }


# ---------------------------------------------------------------- measurement (worker processes)
@dataclass
class Arm:
    """One side of the comparison: a model, its optimizer, and K-FAC or not."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    kfac: Optional[KFACPreconditioner] = None
    steps: int = 0
    micro: int = 0
    """The index in the step of the micro-batch being run (K-FAC's ``micro_batch``, for ``factor_micro_batches``)."""


def step_class(step: int, factor_every: int, inv_every: int) -> str:
    if step % inv_every == 0:
        return "decomposition"
    return "factor" if step % factor_every == 0 else "plain"


def average_gradients(model: nn.Module, world: int) -> None:
    """Data-parallel mean of the gradients: one all-reduce of them all, flattened into one buffer."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


def train_step(
    arm: Arm,
    micro_batches: Sequence[Batch],
    workload: Workload,
    world: int,
    now: Callable[[], float],
    before_kfac: Callable[[], None] = lambda: None,
) -> tuple[float, dict[str, float], Optional[float]]:
    """One optimizer step of ``arm``, timed by phase: returns ``(step seconds, phases, untimed K-FAC seconds)``.
    ``before_kfac`` runs between the gradient averaging and ``kfac.step()`` (a probe, counted as untimed)."""
    kfac = arm.kfac
    if kfac is not None:
        kfac.timings.clear()
    t0 = now()
    arm.optimizer.zero_grad(set_to_none=True)
    for arm.micro, batch in enumerate(micro_batches):
        out = workload.forward(arm.model, batch)
        if kfac is not None:  # the sampled Fisher's extra backward on factor steps; nothing with "empirical"
            kfac.sample_fisher(out.logits, "cross_entropy", labels=out.labels)
        (out.loss / len(micro_batches)).backward()
    t1 = now()
    if world > 1:
        average_gradients(arm.model, world)
    t2 = now()
    if kfac is not None:
        before_kfac()
        kfac.step()
    t3 = now()
    arm.optimizer.step()
    t4 = now()
    inner = dict(kfac.timings) if kfac is not None else {}
    # K-FAC's phases inside the micro-batches' forward and backward (the sampled pass only where one ran).
    in_backward = {"hooks": inner.pop("hooks", 0.0)}
    if "sampled_backward" in inner:
        in_backward["sampled_backward"] = inner.pop("sampled_backward")
    fwd_bwd = t1 - t0 - sum(in_backward.values())
    phases = {"forward_backward": fwd_bwd, "grad_comm": t2 - t1, "base_optimizer": t4 - t3}
    if kfac is not None:
        phases.update(in_backward, **inner)
    return t4 - t0, phases, (t3 - t2 - sum(inner.values())) if kfac is not None else None


def run_cycle(
    arm: Arm,
    pool: Sequence[Batch],
    ga: int,
    cadence: dict[str, int],
    cycle: int,
    workload: Workload,
    world: int,
    now: Callable[[], float],
    steps: Optional[int] = None,
) -> list[Record]:
    """``steps`` (default ``inv_update_steps``: one whole cycle) optimizer steps of ``arm``; step ``s``
    gets micro-batches ``s*ga ..`` of the pool."""
    records = []
    for _ in range(steps or cadence["inv_update_steps"]):
        s = arm.steps
        batches = [pool[(s * ga + m) % len(pool)] for m in range(ga)]
        step, phases, untimed = train_step(arm, batches, workload, world, now)
        cls = step_class(s, cadence["factor_update_steps"], cadence["inv_update_steps"])
        records.append({"cycle": cycle, "class": cls, "step": step, "phases": phases, "untimed": untimed})
        arm.steps += 1
    return records


MODEL_DTYPES = ("float32", "bfloat16")
"""``--dtype``: the models' floating-point dtype (a name of the config schema's ``DTYPES``)."""


def as_input(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A batch tensor on ``device``, floating-point ones in the models' ``dtype`` (token ids and labels unchanged)."""
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


def kfac_optimizer(
    model: nn.Module, section: dict[str, Any], make: Callable[[Iterable[Any]], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """The K-FAC arm's base optimizer: with the eigenbasis key, the K-FAC layers' parameters in groups of their own,
    as ``ds_kfac.initialize`` splits them."""
    params: Iterable[Any] = model.parameters()
    if section.get("eigenbasis_moments"):
        params = split_groups(params, preconditioned_parameters(model, KFACConfig.parse(section)))
    return make(params)


def refresh_counts(metrics: dict[str, float]) -> dict[str, int]:
    """A rank's refreshes so far by how they were computed, from its ``kfac.metrics()`` (``kfac/refresh/<how>``)."""
    return {how: int(metrics[f"kfac/refresh/{how}"]) for how in REFRESH_KINDS}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """One configuration on this rank: both arms, warm-up then alternating measured cycles."""
    workload = WORKLOADS[spec["workload"]]
    smoke, ga, world, section = spec["smoke"], spec["ga"], spec["world"], spec["kfac_config"]
    device = torch.device("cuda", rank % torch.cuda.device_count()) if spec["device"] == "cuda" else torch.device("cpu")
    # The step's own stream only: async decompositions on their side stream run on across step boundaries.
    sync = torch.cuda.current_stream(device).synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def now() -> float:
        sync()
        return time.perf_counter()

    cadence = {key: section[key] for key in CADENCE}
    dtype = DTYPES[spec["dtype"]]
    torch.manual_seed(spec["seed"])
    model = workload.build(smoke).to(device, dtype).train()
    initial = copy.deepcopy(model.state_dict())
    generator = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    pool = [{k: as_input(v, device, dtype) for k, v in workload.batch(smoke, generator).items()} for _ in range(POOL)]
    kfac_group = dist.new_group(list(range(world)))

    make_optimizer = json_optimizer(spec["base_optimizer"]) if spec["base_optimizer"] else workload.optimizer
    base = Arm(model, make_optimizer(model.parameters()))
    warmup = spec["warmup_steps"] or cadence["inv_update_steps"]
    run_cycle(base, pool, ga, cadence, -1, workload, world, now, warmup)
    rss_base = peak_rss_bytes()
    kfac_model = workload.build(smoke).to(device, dtype).train()
    kfac_model.load_state_dict(initial)
    del initial
    optimizer = kfac_optimizer(kfac_model, section, make_optimizer)
    arm = Arm(kfac_model, optimizer)
    arm.kfac = kfac = KFACPreconditioner(
        kfac_model,
        section,
        optimizer=optimizer,
        accumulation_steps=ga,
        micro_batch=lambda: arm.micro,
        process_group=kfac_group,
    )
    kfac.timer.synchronize = device.type == "cuda"
    run_cycle(arm, pool, ga, cadence, -1, workload, world, now, warmup)
    rss_kfac = peak_rss_bytes()

    records: dict[str, list[Record]] = {"base": [], "kfac": []}
    untimed = refresh_counts(kfac.metrics())
    for cycle in range(spec["cycles"]):
        records["base"] += run_cycle(base, pool, ga, cadence, cycle, workload, world, now)
        records["kfac"] += run_cycle(arm, pool, ga, cadence, cycle, workload, world, now)
    timed = {how: n - untimed[how] for how, n in refresh_counts(kfac.metrics()).items()}
    # Untimed steps up to the next factor step, then its state with the step's statistics still held,
    # after the last backward and before kfac.step() hands them over.
    in_step: dict[str, int] = {}
    while True:
        batches = [pool[(arm.steps * ga + m) % len(pool)] for m in range(ga)]
        factor_step = arm.steps % cadence["factor_update_steps"] == 0
        train_step(arm, batches, workload, world, now, lambda: in_step.update(kfac.memory_usage()))
        arm.steps += 1
        if factor_step:
            break
    registered = kfac.layer_names
    layers = count_layers(model, pool[0], workload.forward, kfac.config.conv_factors)
    metrics = kfac.metrics()
    prediction = predicted(spec, rank, workload, pool, device, dtype) if spec.get("predict") else None
    return {
        "predicted": prediction,
        "records": records,
        "refreshes": {
            **refresh_counts(metrics),
            **{k: metrics[f"kfac/refresh/{k}"] for k in ("drift_mean", "drift_max") if f"kfac/refresh/{k}" in metrics},
        },
        "timed_refreshes": timed,
        "layers": {"registered": registered, "skipped": [s.name for s in kfac.skipped_layers]},
        "flops": flops_per_step(
            layers,
            registered,
            ga,
            cadence["factor_update_steps"],
            cadence["inv_update_steps"],
            world,
            workers_per_layer(section["grad_worker_fraction"], world),
        ),
        "memory": {
            "kfac_state_bytes": kfac.memory_usage(),
            "kfac_state_bytes_in_step": in_step,
            "model_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "peak_rss_base_only": rss_base,
            "peak_rss_with_kfac": rss_kfac,
        },
    }


def predicted(
    spec: dict[str, Any], rank: int, workload: Workload, pool: Sequence[Batch], device: torch.device, dtype: torch.dtype
) -> Optional[dict[str, Any]]:
    """``python -m ds_kfac.plan --calibrate``'s prediction for this configuration, from a calibration made in the
    same processes after the measurement (a fresh model with the same weights' shapes): on rank 0, the placement's
    predicted seconds per step by phase for every rank, and the calibration."""
    torch.manual_seed(spec["seed"])
    model = workload.build(spec["smoke"]).to(device, dtype).train()
    timed = Timed(model, spec["kfac_config"], pool, lambda m, b: workload.forward(m, b).loss, spec["ga"])
    calibration = calibrate(timed)
    if rank:
        return None
    (time,) = predicted_times(model, spec["kfac_config"], spec["ga"], spec["world"], None, calibration)
    return {"ranks_ms": [{k: 1e3 * v for k, v in r.items()} for r in time.ranks], "overhead_ms": 1e3 * time.overhead,
            "calibration": dataclasses.asdict(calibration)}  # fmt: skip


def predicted_times(
    model: nn.Module, section: dict[str, Any], ga: int, world: int, placements: Optional[Sequence[str]],
    calibration: Calibration,
) -> list[PlacementTime]:  # fmt: skip
    """``calibration``'s prediction of ``placements`` (default: the section's) for ``model`` at ``world`` ranks, its
    micro-batch (the calibration's) and ``ga``, at the section's factor reduction."""
    job = read_job({"train_micro_batch_size_per_gpu": calibration.micro_batch, "gradient_accumulation_steps": ga,
                    "kfac": section}, world)  # fmt: skip
    plan = plan_job(model, job, placements or [job.kfac.grad_worker_fraction], [job.kfac.factor_reduction])
    return predict_plan(plan, calibration)


def worker(spec_path: Path, rank: int) -> None:
    """A rank of one configuration: join the group, measure, write ``rank<r>.json`` beside the spec."""
    spec = json.loads(spec_path.read_text())
    os.environ[network.ENV] = spec.get("network") or ""
    network.simulated()  # a malformed value fails here, before the group forms
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision(spec["matmul_precision"])
    backend = "nccl" if spec["device"] == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=spec["world"],
        timeout=timedelta(seconds=spec["timeout"]),
    )
    result = measure(spec, rank)
    if rank:
        del result["records"]  # the steps are timed on rank 0
    (spec_path.parent / f"rank{rank}.json").write_text(json.dumps(result))
    ds_kfac.shutdown()


# ---------------------------------------------------------------- summaries
def phase_order(names: Iterable[str]) -> list[str]:
    """Phases in the order a step runs them (K-FAC's in its ``PHASES`` order, unknown ones after)."""
    order = ["forward_backward", "grad_comm", *KFAC_PHASES, "base_optimizer"]
    names = set(names)
    return [p for p in order if p in names] + sorted(names - set(order))


def mean_phases_ms(records: Sequence[Record], phases: Sequence[str]) -> dict[str, float]:
    return {p: 1e3 * statistics.fmean(r["phases"].get(p, 0.0) for r in records) for p in phases}


def summarize_arm(records: Sequence[Record]) -> dict[str, Any]:
    """Amortized, per-class and per-step statistics of one arm's measured steps."""
    phases = phase_order({p for r in records for p in r["phases"]})

    def block(rs: Sequence[Record]) -> dict[str, Any]:
        mean_ms = 1e3 * statistics.fmean(r["step"] for r in rs)
        by_phase = mean_phases_ms(rs, phases)
        return {
            "count": len(rs),
            "mean_ms": mean_ms,
            "phases_ms": by_phase,
            "coverage": sum(by_phase.values()) / mean_ms,
        }

    whole = block(records)
    steps_ms = [1e3 * r["step"] for r in records]
    out = {
        "mean_ms": whole["mean_ms"],
        "median_ms": statistics.median(steps_ms),
        "slowest_ms": max(steps_ms),
        "coverage": whole["coverage"],
        "phases_ms": whole["phases_ms"],
        "classes": {c: block(rs) for c in CLASSES if (rs := [r for r in records if r["class"] == c])},
        "step_ms": [
            [ms for ms, r in zip(steps_ms, records) if r["cycle"] == c] for c in sorted({r["cycle"] for r in records})
        ],
    }
    if records[0]["untimed"] is not None:
        out["untimed_ms"] = 1e3 * statistics.fmean(r["untimed"] for r in records)
    return out


def amortized_ms(classes: dict[str, dict[str, Any]], cadence: dict[str, int], measured_inv: int) -> Optional[float]:
    """The mean step at another cadence, from the measured per-class means: per ``inv_update_steps`` steps one
    decomposition step, ``inv / factor - 1`` factor steps and the rest plain, each class's ``decompose`` time taken
    out and one measured cycle's (``measured_inv`` steps) added per cycle instead: a refresh's work, wherever the
    schedule put it (all at the decomposition step, or spread over the cycle with ``refresh_spread``). ``stack``
    stays in the steps that paid it. ``None`` unless all three classes were measured and ``factor_update_steps``
    divides ``inv_update_steps``. For shapes too slow on the CPU to run whole cycles of the recipe's cadence."""
    factor, inv = cadence["factor_update_steps"], cadence["inv_update_steps"]
    if inv % factor or any(c not in classes for c in CLASSES):
        return None
    counts = {"decomposition": 1, "factor": inv // factor - 1, "plain": inv - inv // factor}
    measured_counts = _class_counts(classes)
    refresh = sum(classes[c]["phases_ms"].get("decompose", 0.0) * n for c, n in measured_counts.items())
    refresh *= measured_inv / sum(measured_counts.values())  # per measured cycle
    steps = sum(n * (classes[c]["mean_ms"] - classes[c]["phases_ms"].get("decompose", 0.0)) for c, n in counts.items())
    return (steps + refresh) / inv


def _class_counts(classes: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {c: classes[c]["count"] for c in CLASSES if c in classes}


def summarize(spec: dict[str, Any], ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's result from its ranks' measurements (timings from rank 0)."""
    records = ranks[0]["records"]
    arms = {arm: summarize_arm(records[arm]) for arm in ARMS}
    per_cycle = [
        statistics.fmean(k) / statistics.fmean(b) for b, k in zip(arms["base"]["step_ms"], arms["kfac"]["step_ms"])
    ]
    ratio = arms["kfac"]["mean_ms"] / arms["base"]["mean_ms"]
    memory = [r["memory"] for r in ranks]
    measured_inv = spec["kfac_config"]["inv_update_steps"]
    recipe = amortized_ms(arms["kfac"]["classes"], spec["recipe_cadence"], measured_inv)
    return {
        **{key: spec[key] for key in ("workload", "world", "placement", "ga", "load_before")},
        "kfac_config": spec["kfac_config"],
        "layers": ranks[0]["layers"],
        **({"predicted": ranks[0]["predicted"]} if ranks[0].get("predicted") else {}),
        "arms": arms,
        "ratio": {
            "mean": ratio,
            "median": statistics.median(per_cycle),
            "min": min(per_cycle),
            "max": max(per_cycle),
            "per_cycle": per_cycle,
            # K-FAC's mean step at the workload config's own cadence over the base's mean step
            "recipe_cadence": spec["recipe_cadence"],
            "at_recipe_cadence": None if recipe is None else recipe / arms["base"]["mean_ms"],
        },
        "floor": floor_summary(ranks[0]["flops"], arms["base"]["mean_ms"], arms["kfac"]["phases_ms"], ratio),
        "refreshes": [r["refreshes"] for r in ranks],
        "timed_refreshes": [r["timed_refreshes"] for r in ranks],
        "memory": {
            "kfac_state_bytes": [m["kfac_state_bytes"] for m in memory],
            "kfac_state_bytes_in_step": [m["kfac_state_bytes_in_step"] for m in memory],
            "model_param_bytes": memory[0]["model_param_bytes"],
            "peak_rss_bytes": {
                "base_only": [m["peak_rss_base_only"] for m in memory],
                "with_kfac": [m["peak_rss_with_kfac"] for m in memory],
            },
        },
    }


def label(c: dict[str, Any]) -> str:
    return f"{c['workload']} w{c['world']} {c['placement']} GA{c['ga']}"


def overrides_label(overrides: Sequence[str]) -> str:
    """The ``--set`` overrides of a run, short (``conv_factors=reduce, async_decompositions=true``); "as shipped" if none."""
    return ", ".join(o.replace('"', "") for o in overrides) or "as shipped"


def table(results: Sequence[dict[str, Any]]) -> str:
    """benchmarks/README.md's Markdown table: one row per configuration of each results file."""
    rows = [
        "| workload | K-FAC settings | world | placement | GA | base ms | K-FAC ms "
        "| K-FAC/base: mean (median, range over cycles) | floor ratio | overhead/floor "
        "| K-FAC slowest step/median (base) | K-FAC costliest step class/median | K-FAC state MiB/rank "
        "| K-FAC/base at the config's cadence |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        settings = overrides_label(result["settings"]["set"])
        if result["settings"].get("base_optimizer"):
            settings += f"; both arms' optimizer from {result['settings']['base_optimizer']}"
        for c in result["configurations"]:
            k, r, f = c["arms"]["kfac"], c["ratio"], c["floor"]
            over = "-" if f["overhead_vs_floor"] is None else f"{f['overhead_vs_floor']:.2f}x"
            state = max(sum(m.values()) for m in c["memory"]["kfac_state_bytes_in_step"]) / 2**20
            base_spread = c["arms"]["base"]["slowest_ms"] / c["arms"]["base"]["median_ms"]  # the machine's noise
            costliest = max(cls["mean_ms"] for cls in k["classes"].values() if cls["count"])
            rows.append(
                f"| {c['workload']} | {settings} | {c['world']} | {c['placement']} | {c['ga']} "
                f"| {c['arms']['base']['mean_ms']:.1f} | {k['mean_ms']:.1f} "
                f"| {r['mean']:.3f} ({r['median']:.3f}, {r['min']:.3f}-{r['max']:.3f}) "
                f"| {f['ratio']:.3f} | {over} | {k['slowest_ms'] / k['median_ms']:.2f} ({base_spread:.2f}) "
                f"| {costliest / k['median_ms']:.2f} | {state:.1f} | {_at_recipe(r)} |"
            )
    return "\n".join(rows)


def _at_recipe(ratio: dict[str, Any]) -> str:
    """``1.234 (5/25)``: the ratio amortized at the config's cadence; ``-`` where not derived (older results, or a
    step class not measured)."""
    value, cadence = ratio.get("at_recipe_cadence"), ratio.get("recipe_cadence")
    if value is None:
        return "-"
    return f"{value:.3f} ({cadence['factor_update_steps']}/{cadence['inv_update_steps']})"


def phase_table(results: Sequence[dict[str, Any]]) -> str:
    """Where the milliseconds go: each arm's amortized ms per phase, and K-FAC's phases against their floor."""
    phases = phase_order(
        {p for r in results for c in r["configurations"] for a in ARMS for p in c["arms"][a]["phases_ms"]}
    )
    rows = [
        "| configuration | arm | " + " | ".join(phases) + " | untimed | step |",
        "| --- | --- | " + " | ".join("---" for _ in phases) + " | --- | --- |",
    ]
    floors = ["| configuration | K-FAC phase | floor ms | measured ms | x floor |", "| --- | --- | --- | --- | --- |"]
    for result in results:
        settings = overrides_label(result["settings"]["set"])
        for c in result["configurations"]:
            name = f"{label(c)} ({settings})"
            for arm in ARMS:
                a = c["arms"][arm]
                cells = " | ".join(f"{a['phases_ms'].get(p, 0.0):.1f}" for p in phases)
                rows.append(f"| {name} | {arm} | {cells} | {a.get('untimed_ms', 0.0):.1f} | {a['mean_ms']:.1f} |")
            for phase, f in c["floor"]["phases"].items():
                times = "-" if f["times_floor"] is None else f"{f['times_floor']:.2f}"
                floors.append(f"| {name} | {phase} | {f['floor_ms']:.1f} | {f['measured_ms']:.1f} | {times} |")
    return "\n".join(rows) + "\n\n" + "\n".join(floors)


def prediction_table(results: Sequence[dict[str, Any]]) -> str:
    """Measured against predicted (``--predict``): K-FAC's ms per step, rank 0's measured phases (its untimed rest
    with ``precondition``, ``stack`` with ``decompose``, ``sampled_backward`` with ``hooks``) and the slowest rank's
    predicted ones."""
    head = " | ".join(f"{p} measured / predicted" for p in REPORTED_PHASES)
    rows = [
        "| configuration | network | K-FAC ms measured | K-FAC - base ms | predicted | predicted / measured "
        f"| {head} |",
        "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in REPORTED_PHASES) + " |",
    ]
    for result in results:
        for c in result["configurations"]:
            if "predicted" not in c:
                continue
            k, pred = c["arms"]["kfac"], c["predicted"]
            measured = reported(k["phases_ms"])
            measured["precondition"] += k.get("untimed_ms", 0.0)
            slowest = reported(max(pred["ranks_ms"], key=lambda r: sum(r.values())))
            total = kfac_ms(c)
            cells = " | ".join(f"{measured[p]:.1f} / {slowest[p]:.1f}" for p in REPORTED_PHASES)
            rows.append(
                f"| {label(c)} | {result['settings'].get('network') or 'this machine'} | {total:.1f} "
                f"| {k['mean_ms'] - c['arms']['base']['mean_ms']:.1f} | {pred['overhead_ms']:.1f} "
                f"| {pred['overhead_ms'] / total:.2f} | {cells} |"
            )
    return "\n".join(rows)


def ranking_table(results: Sequence[dict[str, Any]]) -> str:
    """The placements' order, measured against predicted from each one calibration: the configurations of one
    workload, world, accumulation and network, each run's calibration predicting every placement of the group
    (as ``python -m ds_kfac.plan --calibration`` would from that one file)."""
    groups: dict[tuple, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for result in results:
        for c in result["configurations"]:
            if "predicted" in c:
                key = (c["workload"], c["world"], c["ga"], result["settings"].get("network") or "this machine")
                groups[key].append((result, c))
    rows = [
        "| workload, world, GA | network | measured order (K-FAC ms) | predicted order, from each run's calibration |",
        "| --- | --- | --- | --- |",
    ]
    for (workload, world, ga, net), members in groups.items():
        measured = sorted(((kfac_ms(c), c["placement"]) for _, c in members))
        model = WORKLOADS[workload].build(members[0][0]["settings"]["smoke"])
        orders = []
        for _, c in members:
            calibration = Calibration.load_dict(c["predicted"]["calibration"])
            placements = list(dict.fromkeys(m["placement"] for _, m in members))
            predictions = predicted_times(model, c["kfac_config"], ga, world, placements, calibration)
            times = sorted((1e3 * t.overhead, t.fraction) for t in predictions)
            orders.append(" < ".join(f"{f} {ms:.1f}" for ms, f in times))
        rows.append(f"| {workload}, {world}, {ga} | {net} | {' < '.join(f'{p} {ms:.1f}' for ms, p in measured)} "
                    f"| {'; '.join(orders)} |")  # fmt: skip
    return "\n".join(rows)


def kfac_ms(c: dict[str, Any]) -> float:
    """K-FAC's own ms per step in a configuration: its phases and its untimed rest."""
    k = c["arms"]["kfac"]
    inner = sum(v for p, v in k["phases_ms"].items() if p in KFAC_PHASES)
    return inner + k.get("untimed_ms", 0.0)


def plot(path: Path, configurations: Sequence[dict[str, Any]]) -> Path:
    """A stacked bar per configuration and arm: the amortized ms of each phase (and K-FAC's untimed rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = phase_order({p for c in configurations for a in ARMS for p in c["arms"][a]["phases_ms"]})
    segments = [*phases, "untimed_ms"]
    colors = dict(zip(segments, plt.get_cmap("tab20").colors))  # up to 20 segments: every phase has a colour
    colors["untimed_ms"] = "lightgrey"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(configurations)), 5))
    for i, c in enumerate(configurations):
        for j, arm in enumerate(ARMS):
            a = c["arms"][arm]
            values = {**a["phases_ms"], "untimed_ms": a.get("untimed_ms", 0.0)}
            bottom = 0.0
            for seg in segments:
                v = values.get(seg, 0.0)
                lab = ("K-FAC untimed" if seg == "untimed_ms" else seg) if i == 0 and j == 1 else None
                ax.bar(
                    i + 0.4 * j - 0.2, v, 0.38, bottom=bottom, color=colors[seg], label=lab, edgecolor="white", lw=0.3
                )
                bottom += v
            ax.text(i + 0.4 * j - 0.2, bottom, arm, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(configurations)), [label(c) for c in configurations], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per optimizer step (amortized over the cycle)")
    ax.set_title("K-FAC step cost by phase (left bar: base, right bar: K-FAC)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- driver
def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (workload, world, placement, GA) asked for; at world 1 the placements coincide and run once."""
    return [
        {"workload": w, "world": world, "placement": p, "ga": ga}
        for w in args.workloads
        for world in args.worlds
        for p in (args.placements[:1] if world == 1 else args.placements)
        for ga in args.ga
    ]


def launch_configuration(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration on ``world`` processes of their own (timed out and cleaned up by ``tests/launch.py``; on
    the CPU forked with torch and DeepSpeed imported, see ``launch.Forked``; on an accelerator started fresh)."""
    spec = {
        **config,
        "kfac_config": kfac_section(config["workload"], args.smoke, args.set, config["placement"]),
        "recipe_cadence": recipe_cadence(config["workload"]),
        "cycles": args.cycles,
        "warmup_steps": args.warmup_steps,
        "base_optimizer": args.base_optimizer,
        "smoke": args.smoke,
        "device": args.device,
        "dtype": args.dtype,
        "matmul_precision": args.matmul_precision,
        "seed": args.seed,
        "timeout": args.timeout,
        "predict": args.predict,
        "network": args.network,
        "port": free_port(),
        "load_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="step_cost_") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        me = str(Path(__file__).resolve())
        cmds = [
            [sys.executable, "-u", me, "worker", "--spec", str(path), "--rank", str(r)] for r in range(config["world"])
        ]
        launch.run(cmds, args.timeout, preload=args.device == "cpu")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(config["world"])]
    return summarize(spec, ranks)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration in turn; write the JSON and PNG, print the table."""
    load_before = os.getloadavg()
    results = []
    for config in configurations(args):
        result = launch_configuration(config, args)
        results.append(result)
        print(
            f"{label(result)}: base {result['arms']['base']['mean_ms']:.1f} ms, "
            f"K-FAC {result['arms']['kfac']['mean_ms']:.1f} ms, ratio {result['ratio']['mean']:.3f} "
            f"(floor {result['floor']['ratio']:.3f})",
            flush=True,
        )
    import ds_kfac

    out = {
        "benchmark": "step_cost",
        "command": shlex.join(["python", "benchmarks/step_cost.py", *sys.argv[1:]]),
        "settings": {
            key: getattr(args, key)
            for key in (
                "workloads",
                "worlds",
                "placements",
                "ga",
                "cycles",
                "warmup_steps",
                "set",
                "base_optimizer",
                "smoke",
                "device",
                "dtype",
                "matmul_precision",
                "seed",
                "timeout",
                "predict",
                "network",
            )
        },
        "versions": {**versions(), "ds_kfac": ds_kfac.__version__},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "floor_constants": {
            "forward_backward": "6 x multiply-adds of every Linear/Conv2d",
            "factors": "2 n a^2 + 2 n g^2 per registered layer and micro-batch / factor_update_steps",
            "precondition": "4 g a (g + a) per layer x gradient workers / world",
            "decompose": f"{EIGH_FLOPS_PER_DIM3} d^3 per factor / inv_update_steps / world",
        },
        "configurations": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = portable(out)
    args.out.write_text(json.dumps(out, indent=1))
    png = plot(args.out.with_suffix(".png"), results)
    print(f"\n{table([out])}\n\nresults: {args.out}\nplot: {png}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line (``run``, ``table``, ``worker``); benchmarks/gpu/run.py checks its invocations against it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure base and K-FAC steps by phase")
    r.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=sorted(set(WORKLOADS) - set(GPU_WORKLOADS) - set(SHAPE_WORKLOADS)),
    )
    r.add_argument("--worlds", nargs="+", type=int, choices=(1, 2, 4, 8), default=[1, 2])
    r.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=["comm-opt", "mem-opt"])
    r.add_argument("--ga", nargs="+", type=int, default=[1, 4, 8], help="micro-batches per optimizer step")
    r.add_argument("--cycles", type=int, default=3, help="measured decomposition cycles per arm (after the warm-up)")
    r.add_argument(
        "--warmup-steps",
        type=int,
        help="untimed steps per arm first (default: one cycle). A measured cycle is any inv_update_steps "
        "consecutive steps, so it need not start at a decomposition step; the warm-up should include one",
    )
    r.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a K-FAC key")
    r.add_argument(
        "--base-optimizer",
        metavar="CONFIG",
        help="both arms' base optimizer from this config's JSON \"optimizer\" section (default: the workload's)",
    )
    r.add_argument(
        "--smoke",
        action="store_true",
        help="BERT-tiny and ResNet-8 at 16x16, factors every 2 steps, decompositions every 4",
    )
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    r.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default="float32",
        help="both models' parameters, activations and gradients (bfloat16: the model half of DeepSpeed's bf16; the "
        "base optimizer steps those parameters directly, without DeepSpeed's fp32 master copies)",
    )
    r.add_argument(
        "--matmul-precision",
        choices=("highest", "high", "medium"),
        default="highest",
        help="torch.set_float32_matmul_precision in every rank (the user's switch: TF32 on CUDA, bf16 on CPUs "
        "with AVX512-BF16; both arms, and K-FAC's float32 matmuls)",
    )
    r.add_argument(
        "--predict",
        action="store_true",
        help="also calibrate in the same processes and record python -m ds_kfac.plan's prediction of K-FAC's phases",
    )
    r.add_argument(
        "--network",
        metavar="latency=S,bandwidth=B",
        help="a simulated interconnect for K-FAC's collectives (ds_kfac.comm.network; seconds, bytes per second)",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "step_cost" / "step_cost.json")
    t = sub.add_parser("table", help="the Markdown tables of saved results (several files: one table)")
    t.add_argument("results", type=Path, nargs="+")
    t.add_argument("--phases", action="store_true", help="the per-phase breakdown and floors instead")
    t.add_argument("--predicted", action="store_true", help="measured against predicted (runs with --predict)")
    t.add_argument("--ranking", action="store_true", help="the placements' order, measured and predicted")
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--spec", type=Path, required=True)
    w.add_argument("--rank", type=int, required=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "table":
        results = [json.loads(path.read_text()) for path in args.results]
        if args.ranking:
            print(ranking_table(results))
        else:
            tabulate = prediction_table if args.predicted else phase_table if args.phases else table
            print(tabulate(results))
    else:
        worker(args.spec, args.rank)


if __name__ == "__main__":
    main()
