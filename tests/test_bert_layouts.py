"""The BERT example's text layouts and what a preparation records of its pairs: blank-line documents, one document
per line and JSON lines read alike, a wrong layout refused by name, pieces bounded whatever the input, rows of
sentences grouped into documents or refused, the label-1 rate and fill counted (``examples/bert/{sources,prepare,
shard_jobs}.py``)."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parents[1] / "examples/bert"))
import corpora  # noqa: E402
import prepare  # noqa: E402
import shard_jobs  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402

SEQ = 64
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega tensor gradient layer".split()


def documents(count: int, seed: int = 0) -> list[list[str]]:
    """``count`` documents of 2-6 sentences of made-up words."""
    rng = random.Random(seed)
    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."

    return [[sentence() for _ in range(rng.randint(2, 6))] for _ in range(count)]


def write(root: Path, docs: list[list[str]], layout: str) -> Path:
    """``docs`` as one file of ``layout`` under ``root`` (two for ``lines``: a file may end without a newline)."""
    root.mkdir(parents=True, exist_ok=True)
    if layout == "blank-lines":
        (root / "a.txt").write_text("".join("\n".join(doc) + "\n\n" for doc in docs))
    elif layout == "lines":
        half = len(docs) // 2
        (root / "a.txt").write_text("".join(" ".join(doc) + "\n" for doc in docs[:half]))
        (root / "b.txt").write_text("\n".join(" ".join(doc) for doc in docs[half:]))  # no final newline
    else:
        lines = (json.dumps({"id": i, "body": " ".join(doc)}) + "\n" for i, doc in enumerate(docs))
        (root / "a.jsonl").write_text("".join(lines))
    return root


@pytest.mark.parametrize("piece_bytes", [700, 5_000, 1 << 30])
@pytest.mark.parametrize("layout", ["lines", "jsonl"])
def test_every_layout_reads_the_same_documents_in_bounded_pieces(tmp_path: Path, layout: str, piece_bytes: int):
    """One document per line and JSON lines give the documents written, in order, cut only at line ends, each piece
    under 6.5 pieces' bytes; read as blank-line documents, the same file (over 4 pieces long) is refused by name
    with the layout to use (before, it became one document of the whole file)."""
    written = documents(300)
    root = write(tmp_path / layout, written, layout)
    pieces = sources.text_dir_pieces(root, piece_bytes, layout, field="body")
    assert [doc for piece in pieces for doc in piece.read()[0]] == written
    assert max(piece.text_bytes for piece in pieces) < 6.5 * piece_bytes or len(pieces) == 1
    if layout == "lines" and piece_bytes == 700:
        with pytest.raises(ValueError, match=r"a\.txt: no blank line in the 0 MB from byte 700 \(a document over 4 x "
                           r"--shard-mb\): one document per line takes --layout lines"):  # fmt: skip
            sources.text_dir_pieces(root, piece_bytes)


def test_a_json_line_without_its_field_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "Fine. Also fine."}\n{"body": "No text field."}\n')
    (piece,) = sources.text_dir_pieces(tmp_path, 1000, "jsonl")
    with pytest.raises(ValueError, match=r"a\.jsonl \(bytes 0-\d+\): line 2: not a JSON object with a 'text' text"):
        piece.read()


def test_the_three_layouts_prepare_the_same_shards(tmp_path: Path) -> None:
    """The same documents in each layout prepare shards with the same arrays (digests), and the manifest's counts
    of random-B pairs and filled tokens are those of its pairs, recounted."""
    written = documents(400, seed=1)
    manifests = {}
    for layout in sources.LAYOUTS:
        root = write(tmp_path / layout, written, layout)
        source = prepare.text_dir_source(root, 1 << 30, layout, "body")
        settings = prepare.Settings(SEQ, held_out_fraction=0.1)
        out = tmp_path / f"{layout}-shards"
        manifests[layout] = prepare.prepare(source, out, settings, 200, sample_bytes=1 << 30, progress=False)
    digests = {layout: [s["digest"] for s in m["shards"]] for layout, m in manifests.items()}
    assert digests["lines"] == digests["jsonl"] == digests["blank-lines"]
    totals = manifests["lines"]["totals"]
    pairs = np.load(tmp_path / "lines-shards" / "shard-00000" / "pairs.npy")
    assert totals["random_next_pairs"] == int(pairs["next_sentence_label"].sum()) > 0
    assert totals["pair_tokens"] == int((pairs["a_length"].astype(int) + pairs["b_length"] + 3).sum())
    assert 0.3 < totals["random_next_pairs"] / totals["train_pairs"] < 0.7  # BERT's pairing: about half


def test_rows_of_sentences_are_grouped_into_documents_or_refused(tmp_path: Path) -> None:
    """A dataset whose rows are sentences (the Hub's bookcorpus), read a row a document, makes every next-sentence
    pair a random one: refused naming the cause and the flags. Grouped by a fixed number of rows, or by a document
    id column, its documents are the books again, and the pairs are BERT's usual half random."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    books = documents(120, seed=2)
    rows = {"text": [s for doc in books for s in doc], "book": [i for i, doc in enumerate(books) for _ in doc]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    source = prepare.hf_dataset_source(tmp_path / "saved", "text", 1 << 30)
    with pytest.raises(ValueError, match=r"shard-00000 \(.*\): 100% of its next-sentence pairs take a random B .* "
                       r"--group-rows N or --document-column COLUMN"):  # fmt: skip
        prepare.prepare(source, tmp_path / "rows", settings, 200, sample_bytes=1 << 30, progress=False)
    assert not (tmp_path / "rows" / shards.MANIFEST).exists()
    by_book = prepare.hf_dataset_source(tmp_path / "saved", "text", 1 << 30, document_column="book")
    assert by_book.pieces[0].read()[0] == books
    manifest = prepare.prepare(by_book, tmp_path / "books", settings, 200, sample_bytes=1 << 30, progress=False)
    assert manifest["totals"]["random_next_pairs"] < shard_jobs.MOST_RANDOM_NEXT * manifest["totals"]["train_pairs"]
    in_fours = prepare.hf_dataset_source(tmp_path / "saved", "text", 300, group_rows=4)
    assert all(piece.reader.start % 4 == 0 for piece in in_fours.pieces) and len(in_fours.pieces) > 3
    grouped = [doc for piece in in_fours.pieces for doc in piece.read()[0]]
    assert grouped == [rows["text"][i : i + 4] for i in range(0, len(rows["text"]), 4)]


def test_prepare_prints_the_pairs_label_rate_and_fill(tmp_path: Path, capsys) -> None:
    root = write(tmp_path / "text", documents(300, seed=3), "lines")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"bert": {"max_seq_length": SEQ, "vocab_size": 200}}))
    prepare.main(["--text-dir", str(root), "--layout", "lines", "--deepspeed_config", str(config), "--out",
                  str(tmp_path / "out")])  # fmt: skip
    out = capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / shards.MANIFEST).read_text())
    totals = manifest["totals"]
    rate = totals["random_next_pairs"] / totals["train_pairs"]
    fill = totals["pair_tokens"] / totals["train_pairs"] / SEQ
    assert f"({rate:.1%} with a random B, sequences {fill:.1%} full on average)" in out, out
    assert manifest["source"]["layout"] == "lines" and manifest["format"] == shards.FORMAT == 2


def test_the_tokenizer_sample_is_drawn_across_the_whole_corpus(tmp_path: Path) -> None:
    """Ten ``books_*`` pieces then ten ``wiki_*`` ones, a sample of four pieces' text: one piece from each quarter
    of the corpus, so both halves are seen (before: pieces drawn with the seed until the sample was full, which
    could all be books); a corpus no larger than the sample gives all its pieces."""
    import out_dir

    size = 1000
    pieces = [sources.Piece(i, sources.InMemory(tuple(map(tuple, documents(5, i)))), size) for i in range(20)]
    source = prepare.Source(pieces, {"test": "books then wiki"}, tmp_path)  # pieces 0-9 books, 10-19 wiki
    settings = prepare.Settings(SEQ)
    for seed in range(5):
        chosen = out_dir.sample_sentences(source, prepare.Settings(SEQ, seed=seed), 4 * size)
        assert [piece.index // 5 for piece in chosen] == [0, 1, 2, 3]
    assert out_dir.sample_sentences(source, settings, 10**9) == source.pieces


def test_dupe_factor_pairs_the_same_tokens_again(tmp_path: Path) -> None:
    """``dupe_factor`` 3: the same tokens, and pairs that are the single pairing's followed by two more drawn
    otherwise (NVIDIA's files hold 5 such pairings); the held-out pairs are paired once."""
    root = write(tmp_path / "text", documents(300, seed=4), "lines")
    source = prepare.text_dir_source(root, 1 << 30, "lines")
    made = {}
    for dupe in (1, 3):
        settings = prepare.Settings(SEQ, held_out_fraction=0.1, dupe_factor=dupe)
        prepare.prepare(source, tmp_path / f"d{dupe}", settings, 200, sample_bytes=1 << 30, progress=False)
        made[dupe] = {name: np.load(tmp_path / f"d{dupe}" / "shard-00000" / name) for name in shards.ARRAYS}
    one, three = made[1], made[3]
    assert np.array_equal(one["tokens.npy"], three["tokens.npy"])
    assert np.array_equal(one["held_out_pairs.npy"], three["held_out_pairs.npy"])
    first = len(one["pairs.npy"])
    assert np.array_equal(three["pairs.npy"][:first], one["pairs.npy"]) and 2.5 * first < len(three["pairs.npy"])
    assert not np.array_equal(three["pairs.npy"][first : 2 * first], one["pairs.npy"])


def test_phase_2_from_phase_1s_tokens_is_the_full_preparation_without_the_text(tmp_path: Path) -> None:
    """``prepare.py --from-shards PHASE1`` at phase 2's sequence length pairs phase 1's tokens again: the shards'
    arrays are those a full preparation of the same text at that length (phase 1's tokenizer, seed and split)
    makes, with the text gone (nothing read, nothing tokenized)."""
    root = write(tmp_path / "text", corpora.stdlib_corpus()[:400], "blank-lines")
    configs = {}
    for seq in (SEQ, 128):
        configs[seq] = tmp_path / f"seq{seq}.json"
        configs[seq].write_text(json.dumps({"bert": {"max_seq_length": seq, "vocab_size": 600}}))
    common = ["--shard-mb", "0.03", "--seed", "3", "--held-out-fraction", "0.2", "--tokenizer-sample-mb", "0.05"]
    prepare.main(["--text-dir", str(root), "--deepspeed_config", str(configs[SEQ]), "--out", str(tmp_path / "p1"),
                  *common])  # fmt: skip
    tokenizer = tmp_path / "p1" / shards.TOKENIZER
    prepare.main(["--text-dir", str(root), "--deepspeed_config", str(configs[128]), "--out", str(tmp_path / "full"),
                  "--tokenizer", str(tokenizer), *common])  # fmt: skip
    shutil.rmtree(root)
    prepare.main(["--from-shards", str(tmp_path / "p1"), "--deepspeed_config", str(configs[128]), "--out",
                  str(tmp_path / "p2")])  # fmt: skip
    full, p2 = (json.loads((tmp_path / d / shards.MANIFEST).read_text()) for d in ("full", "p2"))
    assert len(full["shards"]) == len(p2["shards"]) > 2
    assert [s["digest"] for s in p2["shards"]] == [s["digest"] for s in full["shards"]]
    assert p2["totals"] == full["totals"] and p2["max_seq_length"] == 128
    assert p2["tokenizer"]["digest"] == full["tokenizer"]["digest"]
