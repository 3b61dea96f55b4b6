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
import functools
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import data  # noqa: E402
import recipe  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402

PIECE_SEED_STRIDE = 1_000_003
"""Between two pieces' seeds (:func:`piece_seed`)."""
PIECE_BYTES = 32_000_000
"""Text per shard by default (``--shard-mb``): a worker holds one piece's text, documents and ids at a time."""
VERSIONED = ("numpy", "tokenizers", "transformers")

if TYPE_CHECKING:  # imported where used: a worker process reads, tokenizes and writes without it
    from transformers import PreTrainedTokenizerFast
"""Packages whose versions the manifest records (with Python's)."""


@dataclass(frozen=True)
class Settings:
    """What decides a preparation's shards beside its input and tokenizer."""

    max_seq_length: int
    short_seq_prob: float = 0.1
    held_out_fraction: float = 0.05
    seed: int = 0
    format: int = shards.FORMAT


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


# --------------------------------------------------------------------------- one shard (in a worker)

@functools.lru_cache(maxsize=2)
def _backend(path: str) -> Tokenizer:
    """The preparation's tokenizer, loaded once per worker process (``tokenizers`` alone, not ``transformers``)."""
    return Tokenizer.from_file(path)


def piece_seed(seed: int, index: int) -> int:
    """The seed of piece ``index``'s draws (held-out split, training pairs; held-out pairs take it plus one): the
    preparation's seed itself for the first piece, so a corpus of one piece is split and paired as
    :func:`data.split_documents` and :func:`data.build_examples` do with that seed."""
    return seed + PIECE_SEED_STRIDE * index


def split_piece(documents: list[data.Document], settings: Settings, index: int) -> tuple[list, list]:
    """A piece's (training, held-out) documents: by document, seeded by :func:`piece_seed`."""
    seed = piece_seed(settings.seed, index)
    return data.split_documents(documents, settings.held_out_fraction, seed=seed, minimum=2)


@dataclass(frozen=True)
class Job:
    """One shard to write: its piece, where, and with what (plain data, to cross into a worker process)."""

    piece: sources.Piece
    out: str
    tokenizer: str  # the tokenizer's tokenizer.json
    identity: dict[str, Any]  # what the shard records it was made from and with


def prepare_shard(job: Job) -> dict[str, Any]:
    """Read, split, tokenize and pair one piece, and write it as a shard; its record."""
    settings = Settings(**job.identity["settings"])
    piece, name = job.piece, shards.shard_name(job.piece.index)
    documents, text_digest = piece.read()
    train, held = split_piece(documents, settings, piece.index)
    backend = _backend(job.tokenizer)
    dtype = data.token_dtype(backend.get_vocab_size())
    train_sentences = sum(map(len, train))
    tokens, lengths = data.encode_flat((s for doc in [*train, *held] for s in doc), backend, dtype)
    if len(tokens) >= 2**32:
        where = f"{name} ({job.identity['piece']})"
        raise ValueError(f"{where}: {len(tokens)} tokens, over a shard's 2**32: lower --shard-mb")
    train_ranges = data.document_sentences(train, lengths[:train_sentences])
    held_ranges = data.document_sentences(held, lengths[train_sentences:], int(lengths[:train_sentences].sum()))
    try:
        pairs = data.pair_ranges(train_ranges, settings.max_seq_length, settings.short_seq_prob, _rng(job, "train"))
    except ValueError:
        raise ValueError(
            f"{name} ({job.identity['piece']}): fewer than two training documents with text; next-sentence prediction "
            f"draws B from another document of the same shard: separate documents with blank lines, or raise --shard-mb"
        ) from None
    usable_held = sum(1 for doc in held_ranges if any(length for _, length in doc))
    held_pairs = (
        data.pair_ranges(held_ranges, settings.max_seq_length, settings.short_seq_prob, _rng(job, "held_out"))
        if usable_held >= 2
        else []
    )
    arrays = {
        "tokens.npy": tokens,
        "pairs.npy": np.array(pairs, dtype=shards.PAIR_DTYPE),
        "held_out_pairs.npy": np.array(held_pairs, dtype=shards.PAIR_DTYPE),
    }
    record = {
        **job.identity,
        "shard": name,
        "text_bytes": piece.text_bytes,
        "text_digest": text_digest,
        "documents": len(documents),
        "held_out_documents": len(held),
        "sentences": len(lengths),
        "tokens": len(tokens),
        "train_pairs": len(pairs),
        "held_out_pairs": len(held_pairs),
    }
    return shards.write_shard(Path(job.out), name, arrays, record)


def _rng(job: Job, split: str) -> random.Random:
    return random.Random(piece_seed(job.identity["settings"]["seed"], job.piece.index) + (split == "held_out"))


def _worker_start() -> None:
    """A worker tokenizes on one core: the workers are the parallelism (tokenizers' own threads would
    oversubscribe)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


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
    """The preparation's tokenizer, saved in ``out/tokenizer``: the one given, or one trained on a sample (kept from
    an interrupted run of the same preparation)."""
    from transformers import PreTrainedTokenizerFast

    directory = out / shards.TOKENIZER
    if directory.is_dir():
        kept = PreTrainedTokenizerFast.from_pretrained(str(directory))
        if given is not None and shards.tokenizer_digest(kept) != shards.tokenizer_digest(given):
            raise shards.ShardError(f"{directory}: another tokenizer than the one given holds this directory's shards")
        if given is None and len(kept) != vocab_size:
            raise shards.ShardError(
                f"{directory}: a {len(kept)}-token vocabulary, the config's bert.vocab_size is {vocab_size}"
            )
        return kept
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
    os.rename(partial, directory)
    return given


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
    """Prepare ``source`` into ``out`` (or find it prepared there); the manifest. See the module docstring."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / shards.MANIFEST).is_file():
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
        context = multiprocessing.get_context("spawn")
        with context.Pool(min(workers, len(jobs)), initializer=_worker_start) as pool:
            for record in pool.imap_unordered(prepare_shard, jobs):
                records[int(record["shard"].removeprefix("shard-"))] = record
                bar.update(record["text_bytes"])
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
