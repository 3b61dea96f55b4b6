"""BERT pretraining data: corpora, WordPiece tokenizer and its cache, document split, NSP pairs, MLM masking."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")  # The BERT example's own requirements, with tokenizers.
pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).parents[1] / "examples/bert"))
import corpora  # noqa: E402
import masking  # noqa: E402
import pairing  # noqa: E402
import sources  # noqa: E402
import wordpiece  # noqa: E402

BATCH_KEYS = {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}


@pytest.fixture(scope="module")
def corpus() -> list[list[str]]:
    return corpora.embedded_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return wordpiece.train_tokenizer(corpus)


@pytest.fixture(scope="module")
def examples(corpus, tokenizer) -> list:
    return pairing.build_examples(corpus, tokenizer, max_seq_length=128, seed=0)


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[k : k + len(needle)] == needle for k in range(len(haystack) - len(needle) + 1))


# --------------------------------------------------------------------------- corpora


def test_embedded_corpus_is_deterministic_prose(corpus) -> None:
    assert corpora.embedded_corpus() == corpus
    sentences = [s for doc in corpus for s in doc]
    size_mb = sum(len(s.encode()) for s in sentences) / 1e6
    print(f"\nembedded corpus: {len(corpus)} documents, {len(sentences)} sentences, {size_mb:.2f} MB")
    assert len(corpus) > 1000 and size_mb > 0.3
    assert all(len(doc) >= 2 for doc in corpus)
    assert not any(s.startswith((">>>", "...")) or s != " ".join(s.split()) for s in sentences)


def test_embedded_corpus_ignores_rebound_hooks(corpus, monkeypatch) -> None:
    import threading

    def hook(*args: object) -> None:
        """A replacement hook. It has two sentences."""

    for module, name in [(sys, "excepthook"), (sys, "unraisablehook"), (threading, "excepthook")]:
        monkeypatch.setattr(module, name, hook)
    assert corpora.embedded_corpus() == corpus


FIXTURE_PACKAGE = "ds_kfac_corpus_fixture"
FIXTURE_FILES = {
    "__init__.py": '"""The fixture package. It must never be imported by the corpus builder."""\n'
    'raise RuntimeError("imported")\n',
    "a.py": '"""Module a comes first. Its files sort before b."""\n\n\n'
    'def helper():\n    """Turn the widget once. Nothing else happens."""\n',
    "b.py": '''"""Module b comes second. Classes, methods and nested functions count."""


class Widget:
    """A widget holds parts. It has methods too.

    >>> Widget().turn()
    """

    def turn(self):
        """Turn the widget once. Nothing else happens."""

        def inner():
            """Nested functions count too. They are found in source order."""

    async def spin(self):
        """One sentence is not enough."""


try:
    import nothing_here
except ImportError:

    def fallback():
        """Fallbacks count as well. They sit in an except block."""
''',
    "broken.py": 'def f(:\n    """Never read at all. The file does not parse."""\n',
    "tests/test_x.py": '"""Tests are skipped here. Their prose is never read."""\n',
    "sub/c.py": '"""Subpackages are read too. Their paths sort with the rest."""\n\n\n'
    'def again():\n    """Subpackages are read too. Their paths sort with the rest.\n\n    >>> again()\n    """\n',
}
FIXTURE_DOCUMENTS = [
    ["The fixture package.", "It must never be imported by the corpus builder."],
    ["Module a comes first.", "Its files sort before b."],
    ["Turn the widget once.", "Nothing else happens."],
    ["Module b comes second.", "Classes, methods and nested functions count."],
    ["A widget holds parts.", "It has methods too."],  # The doctest line is dropped.
    ["Nested functions count too.", "They are found in source order."],  # turn's docstring is a duplicate.
    ["Fallbacks count as well.", "They sit in an except block."],
    ["Subpackages are read too.", "Their paths sort with the rest."],  # again's sentences are a duplicate.
]


@pytest.fixture
def fixture_package(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "site" / FIXTURE_PACKAGE
    for name, text in FIXTURE_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return root


def test_docstring_corpus_parses_sources_without_importing(fixture_package) -> None:
    documents = corpora.docstring_corpus(packages=[FIXTURE_PACKAGE], stdlib=False)
    assert documents == FIXTURE_DOCUMENTS
    assert FIXTURE_PACKAGE not in sys.modules
    assert corpora.docstring_corpus(packages=[FIXTURE_PACKAGE, "no_such_package_here"], stdlib=False) == documents


def test_docstring_corpus_cache(fixture_package, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "corpus-cache"
    first = corpora.docstring_corpus(packages=[FIXTURE_PACKAGE], stdlib=False, cache_dir=cache)
    (cached,) = cache.iterdir()
    mtime = cached.stat().st_mtime_ns

    def no_parsing(*args, **kwargs):
        raise AssertionError("parsed although the corpus is cached")

    with monkeypatch.context() as patch:
        patch.setattr(corpora, "_source_docstrings", no_parsing)
        again = corpora.docstring_corpus(packages=[FIXTURE_PACKAGE], stdlib=False, cache_dir=cache)
    assert again == first == FIXTURE_DOCUMENTS and corpora.corpus_digest(again) == corpora.corpus_digest(first)
    assert cached.stat().st_mtime_ns == mtime and list(cache.iterdir()) == [cached]
    # A changed source file (its size) is another cache entry.
    with (fixture_package / "sub/c.py").open("a") as f:
        f.write('\n\ndef more():\n    """A new function appears. It changes the corpus."""\n')
    changed = corpora.docstring_corpus(packages=[FIXTURE_PACKAGE], stdlib=False, cache_dir=cache)
    assert changed == FIXTURE_DOCUMENTS + [["A new function appears.", "It changes the corpus."]]
    assert len(list(cache.iterdir())) == 2


def test_docstring_corpus_of_installed_packages(tmp_path: Path) -> None:
    # Two small real packages: the full "packages" corpus takes ~30 s (test_packages_corpus_size builds it).
    packages = ["filelock", "tqdm"]
    first = corpora.docstring_corpus(packages=packages, stdlib=False, cache_dir=tmp_path)
    assert corpora.docstring_corpus(packages=packages, stdlib=False) == first
    assert corpora.docstring_corpus(packages=packages, stdlib=False, cache_dir=tmp_path) == first
    sentences = [s for doc in first for s in doc]
    assert len(first) > 100 and all(len(doc) >= 2 for doc in first)
    assert not any(s.startswith((">>>", "...")) or s != " ".join(s.split()) for s in sentences)
    assert len({tuple(doc) for doc in first}) == len(first)
    (cached,) = tmp_path.iterdir()
    recorded = json.loads(cached.read_text())["sources"]
    assert recorded == {name: importlib.metadata.version(name) for name in packages}


def test_corpus_sources() -> None:
    sources = corpora.corpus_sources("packages")
    assert list(sources)[0] == "python" and sources["python"] == platform.python_version()
    assert list(sources)[1:] == sorted(list(sources)[1:])  # The standard library, then the packages by name.
    assert {"torch", "transformers", "deepspeed", "numpy", "tokenizers"} <= set(sources)
    for name, version in list(sources.items())[1:]:
        assert version == importlib.metadata.version(corpora.CORPUS_PACKAGES[name]), name
    assert corpora.corpus_sources("stdlib") == {"python": platform.python_version()}
    with pytest.raises(ValueError, match="unknown embedded corpus 'wiki'"):
        corpora.corpus_sources("wiki")


@pytest.mark.skipif(
    not os.environ.get("BERT_FULL_CORPUS"), reason="builds the full corpus (~1 min); set BERT_FULL_CORPUS=1"
)
def test_packages_corpus_size(tmp_path: Path, corpus) -> None:
    """The default "packages" corpus gives 20x the "stdlib" corpus's training pairs at the CPU demo's settings."""
    started = time.perf_counter()
    packages = corpora.embedded_corpus("packages", cache_dir=tmp_path)
    built = time.perf_counter() - started
    started = time.perf_counter()
    assert corpora.embedded_corpus("packages", cache_dir=tmp_path) == packages
    loaded = time.perf_counter() - started
    assert corpora.docstring_corpus() == packages  # Deterministic, with or without the cache.

    def pairs(documents: list[list[str]]) -> int:  # As pretrain.py builds them with configs/bert_cpu_phase1_*.json.
        train, _ = pairing.split_documents(documents, held_out_fraction=0.05, seed=0)
        return len(pairing.build_examples(train, wordpiece.train_tokenizer(train, 1024), 64, seed=0))

    sentences = [s for doc in packages for s in doc]
    size_mb = sum(len(s.encode()) for s in sentences) / 1e6
    small, large = pairs(corpus), pairs(packages)
    print(
        f"\n'packages' corpus {corpora.corpus_digest(packages)[:16]}: {len(packages)} documents, {len(sentences)} "
        f"sentences, {size_mb:.2f} MB, built in {built:.1f} s, loaded from the cache in {loaded:.1f} s; "
        f"{large} training pairs ('stdlib': {small})"
    )
    assert large >= 20 * small and built < 120 and loaded < 5


def test_split_sentences() -> None:
    assert corpora.split_sentences("One here.  Two, e.g. this?   Three!  four") == [
        "One here.",
        "Two, e.g. this?",
        "Three!",
        "four",
    ]


def test_read_text_dir(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("First of b.\nSecond of b. Third of b.\n\n\n  \nAnother doc.\n")
    (tmp_path / "a.txt").write_text("\nOnly doc of a.\nIts second line.")
    (tmp_path / "notes.md").write_text("Not a text file.\n")
    assert sources.read_text_dir(tmp_path) == [
        ["Only doc of a.", "Its second line."],
        ["First of b.", "Second of b.", "Third of b."],
        ["Another doc."],
    ]
    assert sources.load_corpus(text_dir=tmp_path) == sources.read_text_dir(str(tmp_path))


def test_read_text_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sources.read_text_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no \.txt files"):
        sources.read_text_dir(tmp_path)
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(ValueError, match="hold no text"):
        sources.read_text_dir(tmp_path)


def test_read_hf_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rows = {"id": [0, 1, 2], "text": ["One. Two.", "", "Three? Four!\nA line\n\nFive."]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    expected = [["One.", "Two."], ["Three?", "Four!", "A line", "Five."]]
    assert sources.read_hf_dataset(tmp_path / "plain") == expected
    assert sources.load_corpus(hf_dataset=tmp_path / "plain") == expected

    splits = {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict({"text": ["Held."]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    assert sources.read_hf_dataset(tmp_path / "dict") == expected

    datasets.DatasetDict({"validation": splits["test"]}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match=r"no 'train' split \(splits: \['validation'\]\)"):
        sources.read_hf_dataset(tmp_path / "no_train")
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: \['id', 'text'\]\)"):
        sources.read_hf_dataset(tmp_path / "plain", text_column="body")


def test_load_corpus_sources(tmp_path: Path, corpus) -> None:
    with pytest.raises(ValueError, match="not both"):
        sources.load_corpus(text_dir=tmp_path, hf_dataset=tmp_path)
    assert sources.load_corpus() == sources.load_corpus(embedded="stdlib") == corpora.embedded_corpus("stdlib") == corpus
    with pytest.raises(ValueError, match="unknown embedded corpus 'wiki'"):
        sources.load_corpus(embedded="wiki")


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(corpus, tokenizer) -> None:
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(5)] == wordpiece.SPECIAL_TOKENS
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2, 3, 4]
    ascii_sentences = [s for doc in corpus for s in doc if s.isascii() and max(map(len, s.split())) < 40]
    sample = ascii_sentences[::20]
    assert len(sample) > 200
    # Words of letters and digits, with at most trailing , . ? or !, decode to exactly the lowercased text.
    plain = [s for s in sample if all(re.fullmatch(r"[A-Za-z0-9]+[,.?!]?", word) for word in s.split())]
    assert len(plain) > 50
    for text in sample:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        assert tokenizer.unk_token_id not in ids, text
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(decoded.split()) == "".join(text.lower().split()), text
        if text in plain:
            assert decoded == " ".join(text.lower().split())
    pair = tokenizer("First part.", "Second part.")
    first_sep = pair["input_ids"].index(tokenizer.sep_token_id)
    assert pair["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(pair["input_ids"]) - first_sep - 1)


def test_tokenizer_training_is_deterministic(corpus) -> None:
    # Guards the workaround for huggingface/tokenizers#1794 (vocabularies that differ from run to run).
    subset = corpus[: len(corpus) // 4]
    vocabs = [wordpiece.train_tokenizer(subset, vocab_size=2000).get_vocab() for _ in range(3)]
    assert len(vocabs[0]) == 2000 and vocabs[0] == vocabs[1] == vocabs[2]


def test_tokenizer_cache(tmp_path: Path, corpus, monkeypatch) -> None:
    subset = corpus[:300]
    first = wordpiece.train_tokenizer(subset, vocab_size=600, cache_dir=tmp_path)
    (cached,) = tmp_path.iterdir()
    mtime = cached.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the tokenizer is cached")

    with monkeypatch.context() as patch:
        patch.setattr(wordpiece, "train_wordpiece", no_training)
        second = wordpiece.train_tokenizer(subset, vocab_size=600, cache_dir=tmp_path)
    assert second.get_vocab() == first.get_vocab()
    assert second("Return the value.")["input_ids"] == first("Return the value.")["input_ids"]
    assert cached.stat().st_mtime_ns == mtime and list(tmp_path.iterdir()) == [cached]
    # Another vocabulary size or corpus is another cache entry.
    wordpiece.train_tokenizer(subset, vocab_size=500, cache_dir=tmp_path)
    wordpiece.train_tokenizer(subset[:-1], vocab_size=600, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3


# --------------------------------------------------------------------------- held-out split


def test_split_documents_by_document() -> None:
    documents = [[f"Document {i} opens.", f"Document {i} closes."] for i in range(500)]
    train, held = pairing.split_documents(documents, held_out_fraction=0.02, seed=0)
    assert len(held) == 10 and len(train) == 490
    assert not {d[0] for d in train} & {d[0] for d in held}
    assert sorted(train + held) == sorted(documents)
    assert train == sorted(train, key=documents.index) and held == sorted(held, key=documents.index)
    assert pairing.split_documents(documents, 0.02, seed=0) == (train, held)
    assert pairing.split_documents(documents, 0.02, seed=1)[1] != held
    assert len(pairing.split_documents(documents[:3], 0.02)[1]) == 1
    with pytest.raises(ValueError, match="held_out_fraction"):
        pairing.split_documents(documents, 1.0)


# --------------------------------------------------------------------------- NSP pairs and masking


def test_nsp_pairs(corpus, tokenizer, examples) -> None:
    """BERT's instances: [CLS] A [SEP] B [SEP] within 128 tokens, NSP a fair coin, each segment a contiguous run of
    its source sentences' tokens (truncation trims only the ends), B after A in A's document for label 0 and from
    another document for label 1. Checked against the sentences tokenized one by one."""
    random_next = [e for e in examples if e.next_sentence_label == 1]
    fraction = len(random_next) / len(examples)
    print(f"\n{len(examples)} examples, is_random_next fraction {fraction:.4f}")
    assert abs(fraction - 0.5) < 0.03

    documents = [
        [tokenizer(s, add_special_tokens=False)["input_ids"] for s in doc] for doc in corpus
    ]  # each sentence on its own, not through encode_flat
    flat = [t for doc in documents for sentence in doc for t in sentence]
    owner = [d for d, doc in enumerate(documents) for sentence in doc for _ in sentence]  # each token's document
    starts: dict[tuple[int, ...], list[int]] = {}  # where each 1-gram and 6-gram of the flat ids starts
    for k in range(len(flat)):
        starts.setdefault(tuple(flat[k : k + 1]), []).append(k)
        starts.setdefault(tuple(flat[k : k + 6]), []).append(k)

    def places(tokens: list[int]) -> list[int]:
        """Where ``tokens`` lie contiguously in the flat ids."""
        key = tuple(tokens[:6] if len(tokens) >= 6 else tokens[:1])
        return [k for k in starts.get(key, []) if flat[k : k + len(tokens)] == tokens]

    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    checked = 0
    for e in examples[::7]:
        ids = e.input_ids
        sep = ids.index(sep_id)
        tokens_a, tokens_b = ids[1:sep], ids[sep + 1 : -1]
        assert len(ids) <= 128 and ids[0] == cls_id and ids[-1] == sep_id and tokens_a and tokens_b
        assert e.token_type_ids == [0] * (sep + 1) + [1] * (len(ids) - sep - 1)
        assert e.special_mask == [int(i in (0, sep, len(ids) - 1)) for i in range(len(ids))]
        a_at, b_at = places(tokens_a), places(tokens_b)
        assert a_at and b_at  # contiguous runs of the corpus's tokens
        docs_a = {owner[k] for k in a_at if owner[k] == owner[k + len(tokens_a) - 1]}
        docs_b = {owner[k] for k in b_at if owner[k] == owner[k + len(tokens_b) - 1]}
        assert docs_a and docs_b  # each within one document
        if e.next_sentence_label == 0:
            assert any(b >= a + len(tokens_a) and owner[a] == owner[b] for a in a_at for b in b_at)
        else:
            assert any(owner[a] != owner[b] for a in a_at for b in b_at)
        checked += 1
    assert checked > 100
    assert pairing.build_examples(corpus, tokenizer, seed=0) == examples
    assert pairing.build_examples(corpus, tokenizer, seed=1) != examples
    with pytest.raises(ValueError, match="at least two documents"):
        pairing.build_examples(corpus[:1], tokenizer)


def test_masking_rates(tokenizer, examples) -> None:
    dataset = masking.PretrainingDataset(examples, tokenizer, seed=0)
    special_ids = set(tokenizer.all_special_ids)
    candidates = chosen = masked = replaced = kept = 0
    for index, example in enumerate(examples):
        item = dataset[index]
        assert item["token_type_ids"] == example.token_type_ids
        for pos, (original, special) in enumerate(zip(example.input_ids, example.special_mask)):
            new, label = item["input_ids"][pos], item["labels"][pos]
            if special:
                assert label == -100 and new == original
                continue
            candidates += 1
            if label == -100:
                assert new == original
                continue
            assert label == original
            chosen += 1
            if new == tokenizer.mask_token_id:
                masked += 1
            elif new != original:
                assert new not in special_ids
                replaced += 1
            else:
                kept += 1
    print(
        f"\n{candidates} maskable tokens: chosen {chosen / candidates:.4f}; of chosen [MASK] {masked / chosen:.4f}, "
        f"random {replaced / chosen:.4f}, unchanged {kept / chosen:.4f}"
    )
    # ~250k maskable tokens, ~37k chosen: one standard error is below 0.001 for the chosen rate and
    # 0.002 for the 80/10/10 split (a random draw equal to the original counts as unchanged: p ~ 1e-4).
    assert abs(chosen / candidates - 0.15) < 0.01
    assert abs(masked / chosen - 0.8) < 0.02
    assert abs(replaced / chosen - 0.1) < 0.02
    assert abs(kept / chosen - 0.1) < 0.02


def test_dynamic_masking_is_deterministic(tokenizer, examples) -> None:
    first = masking.PretrainingDataset(examples[:50], tokenizer, seed=0)
    again = masking.PretrainingDataset(examples[:50], tokenizer, seed=0)
    assert [first[i] for i in reversed(range(50))][::-1] == [again[i] for i in range(50)]
    other_seed = masking.PretrainingDataset(examples[:50], tokenizer, seed=1)
    assert [other_seed[i]["labels"] for i in range(50)] != [first[i]["labels"] for i in range(50)]
    before = [first[i]["labels"] for i in range(50)]
    first.set_epoch(1)
    assert [first[i]["labels"] for i in range(50)] != before


# --------------------------------------------------------------------------- batches and the model


def test_collate_feeds_bert_for_pretraining(tokenizer, examples) -> None:
    forward_kwargs = set(inspect.signature(transformers.BertForPreTraining.forward).parameters)
    assert BATCH_KEYS <= forward_kwargs

    dataset = masking.PretrainingDataset(examples, tokenizer, seed=0)
    by_length = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    indices = by_length[:: len(by_length) // 7][:8]  # Lengths from shortest to longest: padding needed.
    items = [dataset[i] for i in indices]
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    assert lengths.min() < lengths.max()
    batch = masking.collate(items, pad_token_id=tokenizer.pad_token_id)

    assert set(batch) == BATCH_KEYS
    assert all(value.dtype == torch.long for value in batch.values())
    size, length = len(items), int(lengths.max())
    for key in BATCH_KEYS - {"next_sentence_label"}:
        assert batch[key].shape == (size, length), key
    assert batch["next_sentence_label"].shape == (size,)
    padding = torch.arange(length)[None, :] >= lengths[:, None]
    assert torch.equal(batch["attention_mask"], (~padding).long())
    assert (batch["labels"][padding] == -100).all() and (batch["input_ids"][padding] == tokenizer.pad_token_id).all()
    assert (batch["token_type_ids"][padding] == 0).all()
    for row, item in enumerate(items):
        assert batch["input_ids"][row, : lengths[row]].tolist() == item["input_ids"]
        assert batch["labels"][row, : lengths[row]].tolist() == item["labels"]

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    model = transformers.BertForPreTraining(config)
    output = model(**batch)
    assert output.loss.ndim == 0 and math.isfinite(output.loss.item())
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, collate_fn=masking.collate)
    assert math.isfinite(model(**next(iter(loader))).loss.item())
