"""The BERT example's start-up at any corpus size: contents checked once and stamped (:mod:`stamps`), so a launch
or a resume reads no shard's contents unless it changed, and a keyed sample order that holds nothing per pair
(``examples/bert/{stamps,run_data,loading}.py``)."""

from __future__ import annotations

import json
import os
import sys
import tracemalloc
from pathlib import Path

import launch
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples/bert"))
import corpora  # noqa: E402
import loading  # noqa: E402
import prepare  # noqa: E402
import shards  # noqa: E402
import stamps  # noqa: E402

SEQ, VOCAB = 64, 600


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    """300 documents prepared into 3 shards."""
    (tmp_path / "text").mkdir()
    with (tmp_path / "text" / "corpus.txt").open("w") as f:
        for doc in corpora.stdlib_corpus()[:300]:
            f.write("\n".join(doc) + "\n\n")
    source = prepare.text_dir_source(tmp_path / "text", 30_000)
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    prepare.prepare(source, tmp_path / "shards", settings, VOCAB, sample_bytes=100_000, progress=False)
    return tmp_path / "shards"


def test_launches_check_only_what_changed_since_the_stamp(
    one_rank: None, prepared: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A launch on shards just prepared reads none of their contents (the preparation stamped them); a shard
    touched since is checked alone, then stamped; ``--verify-data`` checks them all (before: every launch and every
    resume hashed the whole corpus between the ranks)."""
    import pretrain

    config = json.loads((ROOT / "configs/bert_cpu_phase2_base.json").read_text())
    config.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    config["bert"].update(vocab_size=VOCAB)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hashed: list[str] = []
    digest = shards.files_digest
    monkeypatch.setattr(shards, "files_digest", lambda directory, *names: hashed.append(directory.name) or digest(directory, *names))

    def launch_once(*extra: str) -> list[str]:
        monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
        hashed.clear()
        data_args = ["--shards", str(prepared), "--output-dir", str(tmp_path / "out")]
        pretrain.main(["--deepspeed_config", str(tmp_path / "config.json"), *data_args, "--max-steps", "1", *extra])
        return sorted(hashed)

    assert launch_once() == []
    tokens = prepared / "shard-00001" / "tokens.npy"
    os.utime(tokens, ns=(tokens.stat().st_atime_ns, tokens.stat().st_mtime_ns + 1))  # touched: maybe changed
    assert launch_once() == ["shard-00001"]
    assert "checked the contents of 1 of 3 shards, stamped in" in capsys.readouterr().out
    assert launch_once() == []
    assert launch_once("--verify-data") == ["shard-00000", "shard-00001", "shard-00002"]


def test_a_stamp_the_data_directory_refuses_goes_to_the_cache(prepared: Path, tmp_path: Path) -> None:
    """Where the data's directory takes no stamp (read-only, here a directory in the stamp's place), it is written
    in the cache directory and read back from there; a stamp of another key (another manifest) covers nothing."""
    (prepared / stamps.NAME).unlink()
    (prepared / stamps.NAME).mkdir()
    opened = shards.ShardSet.open(prepared)
    stamp = stamps.Stamp(prepared, opened.manifest["digest"], tmp_path / "cache")
    assert stamp.unverified(opened.items()) == opened.names
    place = stamp.write(stamps.identities(opened.items()))
    assert place is not None and place.parent == tmp_path / "cache"
    assert stamps.Stamp(prepared, opened.manifest["digest"], tmp_path / "cache").unverified(opened.items()) == []
    assert stamps.Stamp(prepared, "another", tmp_path / "cache").unverified(opened.items()) == opened.names


def test_an_opened_corpus_holds_no_list_of_its_input_files(prepared: Path) -> None:
    """Every rank and loader worker holds the opened manifest: the input files' list (one entry per file of the
    corpus) is counted, not kept."""
    manifest = json.loads((prepared / shards.MANIFEST).read_text())
    assert len(manifest["source"]["files"]) == 1
    opened = shards.ShardSet.open(prepared)
    assert "files" not in opened.manifest["source"] and opened.manifest["source"]["input_files"] == 1
    assert opened.manifest["digest"] == manifest["digest"]


def test_the_keyed_order_holds_nothing_per_pair() -> None:
    """A step of the keyed order over a billion pairs allocates what the step's positions take (under 100 kB),
    where the recorded ``randperm`` order would hold 4 GB; its step is a slice of one permutation, as the recorded
    order's is (the bijection itself: test_bert_shards)."""
    order = loading.PairOrder(10**9, 8, 2, 2, 1, seed=3, kind="keyed")
    tracemalloc.start()
    keys = order.step(123_456)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100_000 and [len(rows) for _, rows in keys] == [8, 8]
    orders = [loading.PairOrder(10**9, 8, 2, 2, rank, 3, "keyed") for rank in (0, 1)]
    step = [i for order in orders for _, rows in order.step(9) for i in rows]
    window = loading.keyed_permutation(np.arange(9 * 32, 10 * 32), 10**9, 3 * 7919)
    assert sorted(step) == sorted(window.tolist())


def test_every_module_of_the_example_imports() -> None:
    """Every module of ``examples/bert`` imports, its names from the others resolved (a name moved between modules
    breaks a script no test launches, such as ``finetune_trainer.py``)."""
    import importlib

    for path in sorted((ROOT / "examples/bert").glob("*.py")):
        importlib.import_module(path.stem)
