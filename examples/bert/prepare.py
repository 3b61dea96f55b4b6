"""Prepare BERT pretraining data once, for every launch after: documents to tokenized sentences to NSP instances,
in shards on disk that ``pretrain.py --shards`` reads pair by pair.

    python examples/bert/prepare.py --text-dir /data/wikibooks --deepspeed_config configs/bert_large_phase1_kfac.json \\
        --tokenizer /data/bert-large-uncased-tokenizer --out /data/shards/phase1 --workers 32
    python examples/bert/prepare.py --hf-dataset /data/wiki-saved --deepspeed_config CONFIG --out SHARDS
    python examples/bert/prepare.py --corpus packages --deepspeed_config configs/bert_cpu_phase1_lamb.json --out SHARDS

The config's ``"bert"`` section gives the sequence length and, where no ``--tokenizer`` is given, the size of the
WordPiece vocabulary trained on a sample of the training documents (``--tokenizer-sample-mb`` of text from pieces
drawn with the seed). The corpus is cut into pieces of about ``--shard-mb`` of text (:mod:`sources`); each piece,
in a worker process of its own (``--workers``), is read, its documents split into training and held-out ones
(``--held-out-fraction`` of them, at least two when it has four or more), their sentences tokenized with the fast
``tokenizers`` backend and cut into NSP instances as BERT's ``create_pretraining_data.py`` does (B drawn from
another document of the same shard), and written as one shard (:mod:`shards`). Memory holds one piece per worker,
whatever the corpus size. The result is deterministic for a seed and the same for any number of workers.

A shard appears only when complete and the manifest is written last: a preparation killed half way leaves no shard
that reads as complete, and running the same command again prepares only the missing shards. A directory that holds
another preparation (other input, settings or tokenizer) is refused, never written over.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import data  # noqa: E402
import recipe  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402
from shard_jobs import Job, Settings, in_workers, prepare_shard, split_piece  # noqa: E402

PIECE_BYTES = 32_000_000
"""Text per shard by default (``--shard-mb``): a worker holds one piece's text, documents and ids at a time."""
VERSIONED = ("numpy", "tokenizers", "transformers")
"""Packages whose versions the manifest records (with Python's)."""
LOCK = ".lock"
"""Held (``flock``) by the preparation writing into a directory; it names that preparation's process."""
TOKENIZER_KEY = "preparation.json"
"""Beside a trained tokenizer: the preparation it belongs to (:func:`tokenizer_for` reuses it for that one only)."""

if TYPE_CHECKING:  # imported where used: a worker process reads, tokenizes and writes without it
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class Source:
    """A corpus to prepare: its pieces and what identifies it (to refuse mixing preparations of other inputs)."""

    pieces: list[sources.Piece]
    record: dict[str, Any]
    root: Path

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.record, sort_keys=True).encode()).hexdigest()


def text_dir_source(root: Path, piece_bytes: int) -> Source:
    root = root.resolve()
    pieces = sources.text_dir_pieces(root, piece_bytes)
    record = {"text_dir": str(root), "files": sources.text_dir_identity(root), "piece_bytes": piece_bytes}
    return Source(pieces, record, root)


def hf_dataset_source(path: Path, column: str, piece_bytes: int) -> Source:
    pieces = sources.hf_dataset_pieces(path, column, piece_bytes)
    identity = sources.hf_dataset_identity(path, column)
    record = {"hf_dataset": str(path.resolve()), **identity, "piece_bytes": piece_bytes}
    return Source(pieces, record, path.resolve())


def embedded_source(name: str, cache_dir: Optional[Path], piece_bytes: int) -> Source:
    documents = data.embedded_corpus(name, cache_dir)
    record = {
        "embedded": name,
        "versions": data.corpus_sources(name),
        "digest": data.corpus_digest(documents),
        "piece_bytes": piece_bytes,
    }
    return Source(sources.document_pieces(documents, piece_bytes), record, Path("."))


# --------------------------------------------------------------------------- the whole preparation


def sample_sentences(source: Source, settings: Settings, sample_bytes: int) -> list[sources.Piece]:
    """The pieces whose training documents train the tokenizer: drawn with the seed until ``sample_bytes`` of text."""
    order = list(range(len(source.pieces)))
    random.Random(f"{settings.seed}:tokenizer").shuffle(order)
    chosen, total = [], 0
    for index in order:
        if total >= sample_bytes:
            break
        chosen.append(source.pieces[index])
        total += source.pieces[index].text_bytes
    return sorted(chosen, key=lambda piece: piece.index)


def tokenizer_for(
    out: Path, source: Source, settings: Settings, given: Optional[PreTrainedTokenizerFast], vocab_size: int,
    sample_bytes: int,
) -> PreTrainedTokenizerFast:  # fmt: skip
    """The preparation's tokenizer, saved in ``out/tokenizer`` with the key of the preparation it belongs to: the
    one given, or one trained on a sample. A tokenizer an interrupted run left is reused by the same preparation
    only (same input, settings, vocabulary size, sample and given tokenizer); another's is refused, never used."""
    from transformers import PreTrainedTokenizerFast

    directory = out / shards.TOKENIZER
    key = {
        "source": source.key,
        "settings": asdict(settings),
        "vocab_size": vocab_size,
        "sample_bytes": sample_bytes,
        "given": None if given is None else shards.tokenizer_digest(given),
    }
    if directory.is_dir():
        kept = (directory / TOKENIZER_KEY).is_file() and shards.read_json(directory / TOKENIZER_KEY, "tokenizer key")
        differ = sorted(k for k in key if not kept or kept.get(k) != key[k])
        if differ:
            raise shards.ShardError(
                f"{directory}: left by a preparation of other input or settings (its {', '.join(differ)} differ from "
                f"this command's), not reused: prepare into another --out, or remove {out}"
            )
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    if given is None:
        sample = sample_sentences(source, settings, sample_bytes)

        def sentences() -> Any:
            for piece in sample:
                train, _ = split_piece(piece.read()[0], settings, piece.index)
                yield from (s for doc in train for s in doc)

        size = sum(piece.text_bytes for piece in sample)
        print(f"training a {vocab_size}-token WordPiece vocabulary on {len(sample)} pieces ({size / 1e6:.0f} MB)")
        given = data.wrap_tokenizer(data.train_wordpiece(sentences, vocab_size))
    partial = out / f".{shards.TOKENIZER}.{os.getpid()}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    given.save_pretrained(str(partial))
    shards.write_json(partial / TOKENIZER_KEY, key)
    os.rename(partial, directory)
    return given


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """``out/.lock`` held (``flock``) while preparing into ``out``: a second preparation there is refused in one
    line naming the first's process (the lock goes with the process, however it ends)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise shards.ShardError(
                f"{out}: another preparation (process {holder}) is writing here: wait for it, or prepare into "
                f"another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def prepare(
    source: Source,
    out: Path,
    settings: Settings,
    vocab_size: int,
    tokenizer: Optional[PreTrainedTokenizerFast] = None,
    workers: int = 1,
    sample_bytes: int = 128 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Prepare ``source`` into ``out`` (or find it prepared there: read only), holding its lock; the manifest. See
    the module docstring."""
    if (out / shards.MANIFEST).is_file():
        return _prepared(out, source, settings, tokenizer)
    with locked(out):
        return _prepare(source, out, settings, vocab_size, tokenizer, workers, sample_bytes, progress)


def _prepare(
    source: Source,
    out: Path,
    settings: Settings,
    vocab_size: int,
    tokenizer: Optional[PreTrainedTokenizerFast],
    workers: int,
    sample_bytes: int,
    progress: bool,
) -> dict[str, Any]:
    if (out / shards.MANIFEST).is_file():  # another preparation finished it while this one waited for nothing
        return _prepared(out, source, settings, tokenizer)
    started = time.perf_counter()
    for stale in out.glob(".*.tmp"):  # a killed run's unfinished shard or tokenizer
        shutil.rmtree(stale, ignore_errors=True)
    tokenizer = tokenizer_for(out, source, settings, tokenizer, vocab_size, sample_bytes)
    digest = shards.tokenizer_digest(tokenizer)
    jobs, records = [], {}
    for piece in source.pieces:
        identity = {
            "source": source.key,
            "piece": piece.reader.describe(source.root),
            "settings": asdict(settings),
            "tokenizer": digest,
        }
        directory = out / shards.shard_name(piece.index)
        if directory.is_dir():
            record = shards.read_json(directory / shards.SHARD_RECORD, "shard record")
            if any(record.get(key) != value for key, value in identity.items()):
                raise shards.ShardError(
                    f"{directory}: prepared from other input or settings than this command's: prepare into another "
                    f"--out, or remove {out}"
                )
            records[piece.index] = record
        else:
            jobs.append(Job(piece, str(out), str(out / shards.TOKENIZER / "tokenizer.json"), identity))
    total = sum(piece.text_bytes for piece in source.pieces)
    done = total - sum(job.piece.text_bytes for job in jobs)
    bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", disable=not progress)
    if workers > 1 and len(jobs) > 1:

        def done(record: dict[str, Any]) -> None:
            records[int(record["shard"].removeprefix("shard-"))] = record
            bar.update(record["text_bytes"])

        in_workers(jobs, min(workers, len(jobs)), done)
    else:
        for job in jobs:
            records[job.piece.index] = prepare_shard(job)
            bar.update(job.piece.text_bytes)
    bar.close()
    manifest = _manifest(source, settings, tokenizer, [records[i] for i in range(len(source.pieces))])
    shards.write_json(out / shards.MANIFEST, manifest)
    seconds = time.perf_counter() - started
    totals = manifest["totals"]
    print(
        f"prepared {len(source.pieces)} shards ({len(jobs)} new) in {out}: {totals['text_bytes'] / 1e6:.1f} MB of "
        f"text, {totals['documents']} documents, {totals['tokens']} tokens, {totals['train_pairs']} training / "
        f"{totals['held_out_pairs']} held-out pairs; {seconds:.1f} s"
    )
    return manifest


def _prepared(out: Path, source: Source, settings: Settings, tokenizer: Optional[Any]) -> dict[str, Any]:
    """The manifest of ``out`` if it is this preparation's, else a refusal (nothing is written over)."""
    manifest = shards.read_json(out / shards.MANIFEST, "manifest")
    wanted = {"source": source.record, "settings": asdict(settings)}
    differ = [key for key, value in wanted.items() if manifest.get(key) != value]
    if tokenizer is not None and manifest.get("tokenizer", {}).get("digest") != shards.tokenizer_digest(tokenizer):
        differ.append("tokenizer")
    if differ:
        raise shards.ShardError(
            f"{out} holds another preparation (its {', '.join(differ)} differ from this command's): prepare into "
            f"another --out, or remove it"
        )
    print(f"already prepared: {out}")
    return manifest


def _manifest(
    source: Source, settings: Settings, tokenizer: PreTrainedTokenizerFast, records: list[dict[str, Any]]
) -> dict[str, Any]:
    counted = ("text_bytes", "documents", "held_out_documents", "sentences", "tokens", "train_pairs", "held_out_pairs")
    manifest = {
        "format": shards.FORMAT,
        "source": source.record,
        "settings": asdict(settings),
        "max_seq_length": settings.max_seq_length,
        "tokenizer": {
            "path": shards.TOKENIZER,
            "digest": shards.tokenizer_digest(tokenizer),
            "vocab_size": len(tokenizer),
            "token_dtype": data.token_dtype(len(tokenizer)).name,
        },
        "versions": {"python": platform.python_version(), **{p: importlib.metadata.version(p) for p in VERSIONED}},
        "text_digest": hashlib.sha256("".join(r["text_digest"] for r in records).encode()).hexdigest(),
        "totals": {key: sum(r[key] for r in records) for key in counted},
        "shards": [
            {"name": shards.shard_name(i), **{key: r[key] for key in (*counted, "files", "digest")}}
            for i, r in enumerate(records)
        ],
    }
    return {**manifest, "digest": shards.manifest_digest(manifest)}


# --------------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--text-dir", type=Path, help="a directory of *.txt files (documents end at blank lines)")
    inputs.add_argument("--hf-dataset", type=Path, help="a datasets dataset saved with save_to_disk (a row a document)")
    inputs.add_argument("--corpus", choices=data.EMBEDDED_CORPORA, help="an embedded corpus (no download)")
    parser.add_argument("--text-column", default="text", help="the dataset's text column")
    parser.add_argument("--tokenizer", type=Path, help="a saved fast tokenizer (save_pretrained); default: train one")
    parser.add_argument(
        "--deepspeed_config", type=Path, required=True, help="its 'bert' section: sequence length, vocabulary size"
    )
    parser.add_argument("--out", type=Path, required=True, help="the directory of shards to write")
    parser.add_argument("--workers", type=int, default=1, help="processes preparing shards in parallel")
    parser.add_argument("--seed", type=int, default=0, help="held-out split, tokenizer sample and sentence pairs")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--shard-mb", type=float, default=PIECE_BYTES / 1e6, help="text per shard, in MB")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=128.0, help="text the vocabulary is trained on")
    parser.add_argument("--cache-dir", type=Path, help="the embedded corpus's cache (--corpus packages)")
    args = parser.parse_args(argv)
    for name in ("workers", "shard_mb", "tokenizer_sample_mb"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def source_of(args: argparse.Namespace, piece_bytes: int) -> Source:
    if args.text_dir is not None:
        return text_dir_source(args.text_dir, piece_bytes)
    if args.hf_dataset is not None:
        return hf_dataset_source(args.hf_dataset, args.text_column, piece_bytes)
    return embedded_source(args.corpus, args.cache_dir, piece_bytes)


def main(argv: Optional[list[str]] = None) -> None:
    from transformers import PreTrainedTokenizerFast

    args = parse_args(argv)
    try:
        _, bert = recipe.read_config(args.deepspeed_config)
        settings = Settings(bert["max_seq_length"], args.short_seq_prob, args.held_out_fraction, args.seed)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer)) if args.tokenizer else None
        if tokenizer is not None and len(tokenizer) != bert["vocab_size"]:
            raise recipe.ConfigError(
                f"{args.tokenizer}: a {len(tokenizer)}-token vocabulary, {args.deepspeed_config}'s bert.vocab_size is "
                f"{bert['vocab_size']}"
            )
        source = source_of(args, int(args.shard_mb * 1e6))
        prepare(
            source, args.out, settings, bert["vocab_size"], tokenizer, args.workers, int(args.tokenizer_sample_mb * 1e6)
        )
    except (ValueError, OSError) as error:  # bad input: one line naming it (ShardError and ConfigError included)
        sys.exit(f"prepare.py: error: {error}")


if __name__ == "__main__":
    main()
