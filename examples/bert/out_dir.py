"""What a preparation keeps in its ``--out`` besides the shards: the lock that makes it the only writer there
(:func:`locked`), and its tokenizer, trained on a sample of the corpus and keyed to the preparation it belongs to
(:func:`tokenizer_for`)."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import shards
import sources
import wordpiece
from corpus import Source
from shard_jobs import Settings, split_piece

if TYPE_CHECKING:  # imported where used: a worker process never needs it
    from transformers import PreTrainedTokenizerFast

LOCK = ".lock"
"""Held (``flock``) by the preparation writing into a directory; it names that preparation's process."""
TOKENIZER_KEY = "preparation.json"
"""Beside a trained tokenizer: the preparation it belongs to (:func:`tokenizer_for` reuses it for that one only)."""


def sample_sentences(source: Source, settings: Settings, sample_bytes: int) -> list[sources.Piece]:
    """The pieces whose training documents train the tokenizer, about ``sample_bytes`` of text drawn across the
    whole corpus: the pieces, in order, cut into as many runs as the sample needs pieces, and one piece drawn with
    the seed from each run (a corpus of ``books_*`` then ``wiki_*`` files gives both; all of a corpus no larger than
    the sample)."""
    pieces = source.pieces
    mean = sum(piece.text_bytes for piece in pieces) / len(pieces)
    runs = min(len(pieces), max(1, math.ceil(sample_bytes / max(mean, 1.0))))
    rng = random.Random(f"{settings.seed}:tokenizer")
    return [pieces[rng.randrange(len(pieces) * i // runs, len(pieces) * (i + 1) // runs)] for i in range(runs)]


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
        given = wordpiece.wrap_tokenizer(wordpiece.train_wordpiece(sentences, vocab_size))
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
