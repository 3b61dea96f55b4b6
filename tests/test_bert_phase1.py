"""The BERT demo's phase-1 cache key (``examples/bert/phase1.py``): it changes with what phase 1 runs, and only that."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("transformers")  # The BERT example's own requirements, with tokenizers.
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bert_phase1", ROOT / "examples/bert/phase1.py")
phase1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(phase1)

KEPT = [
    "ds_kfac/optimizers/muon.py",
    "ds_kfac/optimizers/client.py",
    "ds_kfac/optimizers/__init__.py",
    "ds_kfac/integration/engine.py",
    "examples/bert/report.py",
    "examples/bert/nvidia.py",
    "examples/bert/stamps.py",
]
"""Files phase 1 does not run (or, for the package and the engine, does not build with): an edit keeps the key."""
CHANGED = [
    "ds_kfac/optimizers/lamb.py",
    "ds_kfac/optimizers/resolve.py",
    "ds_kfac/optimizers/common.py",  # imported by lamb.py
    "ds_kfac/optimizers/eigenbasis.py",  # imported by lamb.py and resolve.py
    "ds_kfac/optimizers/adam.py",  # imported by resolve.py
    "ds_kfac/integration/cuda_ops.py",  # imported by resolve.py (the arch list of a FusedLamb build)
    "ds_kfac/integration/initialize.py",
    "ds_kfac/integration/optimizer_setup.py",
    "examples/bert/pretrain.py",
    "examples/bert/recipe.py",
    "examples/bert/faults.py",
    "examples/bert/corpora.py",
    "examples/bert/wordpiece.py",
    "examples/bert/pairing.py",
    "examples/bert/masking.py",
    "examples/bert/sources.py",
    "examples/bert/corpus.py",
    "examples/bert/prepare.py",
    "examples/bert/out_dir.py",
    "examples/bert/shard_jobs.py",
    "examples/bert/shards.py",
    "examples/bert/loading.py",
    "examples/bert/run_data.py",
    "configs/bert_cpu_phase1_lamb.json",
    "configs/bert/bert-tiny.json",
]
"""Files phase 1 runs or reads: an edit makes a new key."""


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the repository's code and configs as ``phase1.ROOT``, with a stand-in corpus (building the real
    one takes minutes and is not what these tests are about)."""
    root = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__")
    for folder in ("ds_kfac", "examples/bert", "configs"):
        shutil.copytree(ROOT / folder, root / folder, ignore=skip)
    monkeypatch.setattr(phase1, "ROOT", root)
    monkeypatch.setattr(phase1.corpora, "embedded_corpus", lambda name, cache_dir: [["a sentence."]])
    return root


def _key(root: Path, tmp_path: Path) -> str:
    return phase1.key(root / "configs" / "bert_cpu_phase1_lamb.json", tmp_path / "cache", seed=0)


def test_code_files_are_the_example_lamb_and_its_imports() -> None:
    """The hashed code is exactly the example's loop and data, how initialize builds the JSON optimizer, and LAMB
    with its resolution and the ds_kfac modules those import (computed from their import statements)."""
    files = {str(p.relative_to(ROOT)) for p in phase1.code_files(ROOT)}
    assert files == {name for name in CHANGED if name.endswith(".py")}


@pytest.mark.parametrize("name", KEPT)
def test_an_edit_phase1_does_not_run_keeps_the_key(tree: Path, tmp_path: Path, name: str) -> None:
    """Issue 47, item 5: an edit to another optimizer (Muon, the client optimizers) or the K-FAC engine does not
    rebuild the 14-minute phase 1 (the key had hashed every file of ``ds_kfac/optimizers/``)."""
    before = _key(tree, tmp_path)
    with open(tree / name, "a") as file:
        file.write("\n# an unrelated edit\n")
    assert _key(tree, tmp_path) == before


@pytest.mark.parametrize("name", CHANGED)
def test_an_edit_phase1_runs_changes_the_key(tree: Path, tmp_path: Path, name: str) -> None:
    """An edit to LAMB, its resolution, what they import, the example or its configs makes a new phase 1."""
    before = _key(tree, tmp_path)
    path = tree / name
    path.write_text(path.read_text().replace("\n", "\n ", 1) if name.endswith(".json") else path.read_text() + "#\n")
    assert _key(tree, tmp_path) != before
