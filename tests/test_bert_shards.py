"""The BERT example's data at scale: pieces of a corpus, prepared shards (written atomically, resumed, checked before
step 1), the sample order, and NVIDIA's HDF5 shards read as they are (``examples/bert/{sources,prepare,shards,
loading,nvidia}.py``)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")
h5py = pytest.importorskip("h5py")

sys.path.insert(0, str(Path(__file__).parents[1] / "examples/bert"))
import corpora  # noqa: E402
import loading  # noqa: E402
import masking  # noqa: E402
import nvidia  # noqa: E402
import out_dir  # noqa: E402
import pairing  # noqa: E402
import prepare  # noqa: E402
import shard_jobs  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402
import stamps  # noqa: E402
import wordpiece  # noqa: E402

SEQ = 64


# --------------------------------------------------------------------------- the sample order


def test_pair_order_is_the_examples_recorded_order() -> None:
    """Each step's micro-batches are what the example has always drawn, written here as it was: the epoch's
    ``torch.randperm`` (seed ``seed * 7919 + epoch``), the step's slice laid out as (accumulation, rank, micro-batch)
    (and in int32, the same permutation as in int64)."""
    count, micro, accum, world, seed = 1000, 8, 2, 2, 3
    orders = [loading.PairOrder(count, micro, accum, world, rank, seed, "randperm") for rank in range(world)]
    global_batch = micro * accum * world
    for step in (0, 1, 30, 31, 62, 100):
        epoch, position = divmod(step, count // global_batch)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        rows = order[position * global_batch : (position + 1) * global_batch].view(accum, world, micro)
        for rank in range(world):
            assert orders[rank].step(step) == [(epoch, tuple(rows[m, rank].tolist())) for m in range(accum)]
    assert loading.epoch_order(count, 5).dtype == np.int32


@pytest.mark.parametrize("kind", loading.ORDERS)
def test_pair_order_is_the_same_global_batch_at_every_world_size(kind: str) -> None:
    """A step's global batch is a function of (seed, step) alone: 1, 2 and 4 ranks with the same global batch of 32
    train on the same pairs in every step, and in the same order (accumulation, then rank, then micro-batch); an
    epoch never repeats a pair and leaves out only its last partial batch; a resume at step s reproduces step s."""
    count, seed = 1000, 7

    def global_batches(world: int, accum: int) -> list[list[int]]:
        micro = 32 // (world * accum)
        orders = [loading.PairOrder(count, micro, accum, world, rank, seed, kind) for rank in range(world)]
        steps = []
        for step in range(70):
            per_rank = [order.step(step) for order in orders]
            epochs = {epoch for keys in per_rank for epoch, _ in keys}
            assert epochs == {step // orders[0].steps_per_epoch}
            steps.append([i for m in range(accum) for keys in per_rank for i in keys[m][1]])
        return steps

    reference = global_batches(1, 1)
    assert global_batches(2, 2) == reference == global_batches(4, 1) == global_batches(1, 4)
    steps_per_epoch = count // 32
    first_epoch = [i for batch in reference[:steps_per_epoch] for i in batch]
    assert len(set(first_epoch)) == len(first_epoch) == steps_per_epoch * 32
    assert reference[steps_per_epoch] != reference[0]  # the next epoch draws another order
    assert loading.StepKeys(loading.PairOrder(count, 8, 2, 2, 1, seed, kind), 40, 42).__len__() == 4
    assert list(loading.StepKeys(loading.PairOrder(count, 8, 2, 2, 1, seed, kind), 40, 42)) == [
        *loading.PairOrder(count, 8, 2, 2, 1, seed, kind).step(40),
        *loading.PairOrder(count, 8, 2, 2, 1, seed, kind).step(41),
    ]
    with pytest.raises(ValueError, match="cannot fill one global batch of 32"):
        loading.PairOrder(31, 8, 2, 2, 0, seed)


def test_keyed_permutation_is_a_bijection_of_the_range_and_holds_nothing_of_it() -> None:
    """The keyed order maps ``range(count)`` onto itself one to one, for counts at and between powers of two; another
    seed gives another order, the same seed the same one from any slice of positions (a step needs its own only)."""
    for count in (1, 2, 3, 5, 64, 100, 1000, 4097, 65_537):
        image = loading.keyed_permutation(np.arange(count), count, seed=11)
        assert np.array_equal(np.sort(image), np.arange(count)), count
        assert np.array_equal(loading.keyed_permutation(np.arange(count)[count // 3 :], count, 11), image[count // 3 :])
    other = loading.keyed_permutation(np.arange(1000), 1000, seed=12)
    assert not np.array_equal(other, loading.keyed_permutation(np.arange(1000), 1000, seed=11))
    assert abs(np.corrcoef(other, np.arange(1000))[0, 1]) < 0.1  # no trace of the identity
    big = loading.keyed_permutation(np.array([0, 10**9 + 6]), 10**9 + 7, seed=3)  # far past any held table
    assert len(set(big.tolist())) == 2 and big.max() < 10**9 + 7


def test_held_out_keys_take_the_front_of_every_shard() -> None:
    """Evaluation scores pairs from the front of every shard, as evenly as the shards allow: one shard gives its first
    pairs; shards too small for their share leave it to the others; never more than there are."""
    assert loading.held_out_keys(np.array([0, 100]), 10, 4) == [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)), (0, (8, 9))]
    keys = loading.held_out_keys(np.array([0, 50, 52, 52, 90]), 12, 6)
    assert keys == [(0, (0, 1, 2, 3, 4, 50)), (0, (51, 52, 53, 54, 55, 56))]
    assert [i for _, batch in loading.held_out_keys(np.array([0, 2, 3]), 10, 8) for i in batch] == [0, 1, 2]


# --------------------------------------------------------------------------- pieces of a corpus


def _write_corpus(root: Path, documents: int, seed: int = 0) -> list[list[str]]:
    """Text files in the prepared layout (a sentence per line, a blank line between documents; one file of many
    documents, one of a single document, an empty one); the documents written, in order."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega tensor gradient layer".split()
    written = []
    root.mkdir(parents=True, exist_ok=True)
    files = {"a.txt": documents - 1, "b.txt": 1, "c.txt": 0}
    for name, count in files.items():
        with (root / name).open("w") as f:
            for _ in range(count):
                doc = [
                    " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + "."
                    for _ in range(rng.randint(1, 6))
                ]
                written.append(doc)
                f.write("\n".join(doc) + "\n\n")
    (root / "notes.md").write_text("Not a text file.\n")
    return written


@pytest.mark.parametrize("piece_bytes", [300, 2_000, 1 << 30])
def test_text_pieces_cut_at_documents(tmp_path: Path, piece_bytes: int) -> None:
    """Pieces are cut only at blank lines (their documents, read one piece at a time, are the corpus's), small
    files are grouped, and no last piece is under half a piece unless it is the only one."""
    written = _write_corpus(tmp_path, 200)
    pieces = sources.text_dir_pieces(tmp_path, piece_bytes)
    assert [doc for piece in pieces for doc in piece.read()[0]] == written == sources.read_text_dir(tmp_path)
    sizes = [piece.text_bytes for piece in pieces]
    assert sum(sizes) == sum((tmp_path / n).stat().st_size for n in ("a.txt", "b.txt", "c.txt"))
    assert len(pieces) == 1 or (min(sizes[:-1]) >= piece_bytes and sizes[-1] >= piece_bytes // 2)
    if piece_bytes > 1 << 20:
        assert len(pieces) == 1 and len(pieces[0].reader.ranges) == 3  # the three files grouped


def test_text_pieces_refuse_bad_input(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sources.text_dir_pieces(tmp_path / "missing", 100)
    with pytest.raises(FileNotFoundError, match=r"no \.txt files"):
        sources.text_dir_pieces(tmp_path, 100)
    (tmp_path / "bad.txt").write_bytes(b"Fine text.\n\nThen \xff bad.\n")
    (piece,) = sources.text_dir_pieces(tmp_path, 100)
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 text at byte 17 \(invalid start byte\)"):
        piece.read()


def test_dataset_pieces(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    texts = [f"Row {i} opens. It goes on a while here? Row {i} ends!" if i % 5 else "" for i in range(100)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    pieces = sources.hf_dataset_pieces(tmp_path / "saved", "text", 500)
    assert len(pieces) > 5 and [p.reader.start for p in pieces] == sorted(p.reader.start for p in pieces)
    documents = [doc for piece in pieces for doc in piece.read()[0]]
    assert documents == sources.read_hf_dataset(tmp_path / "saved") and len(documents) == 80
    assert documents[0] == ["Row 1 opens.", "It goes on a while here?", "Row 1 ends!"]
    # Prepared as a text directory is: a shard a piece, its documents all there.
    source = prepare.hf_dataset_source(tmp_path / "saved", "text", 2_000)
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    manifest = prepare.prepare(source, tmp_path / "shards", settings, 100, sample_bytes=10_000, progress=False)
    assert len(manifest["shards"]) == len(source.pieces) > 1 and manifest["totals"]["documents"] == 80
    assert manifest["source"]["rows"] == 100 and len(manifest["source"]["fingerprint"]) > 8


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", r"a config must be a JSON object, got list"),
        ("7", r"a config must be a JSON object, got int"),
        ('"bert"', r"a config must be a JSON object, got str"),
        ('{"bert": []}', r"'bert' must be a JSON object, got list"),
        ('{"bert": {"max_seq_len": 64}}', r"unknown 'bert' keys \['max_seq_len'\]"),
        ('{"bert": {"vocab_size": 0}}', r"bert\.vocab_size must be a positive integer, got 0"),
        ("{oops", r"cannot read the config"),
    ],
)
def test_a_config_of_the_wrong_kind_is_one_line_before_anything_runs(
    tmp_path: Path, capsys, text: str, message: str
) -> None:
    """``prepare.py`` (and ``pretrain.py``, through the same ``recipe.read_config``) on a config that is not what it
    reads: one line naming the file and the problem, a non-zero exit, no traceback, nothing written."""
    config = tmp_path / "bad.json"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        prepare.main(["--corpus", "stdlib", "--deepspeed_config", str(config), "--out", str(tmp_path / "out")])
    line = str(exit_.value.code)
    assert line.startswith(f"prepare.py: error: {config}: ") and "\n" not in line and re.search(message, line), line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- preparation


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 short documents of the stdlib corpus as text files, cut into 4 pieces of about 25 kB."""
    root = tmp_path_factory.mktemp("corpus")
    documents = corpora.stdlib_corpus()[:400]
    for part in range(2):
        with (root / f"part-{part}.txt").open("w") as f:
            for doc in documents[part::2]:
                f.write("\n".join(doc) + "\n\n")
    return root


PIECE = 25_000


def _prepare(corpus: Path, out: Path, workers: int = 1, **kwargs) -> dict:
    source = prepare.text_dir_source(corpus, PIECE)
    settings = prepare.Settings(SEQ, held_out_fraction=0.1, seed=kwargs.pop("seed", 0))
    return prepare.prepare(source, out, settings, 600, workers=workers, sample_bytes=100_000, progress=False, **kwargs)


@pytest.fixture(scope="module")
def prepared(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "shards"
    _prepare(corpus_dir, out)
    return out


def test_preparation_is_the_same_with_two_workers(corpus_dir: Path, prepared: Path, tmp_path: Path) -> None:
    """Deterministic for a seed whatever the number of workers: the same manifest (digests of every array), from
    worker processes."""
    manifest = json.loads((prepared / shards.MANIFEST).read_text())
    assert len(manifest["shards"]) == 4 and manifest["totals"]["held_out_pairs"] > 20
    assert _prepare(corpus_dir, tmp_path / "two", workers=2) == manifest
    assert _prepare(corpus_dir, tmp_path / "seed1", seed=1)["text_digest"] == manifest["text_digest"]
    assert json.loads((tmp_path / "seed1" / shards.MANIFEST).read_text())["digest"] != manifest["digest"]


def test_one_piece_is_split_and_paired_as_in_memory(tmp_path: Path) -> None:
    """A corpus of one piece (the embedded ones) is prepared as the in-memory functions build it with the seed:
    ``pairing.split_documents`` (held-out documents), ``wordpiece.train_tokenizer`` on the training documents, and
    ``pairing.build_examples`` of each split (training pairs with the seed, held-out ones with the seed plus one)."""
    documents = corpora.stdlib_corpus()[:600]
    source = prepare.Source(sources.document_pieces(documents, 1 << 30), {"test": 1}, tmp_path)
    settings = prepare.Settings(SEQ, held_out_fraction=0.05, seed=3)
    prepare.prepare(source, tmp_path / "shards", settings, 600, progress=False)
    opened = shards.ShardSet.open(tmp_path / "shards")
    train, held = pairing.split_documents(documents, 0.05, seed=3)
    tokenizer = wordpiece.train_tokenizer(train, 600)
    assert opened.tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    for split, docs, seed in (("train", train, 3), ("held_out", held, 4)):
        examples = pairing.build_examples(docs, tokenizer, SEQ, seed=seed)
        assert opened.size(split) == len(examples) > 10
        assert [opened.example(split, i, 2, 3) for i in range(len(examples))] == examples


def test_shards_hold_the_corpus_pairs_and_keep_held_out_text_out(corpus_dir: Path, prepared: Path) -> None:
    """Every training and held-out instance decodes to runs of one piece's documents' sentences, tokenized one by
    one here; held-out instances come from held-out documents only, training ones from training documents only
    (no held-out text is ever trained on), and label 0 pairs continue within a document."""
    opened = shards.ShardSet.open(prepared, SEQ, 600)
    tokenizer = opened.tokenizer()
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    for index, piece in enumerate(prepare.text_dir_source(corpus_dir, PIECE).pieces):
        documents, _ = piece.read()
        train, held = shard_jobs.split_piece(documents, settings, index)
        for split, docs in (("train", train), ("held_out", held)):
            texts = [[tokenizer(s, add_special_tokens=False)["input_ids"] for s in doc] for doc in docs]
            flat = {d: [t for s in doc for t in s] for d, doc in enumerate(texts)}
            pairs = np.load(prepared / shards.shard_name(index) / shards.SPLITS[split])
            start = int(opened.starts[split][index])
            assert len(pairs) == opened.starts[split][index + 1] - start > 0
            for k in range(len(pairs)):
                example = opened.example(split, start + k, cls_id, sep_id)
                sep = example.input_ids.index(sep_id)
                a, b = example.input_ids[1:sep], example.input_ids[sep + 1 : -1]
                where_a = [d for d, ids in flat.items() if _inside(a, ids)]
                where_b = [d for d, ids in flat.items() if _inside(b, ids)]
                assert where_a and where_b, (split, index, k)
                if example.next_sentence_label == 0:
                    assert set(where_a) & set(where_b)


def _inside(needle: list[int], haystack: list[int]) -> bool:
    return any(haystack[k : k + len(needle)] == needle for k in range(len(haystack) - len(needle) + 1))


def test_an_interrupted_preparation_resumes_with_the_missing_shards(
    corpus_dir: Path, prepared: Path, tmp_path: Path, monkeypatch
) -> None:
    """Killed after its second shard (in the middle of writing the third): no manifest, the half-written shard
    only in a hidden temporary directory, and the shards refused as unfinished. Run again, it prepares only the
    missing shards and ends with the uninterrupted run's manifest."""
    out = tmp_path / "shards"
    write = shards.write_shard
    written: list[str] = []

    def dies_in_the_third(out_: Path, name: str, arrays: dict, record: dict) -> dict:
        if len(written) == 2:
            partial = out_ / f".{name}.{os.getpid()}.tmp"
            partial.mkdir()
            np.save(partial / "tokens.npy", arrays["tokens.npy"][:10])
            raise KeyboardInterrupt  # the kill
        written.append(name)
        return write(out_, name, arrays, record)

    monkeypatch.setattr(shards, "write_shard", dies_in_the_third)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus_dir, out)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("shard-")) == ["shard-00000", "shard-00001"]
    assert not (out / shards.MANIFEST).exists()
    with pytest.raises(shards.ShardError, match="did not finish .2 shards, no manifest.: run prepare.py again"):
        shards.ShardSet.open(out)
    kept = {name: (out / name / "tokens.npy").stat().st_mtime_ns for name in written}

    monkeypatch.setattr(shards, "write_shard", write)
    redone: list[str] = []
    monkeypatch.setattr(prepare, "prepare_shard", lambda job: redone.append(job.piece.index) or _real(job))
    manifest = _prepare(corpus_dir, out)
    assert redone == [2, 3]
    assert {name: (out / name / "tokens.npy").stat().st_mtime_ns for name in written} == kept
    assert manifest == json.loads((prepared / shards.MANIFEST).read_text())
    assert sorted(p.name for p in out.glob(".*")) == [out_dir.LOCK, stamps.NAME]  # nothing temporary left
    stamped = stamps.Stamp(out, manifest["digest"]).entries()
    assert sorted(stamped) == ["shard-00002", "shard-00003"]  # verified as written; the kept ones at first launch


_real = prepare.prepare_shard


def test_another_preparation_is_refused_and_nothing_written_over(corpus_dir: Path, prepared: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in prepared.rglob("*")}
    with pytest.raises(shards.ShardError, match="holds another preparation .its settings differ"):
        _prepare(corpus_dir, prepared, seed=3)
    other = transformers.PreTrainedTokenizerFast.from_pretrained(str(prepared / "tokenizer"))
    other.add_tokens(["zzzz"])
    with pytest.raises(shards.ShardError, match="its tokenizer differ"):
        _prepare(corpus_dir, prepared, tokenizer=other)
    assert {p: p.stat().st_mtime_ns for p in prepared.rglob("*")} == before


@pytest.fixture
def copy(prepared: Path, tmp_path: Path) -> Path:
    """A copy of the prepared shards to damage."""
    import shutil

    shutil.copytree(prepared, tmp_path / "copy")
    return tmp_path / "copy"


def _manifest(root: Path) -> dict:
    return json.loads((root / shards.MANIFEST).read_text())


def test_bad_shards_are_refused_before_training_naming_file_and_cause(copy: Path, tmp_path: Path) -> None:
    """Each bad input: a :class:`shards.ShardError` naming the file and the cause, from ``ShardSet.open`` (settings,
    sizes) or ``verify`` (contents), and nothing written."""
    shards.ShardSet.open(copy, SEQ, 600)  # the copy itself is fine
    assert shards.ShardSet.open(copy).verify() == []
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(copy / "tokenizer"))
    other = wordpiece.train_tokenizer(corpora.stdlib_corpus()[:300], vocab_size=600)
    cases = {
        "sequence length": (
            lambda: None,
            {"max_seq_length": 128},
            r"prepared at sequence length 64, the config's bert\.max_seq_length is 128",
        ),
        "vocabulary size": (
            lambda: None,
            {"vocab_size": 1024},
            r"tokenized with a 600-token vocabulary, the config's bert\.vocab_size is 1024",
        ),
        "tokenizer": (
            lambda: None,
            {"tokenizer": other},
            r"tokenized with .*/tokenizer .digest \w+., not the tokenizer given",
        ),
    }
    for name, (_, kwargs, message) in cases.items():
        with pytest.raises(shards.ShardError, match=message):
            shards.ShardSet.open(copy, **{"max_seq_length": SEQ, "vocab_size": 600, "tokenizer": tokenizer, **kwargs})

    tokens = copy / "shard-00001" / "tokens.npy"
    original = tokens.read_bytes()
    tokens.write_bytes(b"")
    with pytest.raises(shards.ShardError, match=r"shard-00001/tokens\.npy: empty"):
        shards.ShardSet.open(copy, SEQ, 600)
    tokens.write_bytes(original[:-100])
    with pytest.raises(
        shards.ShardError,
        match=rf"shard-00001/tokens\.npy: truncated \({len(original) - 100} of {len(original)} bytes\)",
    ):
        shards.ShardSet.open(copy, SEQ, 600)
    flipped = bytearray(original)
    flipped[-1] ^= 1
    tokens.write_bytes(bytes(flipped))
    opened = shards.ShardSet.open(copy, SEQ, 600)  # the sizes agree: the contents are what differ
    assert opened.verify(opened.names[0::2]) == [] and len(opened.verify(opened.names[1::2])) == 1
    assert "shard-00001: its arrays do not match the manifest's digest" in opened.verify()[0]
    tokens.write_bytes(original)

    manifest = _manifest(copy)
    edited = {**manifest, "max_seq_length": 128}
    (copy / shards.MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(shards.ShardError, match=r"manifest\.json: its digest does not match its contents"):
        shards.ShardSet.open(copy, 128, 600)
    (copy / shards.MANIFEST).write_text(json.dumps(manifest))

    (copy / "shard-00002").rename(tmp_path / "elsewhere")
    with pytest.raises(shards.ShardError, match=r"shard-00002: missing \(the manifest lists it\)"):
        shards.ShardSet.open(copy, SEQ, 600)
    (copy / shards.MANIFEST).write_text("[1, 2]")
    with pytest.raises(shards.ShardError, match=r"manifest\.json: the manifest must be a JSON object, got list"):
        shards.ShardSet.open(copy, SEQ, 600)
    (copy / shards.MANIFEST).write_text("{not json")
    with pytest.raises(shards.ShardError, match=r"manifest\.json: cannot read the manifest"):
        shards.ShardSet.open(copy, SEQ, 600)
    (tmp_path / "empty").mkdir()
    with pytest.raises(shards.ShardError, match=r"empty holds no shards \(no manifest\.json\)"):
        shards.ShardSet.open(tmp_path / "empty")
    with pytest.raises(shards.ShardError, match=r"nowhere: no such directory of prepared shards"):
        shards.ShardSet.open(tmp_path / "nowhere")


def test_shard_batches_are_the_masked_instances(prepared: Path) -> None:
    """A micro-batch from the shards is its pairs, masked as ``masking.masked_item`` masks them (seed, epoch, index),
    collated; the same whichever process makes it."""
    opened = shards.ShardSet.open(prepared)
    tokenizer = opened.tokenizer()
    vocab = masking.Vocabulary.of(tokenizer)
    batches = loading.ShardBatches(opened, vocab, tokenizer.cls_token_id, tokenizer.sep_token_id, 5, "train")
    key = (3, (17, 2, len(opened) - 1))
    items = [
        masking.masked_item(opened.example("train", i, tokenizer.cls_token_id, tokenizer.sep_token_id), vocab, f"5:3:{i}")
        for i in key[1]
    ]
    expected = masking.collate_arrays(items, tokenizer.pad_token_id)
    got = batches[key]
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    made = list(loading.loader(batches, [key, key], workers=1, prefetch=2))
    assert all(np.array_equal(made[1][k].numpy(), expected[k]) for k in expected)


# --------------------------------------------------------------------------- NVIDIA's HDF5 shards


def write_nvidia_shard(path: Path, rows: int, seq: int, max_pred: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """An HDF5 file in exactly the layout NVIDIA's ``create_pretraining_data.py`` writes: its six datasets, their
    dtypes (int32 ids and positions, int8 masks, segments and labels), shapes and gzip compression; masked
    positions padded with 0 after the real ones. The arrays written."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max_pred + 3, seq + 1, size=rows)
    input_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int8)
    input_ids = np.where(input_mask == 1, rng.integers(5, vocab, size=(rows, seq)), 0).astype(np.int32)
    segment_ids = np.zeros((rows, seq), np.int8)
    positions, masked_ids = np.zeros((rows, max_pred), np.int32), np.zeros((rows, max_pred), np.int32)
    for r, length in enumerate(lengths):
        input_ids[r, [0, length // 2, length - 1]] = [2, 3, 3]
        segment_ids[r, length // 2 + 1 : length] = 1
        count = rng.integers(1, max_pred + 1)
        chosen = np.sort(rng.choice(np.setdiff1d(np.arange(1, length - 1), [length // 2]), count, replace=False))
        positions[r, :count], masked_ids[r, :count] = chosen, input_ids[r, chosen]
        input_ids[r, chosen] = 4
    arrays = {
        "input_ids": input_ids,
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "masked_lm_positions": positions,
        "masked_lm_ids": masked_ids,
        "next_sentence_labels": rng.integers(0, 2, size=rows).astype(np.int8),
    }
    dtypes = {
        "input_ids": "i4",
        "input_mask": "i1",
        "segment_ids": "i1",
        "masked_lm_positions": "i4",
        "masked_lm_ids": "i4",
        "next_sentence_labels": "i1",
    }
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value, dtype=dtypes[key], compression="gzip")
    return arrays


def nvidia_labels(positions: np.ndarray, ids: np.ndarray, seq: int) -> np.ndarray:
    """NVIDIA's ``pretraining_dataset.__getitem__`` labels, row by row: -100 but at the positions before the first
    0 position, which hold the original ids."""
    labels = np.full(seq, -100)
    index = len(positions)
    zeros = np.flatnonzero(positions == 0)
    if len(zeros):
        index = zeros[0]
    labels[positions[:index]] = ids[:index]
    return labels


@pytest.fixture(scope="module")
def nvidia_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("hdf5")
    written = {}
    for i, rows in enumerate([70, 45, 96]):
        name = f"books_wiki_en_corpus_training_{i}.hdf5"
        written[name] = write_nvidia_shard(root / name, rows, SEQ, 10, 600, i)
    written["books_wiki_en_corpus_test_0.hdf5"] = write_nvidia_shard(
        root / "books_wiki_en_corpus_test_0.hdf5", 40, SEQ, 10, 600, 9
    )
    return root, written


def test_nvidia_files_are_assigned_as_nvidias_loader_assigns_them(nvidia_dir) -> None:
    """Each rank's file in each round is NVIDIA's ``files[(f * world + rank) % n]`` of the sorted training files
    shuffled by ``random.Random(seed + epoch)`` (shifted by ``world % n`` per round when ranks outnumber files),
    and its micro-batches cover that file's rows once each (a last partial batch unused)."""
    root, written = nvidia_dir
    training, test = nvidia.discover(root, SEQ)
    assert [Path(f.path).name for f in training] == sorted(n for n in written if "training" in n)
    assert [Path(f.path).name for f in test] == ["books_wiki_en_corpus_test_0.hdf5"]
    for world in (1, 2, 5):
        for rank in range(world):
            order = nvidia.NvidiaOrder(training, 8, 2, world, rank, seed=12345)
            number = 0
            for epoch in range(2):
                files = sorted(f.path for f in training)
                random.Random(12345 + epoch).shuffle(files)
                n = len(files)
                for f_id in range(n):
                    if world > n:
                        expected = files[(f_id * world + rank + (world % n) * f_id) % n]
                    else:
                        expected = files[(f_id * world + rank) % n]
                    rows = next(f.rows for f in training if f.path == expected)
                    seen = []
                    for _ in range(rows // 8):
                        _, index, batch = order.micro_batch(number)
                        assert training[index].path == expected
                        seen += batch
                        number += 1
                    assert len(set(seen)) == len(seen) == rows // 8 * 8 and max(seen) < rows
            assert order.step(3) == [order.micro_batch(6), order.micro_batch(7)]


def test_nvidia_batches_are_the_stored_arrays(nvidia_dir) -> None:
    """A micro-batch is the stored rows as they are (ids with their static masks, attention mask, token types, NSP
    labels), with NVIDIA's masked-LM labels."""
    root, written = nvidia_dir
    training, test = nvidia.discover(root, SEQ)
    batches = nvidia.NvidiaBatches(training, 600)
    for index, rows in [(0, (5, 1, 69)), (2, (0, 95, 40, 41))]:
        stored = written[Path(training[index].path).name]
        got = batches[(-1, index, rows)]
        picked = list(rows)
        assert np.array_equal(got["input_ids"], stored["input_ids"][picked])
        assert np.array_equal(got["attention_mask"], stored["input_mask"][picked])
        assert np.array_equal(got["token_type_ids"], stored["segment_ids"][picked])
        assert np.array_equal(got["next_sentence_label"], stored["next_sentence_labels"][picked])
        labels = [nvidia_labels(stored["masked_lm_positions"][r], stored["masked_lm_ids"][r], SEQ) for r in picked]
        assert np.array_equal(got["labels"], np.stack(labels))
        assert all(v.dtype == np.int64 for v in got.values())
    keys = nvidia.held_out_keys(test, 25, 8)
    assert keys == [(-1, 0, tuple(range(k, min(k + 8, 25)))) for k in range(0, 25, 8)]
    fault = nvidia.NvidiaBatches(training, 100)[(-1, 0, (0, 1))]  # a fault in place of the batch: every rank stops
    assert re.search(r"training_0\.hdf5: input_ids holds id \d+, the config's bert\.vocab_size is 100", fault.message)


def test_bad_nvidia_shards_are_refused_by_name(nvidia_dir, tmp_path: Path) -> None:
    root, _ = nvidia_dir
    with pytest.raises(
        ValueError, match=r"training_0\.hdf5: sequence length 64, the config's bert\.max_seq_length is 128"
    ):
        nvidia.discover(root, 128)
    with pytest.raises(ValueError, match="holds no NVIDIA training shards"):
        nvidia.discover(tmp_path, SEQ)
    (tmp_path / "x_training_0.hdf5").write_bytes(b"")
    with pytest.raises(ValueError, match=r"x_training_0\.hdf5: not a readable HDF5 file"):
        nvidia.discover(tmp_path, SEQ)
    with h5py.File(tmp_path / "x_training_0.hdf5", "w") as f:
        f.create_dataset("input_ids", data=np.zeros((4, SEQ), np.int32))
    with pytest.raises(ValueError, match=r"x_training_0\.hdf5: no dataset input_mask, segment_ids"):
        nvidia.discover(tmp_path, SEQ)
    arrays = write_nvidia_shard(tmp_path / "x_training_0.hdf5", 4, SEQ, 5, 600, 0)
    with h5py.File(tmp_path / "x_training_0.hdf5", "a") as f:
        del f["masked_lm_ids"]
        f.create_dataset("masked_lm_ids", data=arrays["masked_lm_ids"][:, :3])
    with pytest.raises(ValueError, match=r"x_training_0\.hdf5: shapes .* are not NVIDIA's"):
        nvidia.discover(tmp_path, SEQ)


# --------------------------------------------------------------------------- pretrain.py on them, in this process

ROOT = Path(__file__).parents[1]


def _small_config(tmp_path: Path, name: str = "bert_cpu_phase2_base.json") -> Path:
    """A shipped config at micro-batch 8, accumulation 2 (and sequence length 64, a 600-token vocabulary)."""
    config = json.loads((ROOT / "configs" / name).read_text())
    config.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)
    config["bert"].update(vocab_size=600)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_pretrain_trains_on_nvidias_arrays_as_stored(one_rank: None, nvidia_dir, tmp_path: Path, monkeypatch) -> None:
    """``pretrain.py --nvidia-hdf5`` (one rank, here): every training micro-batch the model sees is rows of the
    file NVIDIA's loader assigns this rank in that round, exactly as stored (ids with their static masks, attention
    mask, token types, NSP labels), with NVIDIA's masked-LM labels; evaluation reads the test file's first rows."""
    import pretrain

    root, written = nvidia_dir
    seen: list[dict] = []
    forward = transformers.BertForPreTraining.forward

    def recording(self, **kwargs):
        seen.append({k: v.detach().clone().numpy() for k, v in kwargs.items() if v is not None})
        return forward(self, **kwargs)

    monkeypatch.setattr(transformers.BertForPreTraining, "forward", recording)
    config = _small_config(tmp_path)
    argv = ["--deepspeed_config", str(config), "--nvidia-hdf5", str(root), "--output-dir", str(tmp_path / "out")]
    pretrain.main([*argv, "--max-steps", "6", "--eval-every", "3", "--eval-batches", "2", "--seed", "4"])
    training = [batch for batch in seen if "next_sentence_label" in batch]
    evaluation = [batch for batch in seen if "next_sentence_label" not in batch]
    assert len(training) == 12 and len(evaluation) == 4  # 6 steps of 2 micro-batches; 2 evaluations of 2

    files = sorted(n for n in written if "training" in n)
    random.Random(4).shuffle(files)  # epoch 0's order for seed 4; one rank reads them in turn
    expected_file = [f for f in files for _ in range(written[f]["input_ids"].shape[0] // 8)]
    for number, batch in enumerate(training):
        stored = written[expected_file[number]]
        for row in range(8):
            (match,) = np.flatnonzero((stored["input_ids"] == batch["input_ids"][row]).all(axis=1))
            assert np.array_equal(batch["attention_mask"][row], stored["input_mask"][match])
            assert np.array_equal(batch["token_type_ids"][row], stored["segment_ids"][match])
            assert batch["next_sentence_label"][row] == stored["next_sentence_labels"][match]
            labels = nvidia_labels(stored["masked_lm_positions"][match], stored["masked_lm_ids"][match], SEQ)
            assert np.array_equal(batch["labels"][row], labels)
    test = written["books_wiki_en_corpus_test_0.hdf5"]
    assert np.array_equal(evaluation[0]["input_ids"], test["input_ids"][:8])
    assert np.array_equal(
        evaluation[1]["labels"][3], nvidia_labels(test["masked_lm_positions"][11], test["masked_lm_ids"][11], SEQ)
    )
    record = json.loads((tmp_path / "out" / config.stem / "corpus.json").read_text())
    assert record["training_files"] == 3 and record["train_pairs"] == 70 + 45 + 96 and record["held_out_pairs"] == 40


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", r"shard-00001/tokens\.npy: truncated"),
        ("sequence", r"prepared at sequence length 64, the config's bert\.max_seq_length is 128"),
        ("vocabulary", r"tokenized with a 600-token vocabulary, the config's bert\.vocab_size is 1024"),
        ("flip", r"shard-00003: its arrays do not match the manifest's digest"),
        ("nowhere", r"nowhere: no such directory of prepared shards"),
        ("hdf5", r"x_training_0\.hdf5: sequence length 64, the config's bert\.max_seq_length is 128"),
    ],
)
def test_pretrain_refuses_bad_data_before_step_1(
    one_rank: None, copy: Path, tmp_path: Path, capsys, damage: str, message: str
) -> None:
    """``pretrain.py`` on bad data: one line naming the file and the cause on stderr, exit code 2, before any
    step (no metrics written), the data untouched."""
    import pretrain

    config = _small_config(tmp_path)
    settings = json.loads(config.read_text())
    data_args = ["--shards", str(copy)]
    if damage == "truncate":
        tokens = copy / "shard-00001" / "tokens.npy"
        tokens.write_bytes(tokens.read_bytes()[:-8])
    elif damage in ("sequence", "hdf5"):
        settings["bert"]["max_seq_length"] = 128
    elif damage == "vocabulary":
        settings["bert"]["vocab_size"] = 1024
    elif damage == "flip":
        tokens = copy / "shard-00003" / "tokens.npy"
        flipped = bytearray(tokens.read_bytes())
        flipped[-2] ^= 1
        tokens.write_bytes(bytes(flipped))
    elif damage == "nowhere":
        data_args = ["--shards", str(tmp_path / "nowhere")]
    if damage == "hdf5":
        (tmp_path / "hdf5").mkdir()
        write_nvidia_shard(tmp_path / "hdf5" / "x_training_0.hdf5", 4, SEQ, 5, 600, 0)
        data_args = ["--nvidia-hdf5", str(tmp_path / "hdf5")]
    config.write_text(json.dumps(settings))
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    with pytest.raises(SystemExit) as exit_:
        pretrain.main(["--deepspeed_config", str(config), *data_args, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("pretrain.py: error: "), err
    assert re.search(message, err[0]), err
    assert not (tmp_path / "out" / config.stem / "metrics.csv").exists()
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before
