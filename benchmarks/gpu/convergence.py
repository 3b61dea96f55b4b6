"""The GPU bundle's ``bert`` check (issue 46, item 3): BERT time to target at sizes and batches the CPU cannot reach,
every arm tuned inside one device call, in bf16, with the seconds a step costs on the GPU.

    python benchmarks/gpu/run.py --check bert --budget 550          # the default plan (:data:`PLAN`, below)
    python benchmarks/gpu/run.py --check bert --plan 12x768:1024     # BERT-base with grids of its own
    python benchmarks/gpu/run.py --check bert --device cpu --tiny    # the dry run: BERT-tiny, batch 16

The plan is a list of ``SIZE:BATCH`` items, run in order. Before a size's first item, **phase 1** trains it from
scratch with LAMB (``configs/bert_cpu_phase1_lamb.json``'s rates, the pure-PyTorch ``ds_kfac.Lamb``, so no FusedLamb
compiles inside the call) at global batch 256 on the embedded corpus (sequence 128, a 8,192-token vocabulary), and the
JSON says whether it left the loss plateau (:func:`plateau`). Each item then runs **phase 2** from that checkpoint at
global batch ``BATCH`` (by accumulation) for AdamW, SOAP (the best peer on the CPU task, docs/convergence.md) and
ds_kfac (``configs/bert_cpu_phase2_kfac.json``'s key with AdamW for the rest: its Muon half steps the model's own
fp32 matrices, refused under bf16), their CPU configs resized:

- **Rates**: each arm's from a 3-point grid (:data:`GRID` times a centre, :func:`centre_rate`). Every candidate runs
  the first third of the item's schedule (:data:`GRID_EVALS` of :data:`EVALS` evaluations; its full schedule,
  stopped), the lowest held-out loss there continues to the end (``--resume``), and that run is the arm's. An item
  whose batch an earlier size of the plan tuned takes those rates scaled by width (:func:`transferred_rates`) and runs
  once per arm.
- **Steps**: the size's budget at batch 256, times ``sqrt(256 / BATCH)``: a larger batch takes fewer steps, each
  seeing more sequences.
- **Results**: per run its held-out curve, final loss and seconds per step (training time only; the first step's
  excess over the median, compilation and first decompositions, reported apart: ``peers.one_time_seconds``); per item
  every arm's steps and seconds to every arm's final (``peers.summarize``) and the ratios ds_kfac/AdamW and
  ds_kfac/SOAP in steps and seconds at AdamW's final, the common target; per size, each arm's steps and seconds to
  one fixed target at every batch (:func:`fixed_target`), the points of a critical-batch plot.

The runs go through ``examples/bert/pretrain.py``'s ``main`` in this process, one after another, as one rank:
about 40 launches would cost 30-40 s each in start-up (imports, corpus, engine), most of a 10-minute call. The
corpus is prepared into shards once (by the first run), and a run is stopped when the budget is spent
(:func:`time_limit`), so the JSON is always written. ``--budget`` also decides what starts: an item (or a size's
phase 1 with its first item) is skipped when its predicted seconds (:func:`item_seconds`, from :class:`Size`'s
estimates, then from the measured seconds per sequence) exceed what is left.

The default plan's expected seconds (:func:`plan_seconds`) at the estimates: 526 s on one H100 (BERT-small's phase 1
with the corpus 124 s, its items at batch 256 / 1,024 / 4,096 61 / 85 / 134 s, BERT-base's phase 1 44 s and its item at
1,024 77 s): ``run_all.sh 2`` gives it ``--budget 550`` in a 600 s call.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / p) for p in ("tests", "benchmarks", "examples/bert") if str(ROOT / p) not in sys.path]
import launch  # noqa: E402  (tests/launch.py)
import peers  # noqa: E402
import pretrain  # noqa: E402
import shards  # noqa: E402  (examples/bert/shards.py)
import time_to_target as ttt  # noqa: E402

import ds_kfac  # noqa: E402

Result = dict[str, Any]
METRIC = "held_out_mlm_loss"


@dataclass(frozen=True)
class Cost:
    """What a run of a size is predicted to cost: seconds per sequence of a training step, and seconds beyond its
    steps (engine, checkpoint load and save, evaluations)."""

    per_sequence: float
    overhead: float

    def run(self, steps: int, batch: int) -> float:
        return self.overhead + steps * batch * self.per_sequence


@dataclass(frozen=True)
class Size:
    """A model of the plan and how it is run and budgeted."""

    model: str
    """Its ``BertConfig`` JSON, from the repository root."""
    micro_batch: int
    phase1_steps: int
    steps: int
    """Phase-2 steps at global batch :attr:`batch` (another batch B runs ``steps * sqrt(batch / B)``)."""
    cost: Cost
    """Planning estimate in bf16 on an H100, replaced by the measured figures once a run of the size has finished."""
    batch: int = 256
    """Phase 1's global batch and the reference batch of :attr:`steps`."""
    seq: int = 128
    vocab: int = 8192

    @property
    def width(self) -> int:
        return json.loads((ROOT / self.model).read_text())["hidden_size"]


SIZES = {
    "4x512": Size("benchmarks/gpu/bert-small.json", 256, 1200, 96, Cost(2e-4, 3.0)),
    "12x768": Size("configs/bert/bert-base.json", 128, 250, 64, Cost(6e-4, 6.0)),
    "tiny": Size("configs/bert/bert-tiny.json", 8, 4, 6, Cost(2e-3, 2.0), batch=16, seq=64, vocab=1024),
}
"""BERT-small (4 x 512: the first lease's, ``bert-small.json``), BERT-base (12 x 768) and the dry run's BERT-tiny.
The estimates: BERT-small's first-lease steps ran at 0.53 ms a sequence in fp32, mostly the fp32 matmuls and the
example's Python data pipeline (about 0.1 ms a sequence on one core); bf16 at micro-batch 256 is taken as 0.2 ms.
BERT-base has 5.4x BERT-small's FLOPs a sequence: 0.6 ms. BERT-base's phase 1 is short (250 steps): the call has no
time to take it off the plateau, so its item measures mostly the step costs."""
PLAN = ("4x512:256", "4x512:1024", "4x512:4096", "12x768:1024")
TINY_PLAN = ("tiny:16",)
DATA_PREP = 60.0
"""Planning estimate of the seconds to build the corpus, its tokenizer and encodings once, in the first phase 1."""

PHASE1_LR = 0.02
PHASE1_WARMUP_STEPS = 75
"""Phase 1's LAMB rate and warm-up (at most half the steps). The first lease's phase 1 (600 steps at batch 64: 38k
sequences) ended at held-out loss 6.47, above the corpus's unigram entropy (6.40 nats at this vocabulary). Per
sequence that is where the CPU's phase 1 stands too (2 x 128: 5.95 after 32k sequences, its entropy 5.89): it was
short, not mistuned. The CPU recipe (LAMB 0.02 at batch 256, 75 warm-up steps of 1,500) left the plateau after
190k-290k sequences at every size up to 4 x 256; here BERT-small gets 1,200 steps at batch 256 (307k sequences,
each with twice the CPU's masked tokens) at the same rate and the same 75 warm-up steps, a larger fraction of its
shorter schedule."""
PLATEAU_MARGIN = 1.0
"""Nats below the unigram entropy that count as off the plateau: the CPU's phase 1 sat 0.4-0.5 below it on the
plateau and 1.2-2.5 below once past it (docs/convergence.md, the size ladder)."""

ARMS = ("adamw", "soap", peers.KFAC)
"""The phase-2 arms, by their ``peers.ARMS["bert"]`` names: AdamW, the best peer, ds_kfac."""
GRID = (0.5, 1.0, 2.0)
RATE_256 = 0.004
"""The centre rate at width 256 and batch 256: the best AdamW and ds_kfac rate of the CPU ladder at 2 x 256 and
4 x 256 (it halved from 2 x 128's 0.008 as the width doubled; SOAP's best at 2 x 128 was AdamW's)."""
EVALS = 6
GRID_EVALS = 2


# ---------------------------------------------------------------- the plan
def parse_plan(items: Sequence[str]) -> list[tuple[str, int]]:
    """``SIZE:BATCH`` items as pairs, each size one of :data:`SIZES`."""
    plan = []
    for item in items:
        name, _, batch = item.partition(":")
        if name not in SIZES or not batch.isdigit():
            raise ValueError(f"--plan items are SIZE:BATCH with SIZE one of {sorted(SIZES)}, got {item!r}")
        plan.append((name, int(batch)))
    return plan


def phase2_steps(size: Size, batch: int) -> int:
    return max(2, round(size.steps * math.sqrt(size.batch / batch)))


def schedule(size: Size, batch: int) -> tuple[int, int, int]:
    """Steps, evaluation interval and grid steps of an item (the grid runs its first :data:`GRID_EVALS`
    evaluations)."""
    steps = phase2_steps(size, batch)
    every = max(steps // EVALS, 1)
    return steps, every, min(GRID_EVALS * every, steps)


def centre_rate(width: int, batch: int) -> float:
    """:data:`RATE_256` scaled by ``256 / width`` (the CPU ladder's rate halved as the width doubled) and
    ``sqrt(batch / 256)`` (Adam's rule for the noise of a larger batch)."""
    return RATE_256 * (256 / width) * math.sqrt(batch / 256)


def transferred_rates(chosen: dict[str, float], width_from: int, width_to: int) -> dict[str, float]:
    """Each arm's rate chosen at ``width_from`` for ``width_to``: ``lr ~ 1 / width``, as :func:`centre_rate`."""
    return {arm: rate * width_from / width_to for arm, rate in chosen.items()}


def choose_rate(scores: dict[float, Optional[float]]) -> Result:
    """The rate with the lowest held-out loss (a failed or diverged run, ``None`` or NaN, loses), and whether the
    grid closed on it (it is not at an edge: a better rate may lie beyond one)."""
    finite = {rate: loss for rate, loss in scores.items() if loss is not None and math.isfinite(loss)}
    if not finite:
        return {"rate": None, "closed": False}
    best = min(finite, key=lambda rate: finite[rate])
    return {"rate": best, "closed": min(scores) < best < max(scores)}


def phase1_seconds(size: Size, steps: int, cost: Cost, first: bool) -> float:
    """Predicted seconds of a phase 1 (the first also builds the corpus: :data:`DATA_PREP`)."""
    return cost.run(steps, size.batch) + (DATA_PREP if first else 0.0)


def item_seconds(size: Size, batch: int, tuned: bool, cost: Cost) -> float:
    """Predicted seconds of an item: per arm its grid and the chosen run's rest (``tuned``), or one run."""
    steps, _, grid_steps = schedule(size, batch)
    if not tuned or grid_steps == steps:
        runs = [steps] * (len(GRID) if tuned else 1)
    else:
        runs = [grid_steps] * len(GRID) + [steps - grid_steps]
    return len(ARMS) * sum(cost.run(s, batch) for s in runs)


def plan_seconds(plan: Sequence[tuple[str, int]]) -> Result:
    """Expected seconds of each phase 1 and item at :class:`Size`'s estimates, and their sum."""
    parts: Result = {}
    tuned: set[int] = set()
    for name, batch in plan:
        size = SIZES[name]
        if f"{name} phase 1" not in parts:
            parts[f"{name} phase 1"] = phase1_seconds(size, size.phase1_steps, size.cost, not parts)
        parts[f"{name}:{batch}"] = item_seconds(size, batch, batch not in tuned, size.cost)
        tuned.add(batch)
    return {"parts": {k: round(v) for k, v in parts.items()}, "total": round(sum(parts.values()))}


# ---------------------------------------------------------------- configs
def resized(config: dict[str, Any], size: Size, batch: int, steps: int, every: int) -> dict[str, Any]:
    """A CPU config at ``size``, global batch ``batch`` on one rank, ``steps`` steps, in bf16."""
    micro = min(size.micro_batch, batch)
    overrides = {
        "bert.model": json.dumps(size.model),
        "bert.max_seq_length": size.seq,
        "bert.vocab_size": size.vocab,
        "bert.max_steps": steps,
        "bert.eval_every": every,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": batch // micro,
    }
    config = ttt.apply_overrides(config, [f"{key}={value}" for key, value in overrides.items()])
    return {**config, "bf16": {"enabled": True}}


def phase1_config(size: Size, steps: int, lr: float, warmup: int) -> dict[str, Any]:
    """The CPU phase-1 LAMB config resized, its optimizer the client ``ds_kfac.Lamb`` (FusedLamb would compile on
    a fresh machine, and failed to build on the first lease), at ``lr`` with ``warmup`` steps (at most half)."""
    config = json.loads((ROOT / "configs/bert_cpu_phase1_lamb.json").read_text())
    params = {**config.pop("optimizer")["params"], "lr": lr}
    config["client_optimizer"] = {"class": "ds_kfac.Lamb", "params": params}
    config["bert"]["warmup_proportion"] = min(warmup / steps, 0.5)
    return resized(config, size, size.batch, steps, max(steps // 8, 1))


def arm_config(arm: str, size: Size, batch: int, rate: float) -> dict[str, Any]:
    """An arm's CPU phase-2 config resized, at ``rate``; ds_kfac's with the base config's AdamW in place of its JSON
    Muon (refused with bf16) and its eigenbasis over every side as wide as the hidden state, as the shipped 768 is
    at the CPU's widths (the FFN's and the vocabulary's sides left)."""
    config = json.loads((ROOT / peers.ARMS["bert"][arm]).read_text())
    if arm == peers.KFAC:
        config["optimizer"] = json.loads((ROOT / peers.ARMS["bert"]["adamw"]).read_text())["optimizer"]
        config["kfac"]["eigenbasis_max_dim"] = size.width + 1
    key = "client_optimizer" if "client_optimizer" in config else "optimizer"
    config[key]["params"]["lr"] = rate
    steps, every, _ = schedule(size, batch)
    return resized(config, size, batch, steps, every)


# ---------------------------------------------------------------- running pretrain.main in this process
class RunTimeout(Exception):
    """A run stopped by :func:`time_limit`."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`RunTimeout` in this (the main) thread after ``seconds``: a run in this process cannot be killed,
    so this is how it stops when the budget is spent. A timer set before (pytest-timeout's) is set again after."""

    def expire(signum: int, frame: Any) -> None:
        raise RunTimeout(f"stopped after {seconds:.0f}s: the check's budget was spent")

    handler = signal.signal(signal.SIGALRM, expire)
    before, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if before:
            signal.setitimer(signal.ITIMER_REAL, max(before - (time.perf_counter() - start), 1e-3))


@contextlib.contextmanager
def no_plots() -> Iterator[None]:
    """``pretrain.main``, run many times in this process, redraws a plot of its output directory each run (1-2 s);
    in this block it draws none. (What the runs share, the prepared shards of the corpus, is on disk, prepared by
    the first run.)"""
    plot = pretrain.report.plot
    pretrain.report.plot = lambda out: Path(out) / "loss.png (not drawn)"
    try:
        yield
    finally:
        pretrain.report.plot = plot


def run_in_process(argv: list[str], seconds: float) -> Optional[str]:
    """``pretrain.main(argv)`` here as a one-rank job, stopped after ``seconds``: ``None``, or why it failed. Its
    process group is ended either way, the thread count it set put back and its memory given back."""
    os.environ.update(launch.one_rank_env())
    threads = torch.get_num_threads()
    try:
        with time_limit(seconds):
            pretrain.main(argv)
        return None
    except Exception as error:  # a failed or stopped run is recorded and the plan goes on
        return "".join(traceback.format_exception(error))[-3000:]
    finally:
        ds_kfac.shutdown()
        torch.set_num_threads(threads)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- analysis
def unigram_entropy(sequences: Iterable[Iterable[int]]) -> float:
    """Entropy in nats of the tokens' frequencies: the held-out loss of a model that learnt no context."""
    counts = collections.Counter(token for sequence in sequences for token in sequence)
    return counts_entropy(list(counts.values()))


def counts_entropy(counts: Sequence[int]) -> float:
    """Entropy in nats of the frequencies ``counts`` (zeros ignored)."""
    total = sum(counts)
    return -sum(c / total * math.log(c / total) for c in counts if c)


def plateau(final: float, entropy: float) -> Result:
    """Phase 1's final held-out loss against the unigram entropy: off the plateau at :data:`PLATEAU_MARGIN` below."""
    return {"unigram_entropy": entropy, "below_entropy": entropy - final, "left": final <= entropy - PLATEAU_MARGIN}


def run_record(run_dir: Path) -> Result:
    """A run's held-out curve (one-time cost taken off its seconds), that cost, its final loss, seconds per step and
    steps done, from its ``metrics.csv`` (empty when it wrote none)."""
    metrics = run_dir / "metrics.csv"
    steps = peers.read_steps(metrics) if metrics.is_file() else []
    if not steps:
        return {"curve": [], "steps": 0, "train_seconds": 0.0}
    one_time = peers.one_time_seconds(steps)
    curve = peers.without_one_time(ttt.read_curve(metrics, METRIC), one_time)
    return {
        "curve": curve,
        "steps": len(steps),
        "train_seconds": steps[-1],
        "final": curve[-1][2] if curve else None,
        "one_time_seconds": one_time,
        "seconds_per_step": (steps[-1] - one_time) / len(steps),
    }


def item_summary(curves: dict[str, ttt.Curve]) -> Result:
    """The arms' ``peers.summarize`` and ds_kfac's ratios to AdamW and SOAP in steps and seconds at AdamW's final
    (the common target; AdamW's own is its full budget), and at SOAP's final over SOAP's budget (the CPU figures'
    convention). A ratio is ``None`` where an arm never reached the target or did not run."""
    summary = peers.summarize({arm: [curve] for arm, curve in curves.items()}, higher_is_better=False)

    def ratio(mine: Optional[float], theirs: Optional[float]) -> Optional[float]:
        return None if mine is None or not theirs else mine / theirs

    ratios: Result = {}
    if "adamw" in summary and peers.KFAC in summary:
        to = {arm: summary[arm]["to"]["adamw"] for arm in summary}
        for other in ("adamw", "soap"):
            if other in to:
                ratios[f"kfac/{other}"] = {k: ratio(to[peers.KFAC][k], to[other][k]) for k in ("steps", "seconds")}
    if "soap" in summary and peers.KFAC in summary:
        ratios["kfac/soap at SOAP's final"] = peers.ratios(summary, peers.KFAC, "soap")
    return {"target": summary.get("adamw", {}).get("median_final"), "summary": summary, "ratios": ratios}


def fixed_target(items: dict[int, dict[str, ttt.Curve]]) -> Result:
    """One size's steps and seconds to one target at every batch, per arm: the target is the highest of AdamW's
    finals over the batches (so every AdamW run reaches it); ``None`` where a run never does."""
    finals = [curves["adamw"][-1][2] for curves in items.values() if curves.get("adamw")]
    if not finals:
        return {}
    target = max(finals)
    reached: Result = collections.defaultdict(dict)
    for batch, curves in items.items():
        for arm, curve in curves.items():
            hit = ttt.crossing(curve, target, higher_is_better=False)
            reached[arm][batch] = None if hit is None else {"steps": hit[0], "seconds": hit[1]}
    return {"target": target, "to_target": dict(reached)}


def table(items: Sequence[Result]) -> str:
    """Markdown: per item and arm the rate (whether its grid closed, or whose it is), final, s/step and the way to
    AdamW's final; then ds_kfac's ratios, a line each."""
    lines = [
        "| item | arm | rate | final | s/step | one-time s | steps to AdamW's final | s to it |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = [""]
    for item in items:
        summary = item.get("summary", {}).get("summary", {})
        for arm, run in item["runs"].items():
            to = summary.get(arm, {}).get("to", {}).get("adamw", {})
            closed = item["grids"].get(arm, {}).get("closed")
            rate = f"{run['rate']:.3g}" + (
                f" ({item['rates_from']}'s)" if item["rates_from"] else "" if closed else " (edge)"
            )
            cells = [
                item["name"], arm, rate, f"{run.get('final') or float('nan'):.4f}",
                f"{run.get('seconds_per_step', float('nan')):.3f}", f"{run.get('one_time_seconds', 0.0):.1f}",
                "never" if to.get("steps") is None else f"{to['steps']:.0f}",
                "never" if to.get("seconds") is None else f"{to['seconds']:.1f}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        for name, ratio in item.get("summary", {}).get("ratios", {}).items():
            shown = ", ".join(f"{k} never" if v is None else f"{v:.2f}x {k}" for k, v in ratio.items())
            ratios.append(f"{item['name']}: {name} {shown}")
    return "\n".join(lines + ratios)


# ---------------------------------------------------------------- the check
class Plan:
    """The runs of one ``bert`` check under ``work``: phase 1 per size, the items' grids and chosen runs, timed
    against ``--budget`` and written into ``result`` as they finish."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.end = math.inf if args.budget is None else time.perf_counter() + args.budget
        self.measured: dict[str, Cost] = {}
        self.chosen: dict[tuple[str, int], dict[str, float]] = {}
        self.result: Result = {"phase1": {}, "items": [], "skipped": [], "errors": {}}

    def left(self) -> float:
        return self.end - time.perf_counter()

    def estimate(self, name: str) -> Cost:
        """What a run of size ``name`` costs: as measured, or :class:`Size`'s estimate scaled as the other sizes'
        measurements came out against theirs."""
        if name in self.measured:
            return self.measured[name]
        scale = max((cost.per_sequence / SIZES[n].cost.per_sequence for n, cost in self.measured.items()), default=1.0)
        return Cost(SIZES[name].cost.per_sequence * scale, SIZES[name].cost.overhead)

    def measure(self, name: str, record: Result, batch: int, phase1: bool) -> None:
        """Size ``name``'s cost raised to what a finished run took (a phase 1's overhead also built the data)."""
        cost = self.measured.get(name, Cost(0.0, SIZES[name].cost.overhead))
        per_sequence = max(cost.per_sequence, record["train_seconds"] / (record["steps"] * batch))
        overhead = cost.overhead if phase1 else max(cost.overhead, record["wall_seconds"] - record["train_seconds"])
        self.measured[name] = Cost(per_sequence, overhead)

    def train(self, name: str, run: str, config: dict[str, Any], extra: Sequence[str]) -> Result:
        """One ``pretrain.main`` run of size ``name``, limited to ``--timeout`` and what is left of the budget (not
        started when that is less than a run's overhead): its :func:`run_record` with its wall seconds (and its error,
        if it failed); the size's cost updated."""
        if self.left() < self.estimate(name).overhead:
            error = f"not started: {self.left():.0f}s of the budget left"
            self.result["errors"][f"{name} {run}"] = error
            return {"curve": [], "steps": 0, "train_seconds": 0.0, "wall_seconds": 0.0, "error": error}
        out = self.work / name
        path = out / "configs" / f"{run}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
        eval_batches = max(2048 // config["train_micro_batch_size_per_gpu"], 1)
        argv = ["--deepspeed_config", str(path), "--seed", "0", "--output-dir", str(out), "--run-name", run,
                *self.data_args(), "--eval-batches", str(eval_batches), *extra]  # fmt: skip
        start = time.perf_counter()
        error = run_in_process(argv, min(self.args.timeout, self.left()))
        record = {**run_record(out / run), "wall_seconds": time.perf_counter() - start}
        if error is not None:
            self.result["errors"][f"{name} {run}"] = error
            record["error"] = error.strip().splitlines()[-1]
        if record["steps"]:
            batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
            self.measure(name, record, batch, run == "phase1")
        if torch.cuda.is_available():
            record["cuda_memory_gib"] = torch.cuda.memory_allocated() / 2**30
        print(f"bert {name} {run}: {record.get('error', 'done')}, {record['wall_seconds']:.0f}s", flush=True)
        return record

    def data_args(self) -> list[str]:
        """``pretrain.py``'s data arguments: the caches shared by every run, the small corpus in the dry run."""
        return ["--cache-dir", str(self.work / "cache"), *(["--corpus", "stdlib"] if self.args.tiny else [])]

    def phase1_steps(self, name: str) -> int:
        return self.args.phase1_steps or SIZES[name].phase1_steps

    def phase1(self, name: str) -> bool:
        """Phase 1 of size ``name``, its record and plateau verdict stored; whether it finished."""
        steps = self.phase1_steps(name)
        config = phase1_config(SIZES[name], steps, self.args.phase1_lr, self.args.phase1_warmup_steps)
        record = self.train(name, "phase1", config, [])
        record["config"] = config
        self.result["phase1"][name] = record
        if "error" in record or record["steps"] < steps:
            return False
        record["plateau"] = plateau(record["final"], self.training_entropy(name))
        return True

    def training_entropy(self, name: str) -> float:
        """The unigram entropy of the masked-LM targets phase 1 trained on: its shards' training instances."""
        record = json.loads((self.work / name / "phase1" / "corpus.json").read_text())
        return counts_entropy(shards.ShardSet.open(record["shards"]).token_counts("train").tolist())

    def source(self, name: str, batch: int) -> Optional[str]:
        """The earlier size of the plan that chose its rates at ``batch``, if any."""
        return next((other for other, b in self.chosen if b == batch and other != name), None)

    def rates(self, name: str, batch: int) -> dict[str, list[float]]:
        """Each arm's candidate rates for an item: the grid, or the rates :meth:`source` chose scaled by width."""
        width, source = SIZES[name].width, self.source(name, batch)
        if source is None:
            return {arm: [centre_rate(width, batch) * f for f in GRID] for arm in ARMS}
        scaled = transferred_rates(self.chosen[source, batch], SIZES[source].width, width)
        return {arm: [scaled[arm]] for arm in ARMS if arm in scaled}

    def item(self, name: str, batch: int) -> Result:
        """One item: per arm its grid (each candidate stopped after the grid's steps), the best continued to the
        end; the finished runs' curves summarized."""
        size = SIZES[name]
        steps, _, grid_steps = schedule(size, batch)
        item: Result = {"name": f"{name}:{batch}", "steps": steps, "grid_steps": grid_steps,
                        "rates_from": self.source(name, batch), "grids": {}, "runs": {}}  # fmt: skip
        for arm, rates in self.rates(name, batch).items():
            configs = {rate: arm_config(arm, size, batch, rate) for rate in rates}
            names = {rate: f"b{batch}-{arm}-{rate:.3g}" for rate in rates}
            start = ["--init-checkpoint", str(self.work / name / "phase1")]
            stop = grid_steps if len(rates) > 1 else steps
            extra = start + (["--stop-after", str(stop)] if stop < steps else [])
            tried = {rate: self.train(name, names[rate], configs[rate], extra) for rate in rates}
            scores = {rate: run["final"] if run["steps"] == stop else None for rate, run in tried.items()}
            grid = item["grids"][arm] = {**choose_rate(scores), "scores": scores}
            rate = grid["rate"]
            if rate is not None and stop < steps:
                tried[rate] = self.train(name, names[rate], configs[rate], [*start, "--resume"])
            for run in names.values():
                shutil.rmtree(self.work / name / run / "checkpoints", ignore_errors=True)
            if rate is not None:
                item["runs"][arm] = {**tried[rate], "rate": rate, "config": configs[rate]}
        self.chosen[name, batch] = {arm: run["rate"] for arm, run in item["runs"].items()}
        finished = {arm: run["curve"] for arm, run in item["runs"].items() if run["steps"] == steps and run["curve"]}
        if finished:
            item["summary"] = item_summary(finished)
        item["complete"] = len(finished) == len(ARMS)
        return item

    def run(self, plan: Sequence[tuple[str, int]]) -> None:
        """The plan in order, a size's phase 1 before its first item; an item that its prediction says cannot finish
        in what is left of the budget (with its size's phase 1, first) is skipped and recorded."""
        failed: set[str] = set()
        for name, batch in plan:
            size, estimate = SIZES[name], self.estimate(name)
            need = item_seconds(size, batch, self.source(name, batch) is None, estimate)
            first = name not in self.result["phase1"]
            if first:
                need += phase1_seconds(size, self.phase1_steps(name), estimate, not self.result["phase1"])
            if name not in failed and need <= self.left() and (not first or self.phase1(name)):
                self.result["items"].append(self.item(name, batch))
                continue
            if first and name in self.result["phase1"]:
                failed.add(name)
            why = "its phase 1 failed" if name in failed else f"predicted {need:.0f}s, {self.left():.0f}s left"
            self.result["skipped"].append({"item": f"{name}:{batch}", "why": why})


def check(args: argparse.Namespace) -> Result:
    """The ``bert`` check: :class:`Plan` over ``--plan`` (default :data:`PLAN`; with ``--tiny`` :data:`TINY_PLAN`) in
    a temporary directory, then its table and each size's :func:`fixed_target`."""
    plan = parse_plan(args.plan or PLAN)  # checked in the dry run too, which runs its toy plan instead
    if args.tiny:
        plan = parse_plan(TINY_PLAN)
    with tempfile.TemporaryDirectory(prefix="gpu_bert_") as tmp, no_plots():
        runner = Plan(args, Path(tmp))
        runner.run(plan)
    result = runner.result
    by_size: dict[str, dict[int, dict[str, ttt.Curve]]] = collections.defaultdict(dict)
    for item in result["items"]:
        name, batch = item["name"].split(":")
        by_size[name][int(batch)] = {arm: run["curve"] for arm, run in item["runs"].items() if run["curve"]}
    complete = all(item["complete"] for item in result["items"])
    return {
        "passed": complete and not result["skipped"] and not result["errors"] and len(result["items"]) == len(plan),
        "plan": {"items": [f"{n}:{b}" for n, b in plan], "expected_seconds": plan_seconds(plan)},
        "settings": {
            "grid": GRID,
            "evals": EVALS,
            "grid_evals": GRID_EVALS,
            "phase1_lr": args.phase1_lr,
            "phase1_warmup_steps": args.phase1_warmup_steps,
            "plateau_margin": PLATEAU_MARGIN,
        },  # fmt: skip
        **result,
        "measured_costs": {name: asdict(cost) for name, cost in runner.measured.items()},
        "fixed_target": {name: fixed_target(items) for name, items in by_size.items()},
        "table": table(result["items"]),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bert`` check's options."""
    parser.add_argument(
        "--plan", nargs="+", metavar="SIZE:BATCH", help=f"bert: items in order (default {' '.join(PLAN)})"
    )
    parser.add_argument("--phase1-steps", type=int, help="bert: phase-1 steps of every size (default: the size's)")
    parser.add_argument("--phase1-lr", type=float, default=PHASE1_LR, help="bert: phase 1's LAMB rate")
    parser.add_argument("--phase1-warmup-steps", type=int, default=PHASE1_WARMUP_STEPS, help="bert: phase 1's warm-up")
