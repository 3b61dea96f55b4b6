"""The BERT pretraining example through its real entry point (2 CPU ranks started as the deepspeed launcher starts
them, K-FAC on)."""

from __future__ import annotations

import csv
import json
import math
import platform
from pathlib import Path

import launch
import pytest

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("transformers")
ROOT = Path(__file__).parents[1]


def pretrain(config: str, out: Path, *extra: str) -> None:
    """The example with a shipped config at a small batch (micro-batch 8, accumulation 2: the large-batch demo's
    shapes would make the test 8x slower; K-FAC then gathers factors from every micro-batch), under its own name."""
    cmds, envs = pretrain_ranks(config, out, *extra)
    launch.run(cmds, timeout=300, rank_envs=envs, preload=True)


def pretrain_ranks(config: str, out: Path, *extra: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    """:func:`pretrain`'s 2 ranks (commands and environments, :func:`launch.rank_launch`)."""
    small = json.loads((ROOT / "configs" / config).read_text())
    small.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)
    small.get("kfac", {}).pop("factor_micro_batches", None)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "configs" / config).write_text(json.dumps(small))
    script = [str(ROOT / "examples/bert/pretrain.py"), "--deepspeed_config", str(out / "configs" / config)]
    # The small corpus: the default one costs ~30 s to build and ~20 s per rank and launch to cut into pairs.
    script += ["--corpus", "stdlib"]
    return launch.rank_launch(2, [*script, "--output-dir", str(out), *extra])


def metrics(out: Path, run: str) -> list[dict[str, str]]:
    with (out / run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


PHASE1 = ("--max-steps", "30", "--eval-every", "15")


@pytest.fixture(scope="module")
def phase1_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phase 1 with K-FAC, 30 steps: the output directory (the embedded corpus's prepared shards there are shared by
    this module's later launches)."""
    out = tmp_path_factory.mktemp("bert")
    pretrain("bert_cpu_phase1_kfac.json", out, *PHASE1)
    return out


def test_phase1_then_phase2_from_its_checkpoint(phase1_run: Path) -> None:
    tmp_path = phase1_run
    phase1 = metrics(tmp_path, "bert_cpu_phase1_kfac")
    assert [int(r["step"]) for r in phase1] == list(range(1, 31))
    assert all(math.isfinite(float(r["loss"])) for r in phase1)
    assert (tmp_path / "bert_cpu_phase1_kfac/checkpoints/step30").is_dir()
    held = [float(r["held_out_mlm_loss"]) for r in phase1 if r["held_out_mlm_loss"]]
    assert len(held) == 2 and held[-1] < held[0]
    corpus = json.loads((tmp_path / "bert_cpu_phase1_kfac/corpus.json").read_text())
    assert corpus["embedded"] == "stdlib" and corpus["versions"] == {"python": platform.python_version()}
    assert len(corpus["digest"]) == 64 and corpus["train_pairs"] > 4000 and corpus["held_out_pairs"] > 100

    # A run directory as --init-checkpoint: its checkpoints/ and the tokenizer/ the run saved.
    assert (tmp_path / "bert_cpu_phase1_kfac/tokenizer/tokenizer.json").is_file()
    ckpt = str(tmp_path / "bert_cpu_phase1_kfac")
    # Only their first training losses are compared: one held-out micro-batch at the end (of the default 32) will do.
    phase2 = ("--max-steps", "2", "--eval-batches", "1")
    # Both launches side by side (one's launcher start-up overlaps the other's ranks): the fresh model in a directory
    # of its own (each run's rank 0 rewrites its output directory's summary.txt and loss.png from every run there)
    # with phase 1's shards (--cache-dir: nothing is prepared, only read).
    scratch = tmp_path / "scratch"
    config = "bert_cpu_phase2_kfac.json"
    from_phase1 = pretrain_ranks(config, tmp_path, *phase2, "--init-checkpoint", ckpt, "--run-name", "from_phase1")
    from_scratch = pretrain_ranks(config, scratch, *phase2, "--run-name", "from_scratch", "--cache-dir", str(tmp_path))
    launch.run(from_phase1[0] + from_scratch[0], timeout=300, rank_envs=from_phase1[1] + from_scratch[1], preload=True)
    first = {
        run: float(metrics(out, run)[0]["loss"]) for out, run in ((tmp_path, "from_phase1"), (scratch, "from_scratch"))
    }
    # Phase 2 starts where phase 1 ended (its last training losses: one batch of 32 varies by about 0.2), well below
    # a fresh model.
    ended = sum(float(r["loss"]) for r in phase1[-5:]) / 5
    assert first["from_phase1"] < first["from_scratch"] - 0.2, first
    assert abs(first["from_phase1"] - ended) < 0.2, (first, ended)
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert "from_phase1" in (tmp_path / "summary.txt").read_text()


def test_resume_continues_with_identical_losses(phase1_run: Path) -> None:
    """The phase-1 run again, stopped after step 20 (a checkpoint) and resumed: every step's losses, learning rate and
    evaluations equal the uninterrupted run's (data order, masks and dropout are functions of the step; the
    decompositions of steps 20 and 30 and the eigenbasis moments come from the checkpoint)."""
    tmp_path = phase1_run
    pretrain("bert_cpu_phase1_kfac.json", tmp_path, *PHASE1, "--run-name", "interrupted", "--stop-after", "20")
    assert len(metrics(tmp_path, "interrupted")) == 20
    pretrain("bert_cpu_phase1_kfac.json", tmp_path, *PHASE1, "--run-name", "interrupted", "--resume")
    straight, resumed = metrics(tmp_path, "bert_cpu_phase1_kfac"), metrics(tmp_path, "interrupted")
    assert [r["step"] for r in resumed] == [str(s) for s in range(1, 31)]
    assert len(list((tmp_path / "shards").glob("*/manifest.json"))) == 1  # prepared by the first run, then read
    for key in ("loss", "lr", "held_out_mlm_loss", "held_out_mlm_accuracy"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
