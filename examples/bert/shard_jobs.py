"""One shard of a preparation, made in a worker process: a piece read, split, tokenized, paired and written
(:func:`prepare_shard`), and the pool of workers that makes them (:func:`in_workers`). ``prepare.py`` plans the
pieces and writes the manifest; what crosses into a worker is plain data (:class:`Job`)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pairing
import shards
import sources
from tokenizers import Tokenizer

PIECE_SEED_STRIDE = 1_000_003
"""Between two pieces' seeds (:func:`piece_seed`)."""
MOST_RANDOM_NEXT = 0.9
"""The largest share of a shard's training pairs with a random B (label 1) taken: BERT's pairing gives about half;
all of them come from documents of one sentence each (a dataset whose rows are sentences, read a row a document),
which teach next-sentence prediction nothing."""


@dataclass(frozen=True)
class Settings:
    """What decides a preparation's shards beside its input and tokenizer."""

    max_seq_length: int
    short_seq_prob: float = 0.1
    held_out_fraction: float = 0.05
    seed: int = 0
    dupe_factor: int = 1
    format: int = shards.FORMAT


@functools.lru_cache(maxsize=2)
def _backend(path: str) -> Tokenizer:
    """The preparation's tokenizer, loaded once per worker process (``tokenizers`` alone, not ``transformers``)."""
    return Tokenizer.from_file(path)


def piece_seed(seed: int, index: int) -> int:
    """The seed of piece ``index``'s draws (held-out split, training pairs; held-out pairs take it plus one): the
    preparation's seed itself for the first piece, so a corpus of one piece is split and paired as
    :func:`pairing.split_documents` and :func:`pairing.build_examples` do with that seed."""
    return seed + PIECE_SEED_STRIDE * index


def split_piece(documents: list[pairing.Document], settings: Settings, index: int) -> tuple[list, list]:
    """A piece's (training, held-out) documents: by document, seeded by :func:`piece_seed`."""
    seed = piece_seed(settings.seed, index)
    return pairing.split_documents(documents, settings.held_out_fraction, seed=seed, minimum=2)


@dataclass(frozen=True)
class Job:
    """One shard to write: its piece, where, and with what (plain data, to cross into a worker process);
    ``tokens_from``: a prepared shard (format 2) whose tokens are paired again instead of the piece's text."""

    piece: sources.Piece
    out: str
    tokenizer: str  # the tokenizer's tokenizer.json
    identity: dict[str, Any]  # what the shard records it was made from and with
    tokens_from: Optional[str] = None


@dataclass(frozen=True)
class Tokenized:
    """A piece's ids: every sentence's tokens (training documents first), each sentence's length, each document's
    sentence count, how many documents are training ones, and what the record says of the text."""

    tokens: np.ndarray
    lengths: np.ndarray
    documents: np.ndarray
    train_documents: int
    text: dict[str, Any]  # text_bytes, text_digest


def tokenize(job: Job, settings: Settings) -> Tokenized:
    """Read, split and tokenize the job's piece."""
    documents, text_digest = job.piece.read()
    train, held = split_piece(documents, settings, job.piece.index)
    backend = _backend(job.tokenizer)
    dtype = pairing.token_dtype(backend.get_vocab_size())
    tokens, lengths = pairing.encode_flat((s for doc in [*train, *held] for s in doc), backend, dtype)
    if len(tokens) >= 2**32:
        raise ValueError(f"{_where(job)}: {len(tokens)} tokens, over a shard's 2**32: lower --shard-mb")
    sizes = np.array([len(doc) for doc in [*train, *held]], dtype=np.uint32)
    text = {"text_bytes": job.piece.text_bytes, "text_digest": text_digest}
    return Tokenized(tokens, lengths.astype(np.uint32), sizes, len(train), text)


def tokenized_shard(directory: Path) -> Tokenized:
    """A prepared shard's ids as :func:`tokenize` made them (format 2 keeps sentences and documents)."""
    record = shards.read_json(directory / shards.SHARD_RECORD, "shard record")
    if not (directory / "sentences.npy").is_file():
        raise shards.ShardError(f"{directory}: prepared before format 2 (no sentences.npy): prepare from the text")
    sizes = np.load(directory / "documents.npy")
    text = {key: record[key] for key in ("text_bytes", "text_digest")}
    train = int(record["documents"] - record["held_out_documents"])
    return Tokenized(np.load(directory / "tokens.npy"), np.load(directory / "sentences.npy"), sizes, train, text)


def prepare_shard(job: Job) -> dict[str, Any]:
    """Tokenize one piece (or take a prepared shard's tokens), pair it (``dupe_factor`` pairings of its training
    documents, one of its held-out ones) and write it as a shard; its record."""
    settings = Settings(**job.identity["settings"])
    name = shards.shard_name(job.piece.index)
    made = tokenize(job, settings) if job.tokens_from is None else tokenized_shard(Path(job.tokens_from))
    ranges = pairing.document_sentences([[None] * int(n) for n in made.documents], made.lengths)
    train_ranges, held_ranges = ranges[: made.train_documents], ranges[made.train_documents :]
    pairs = []
    for dupe in range(settings.dupe_factor):
        try:
            pairs += pairing.pair_ranges(train_ranges, settings.max_seq_length, settings.short_seq_prob, _rng(job, dupe))
        except ValueError:
            raise ValueError(
                f"{_where(job)}: fewer than two training documents with text; next-sentence prediction draws B from "
                f"another document of the same shard: give the documents' --layout, or raise --shard-mb"
            ) from None
    usable_held = sum(1 for doc in held_ranges if any(length for _, length in doc))
    held_pairs = (
        pairing.pair_ranges(held_ranges, settings.max_seq_length, settings.short_seq_prob, _rng(job, -1))
        if usable_held >= 2
        else []
    )
    arrays = {
        "tokens.npy": made.tokens,
        "pairs.npy": np.array(pairs, dtype=shards.PAIR_DTYPE),
        "held_out_pairs.npy": np.array(held_pairs, dtype=shards.PAIR_DTYPE),
        "sentences.npy": made.lengths,
        "documents.npy": made.documents,
    }
    stats = pair_stats(arrays["pairs.npy"])
    if stats["random_next_pairs"] > MOST_RANDOM_NEXT * max(1, len(pairs)):
        raise ValueError(
            f"{_where(job)}: {stats['random_next_pairs'] / len(pairs):.0%} of its next-sentence pairs take a random B "
            f"(label 1; BERT's pairing gives about half): its documents are single sentences. Rows of sentences "
            f"make documents with --group-rows N or --document-column COLUMN; text files need their --layout"
        )
    record = {
        **job.identity,
        "shard": name,
        **made.text,
        "documents": len(made.documents),
        "held_out_documents": len(made.documents) - made.train_documents,
        "sentences": len(made.lengths),
        "tokens": len(made.tokens),
        "train_pairs": len(pairs),
        "held_out_pairs": len(held_pairs),
        **stats,
    }
    return shards.write_shard(Path(job.out), name, arrays, record)


def pair_stats(pairs: np.ndarray) -> dict[str, int]:
    """Counts a manifest sums to describe training pairs: those with a random B (label 1), and the tokens the pairs
    fill (A, B and the three special tokens; over ``max_seq_length`` times the pairs, the mean fill)."""
    lengths = pairs["a_length"].astype(np.int64) + pairs["b_length"] + 3
    return {"random_next_pairs": int(pairs["next_sentence_label"].sum()), "pair_tokens": int(lengths.sum())}


def _rng(job: Job, dupe: int) -> random.Random:
    """The draws of pairing ``dupe`` of the piece's training documents (-1: its held-out ones): the piece's seed,
    plus one for the held-out pairs, plus two for each pairing after the first."""
    seed = piece_seed(job.identity["settings"]["seed"], job.piece.index)
    return random.Random(seed + 1 if dupe < 0 else seed + 2 * dupe)


def _worker_start() -> None:
    """A worker tokenizes on one core: the workers are the parallelism (tokenizers' own threads would
    oversubscribe)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _where(job: Job) -> str:
    """A job's shard and the start of its piece, for a message."""
    piece = job.identity["piece"]
    first = piece[0] if piece and isinstance(piece[0], list) else piece
    more = f" and {len(piece) - 1} more ranges" if piece and isinstance(piece[0], list) and len(piece) > 1 else ""
    return f"{shards.shard_name(job.piece.index)} ({first}{more})"


def in_workers(jobs: list[Job], workers: int, done: Callable[[dict[str, Any]], None]) -> None:
    """Each job's :func:`prepare_shard` in ``workers`` processes, at most one job each at a time, ``done`` called
    with each record as it comes. A worker that dies (killed for memory, say) is an error naming the shards in
    flight, raised as soon as its death is seen: the others are stopped, and the same command redoes them."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start) as pool:
        waiting = iter(jobs)
        running: dict[Future, Job] = {}

        def died(flight: list[Job]) -> shards.ShardError:
            return shards.ShardError(
                f"a preparation worker died (killed, e.g. for memory: lower --shard-mb or --workers) while preparing "
                f"{', '.join(_where(j) for j in flight)}: run the same command again, it redoes the shards not written"
            )

        def submit() -> None:  # the pool may be seen broken here first, when a worker dies as another one finishes
            job = next(waiting, None)
            if job is not None:
                try:
                    running[pool.submit(prepare_shard, job)] = job
                except BrokenProcessPool:
                    raise died(list(running.values())) from None

        for _ in range(workers):
            submit()
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                try:
                    record = future.result()
                except BrokenProcessPool:
                    raise died([job, *running.values()]) from None
                done(record)
                submit()
