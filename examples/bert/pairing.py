"""BERT's next-sentence pairs, as BERT's ``create_pretraining_data.py`` builds them: documents (never sentences)
split into training and held-out ones (:func:`split_documents`), their sentences' ids in one flat array
(:func:`encode_flat`), and ``[CLS] A [SEP] B [SEP]`` instances as ranges of it (:func:`pair_ranges`: what
``prepare.py`` writes to a shard; :func:`build_examples` builds them in memory for a small corpus), B the true
continuation of A half of the time and a segment of another document otherwise."""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:  # imported where used: a preparation worker needs neither (torch alone is 220 MB of memory)
    import transformers

Document = list[str]
"""A document: its sentences."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Cyclic garbage collection off for a block that makes millions of acyclic objects.

    Reference counting frees them all the same; collections would only slow
    the block down: by ~20% when parsing sources, 2.5x in ``build_examples``.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- held-out split


def split_documents(
    documents: Sequence[Document], held_out_fraction: float = 0.02, seed: int | str = 0, minimum: int = 1
) -> tuple[list[Document], list[Document]]:
    """Split whole documents (never sentences) into (train, held-out), keeping the corpus order in each.

    Splitting by document keeps held-out text, and every sentence pair built
    from it, out of training (train the tokenizer on the training part too).
    When the fraction is positive and there are ``2 * minimum`` documents or
    more, each side keeps at least ``minimum`` (a preparation shard holds out
    two, so that its held-out pairs can draw a random B from another document).
    """
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    count = round(len(documents) * held_out_fraction)
    if held_out_fraction > 0 and len(documents) >= 2 * minimum:
        count = min(max(count, minimum), len(documents) - minimum)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    train = [doc for i, doc in enumerate(documents) if i not in held]
    return train, [doc for i, doc in enumerate(documents) if i in held]


# --------------------------------------------------------------------------- NSP pairs


class Pair(NamedTuple):
    """One ``[CLS] A [SEP] B [SEP]`` instance as two ranges of a flat array of token ids (no special tokens).

    A is a run of consecutive sentences of one document, B the rest of its chunk or a run of another document's
    sentences, each cut at either end by the truncation: so each is one contiguous range of the array in which the
    documents' sentences lie one after another (a prepared shard's ``tokens.npy``).
    """

    a_start: int
    a_length: int
    b_start: int
    b_length: int
    next_sentence_label: int  # 0: B follows A in the document; 1: B is from another document.


Sentence = tuple[int, int]
"""A sentence's (start, length) in the flat array of token ids."""


def _truncate(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer of the ``[start, length]`` segments, from its front or back at random, until the pair fits
    (as BERT trims its token lists)."""
    while a[1] + b[1] > max_tokens:
        longer = a if a[1] > b[1] else b
        if rng.random() < 0.5:
            longer[0] += 1
        longer[1] -= 1


def _run(sentences: Sequence[Sentence]) -> list[int]:
    """The ``[start, length]`` of consecutive sentences (empty ones, which hold no tokens, are never in a run)."""
    return [sentences[0][0], sentences[-1][0] + sentences[-1][1] - sentences[0][0]]


def _document_pairs(
    documents: Sequence[Sequence[Sentence]], position: int, max_tokens: int, short_seq_prob: float, rng: random.Random
) -> list[Pair]:
    """BERT's instances for ``documents[position]``: chunks of consecutive sentences cut into A and B.

    As in BERT's ``create_pretraining_data.py``, but a one-sentence chunk does not force a random B: when the coin
    says "actual next", A borrows the following (or preceding) sentence of its document, so NSP labels stay a fair
    coin; only a one-sentence document always gets a random B.
    """
    document = documents[position]
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    pairs, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += document[i][1]
        if i == len(document) - 1 or length >= target:
            random_next = rng.random() < 0.5
            if len(chunk) == 1 and not random_next:
                if i + 1 < len(document):
                    i += 1
                    chunk.append(document[i])
                elif i > 0:
                    chunk.insert(0, document[i - 1])
                else:
                    random_next = True
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = _run(chunk[:a_end])
            if random_next:
                other = rng.randrange(len(documents) - 1)
                other_document = documents[other + (other >= position)]
                segment_b, b_length = [], 0
                for sentence in other_document[rng.randrange(len(other_document)) :]:
                    segment_b.append(sentence)
                    b_length += sentence[1]
                    if b_length >= target - a[1]:
                        break
                i -= len(chunk) - a_end  # The sentences not used for A start the next chunk, as in BERT.
            else:
                segment_b = chunk[a_end:]
            b = _run(segment_b)
            _truncate(a, b, max_tokens, rng)
            pairs.append(Pair(a[0], a[1], b[0], b[1], int(random_next)))
            chunk, length = [], 0
        i += 1
    return pairs


def pair_ranges(
    documents: Sequence[Sequence[Sentence]], max_seq_length: int, short_seq_prob: float, rng: random.Random
) -> list[Pair]:
    """The NSP instances of documents given as their sentences' ranges in a flat array of token ids.

    Each document is cut into chunks of consecutive sentences filling ``max_seq_length - 3`` tokens (shorter with
    probability ``short_seq_prob``); A is a prefix of a chunk and B the rest of it or, half of the time, a run of
    sentences from another document. Empty sentences and documents are skipped. The same instances, in the same
    order, whether the ids are held in memory (:func:`build_examples`) or in a prepared shard.
    """
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must leave room for [CLS] A [SEP] B [SEP], got {max_seq_length}")
    usable = [kept for doc in documents if (kept := [s for s in doc if s[1]])]
    if len(usable) < 2:
        raise ValueError("next-sentence prediction needs at least two documents with text")
    return [
        pair
        for position in range(len(usable))
        for pair in _document_pairs(usable, position, max_seq_length - 3, short_seq_prob, rng)
    ]


def encode_flat(
    sentences: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, batch: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Every sentence's token ids (no special tokens) in one flat array of ``dtype``, and each sentence's length.

    Encoded ``batch`` sentences at a time with the fast ``tokenizers`` backend, so memory holds the flat arrays and
    one batch of Python ids, never the whole corpus's.
    """
    tokens, lengths, pending = [], [], []

    def flush() -> None:
        ids = [encoding.ids for encoding in tokenizer.encode_batch(pending, add_special_tokens=False)]
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens.append(np.fromiter(itertools.chain.from_iterable(ids), dtype, int(counts.sum())))
        lengths.append(counts)
        pending.clear()

    for sentence in sentences:
        pending.append(sentence)
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(tokens) if tokens else empty.astype(dtype)), (np.concatenate(lengths) if lengths else empty)


def document_sentences(documents: Sequence[Document], lengths: np.ndarray, start: int = 0) -> list[list[Sentence]]:
    """Each document's sentences as ``(start, length)`` in the flat array :func:`encode_flat` made of them (whose
    first token is at ``start``)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + start
    ranges, first = [], 0
    for doc in documents:
        ranges.append([(int(offsets[k]), int(lengths[k])) for k in range(first, first + len(doc))])
        first += len(doc)
    return ranges


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a vocabulary (uint16 up to 65,536 tokens)."""
    return np.dtype(np.min_scalar_type(max(vocab_size - 1, 0)))


class PretrainingExample(NamedTuple):
    """One unmasked ``[CLS] A [SEP] B [SEP]`` instance."""

    input_ids: list[int]
    token_type_ids: list[int]
    special_mask: list[int]  # 1 at [CLS] and the two [SEP]s: never masked.
    next_sentence_label: int  # 0: B follows A in the document; 1: B is from another document.


def assemble_segments(
    a: list[int], b: list[int], next_sentence_label: int, cls_id: int, sep_id: int
) -> PretrainingExample:
    """The instance ``[CLS] a [SEP] b [SEP]``."""
    return PretrainingExample(
        input_ids=[cls_id, *a, sep_id, *b, sep_id],
        token_type_ids=[0] * (len(a) + 2) + [1] * (len(b) + 1),
        special_mask=[1] + [0] * len(a) + [1] + [0] * len(b) + [1],
        next_sentence_label=int(next_sentence_label),
    )


def assemble(tokens: np.ndarray, pair: Pair, cls_id: int, sep_id: int) -> PretrainingExample:
    """The instance a :class:`Pair` of ranges into ``tokens`` describes."""
    a = tokens[pair.a_start : pair.a_start + pair.a_length].tolist()
    b = tokens[pair.b_start : pair.b_start + pair.b_length].tolist()
    return assemble_segments(a, b, pair.next_sentence_label, cls_id, sep_id)


def build_examples(
    documents: Sequence[Document],
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_seq_length: int = 128,
    short_seq_prob: float = 0.1,
    seed: int = 0,
) -> list[PretrainingExample]:
    """Sentence-pair instances for NSP and MLM from every document, in memory, deterministic for a seed: the
    documents' sentences :func:`encode_flat`-ed and cut by :func:`pair_ranges` (what a preparation shard holds, for
    a corpus small enough to hold; ``prepare.py`` streams a large one to disk)."""
    with gc_paused():
        dtype = token_dtype(len(tokenizer))
        tokens, lengths = encode_flat((s for doc in documents for s in doc), tokenizer.backend_tokenizer, dtype)
        pairs = pair_ranges(document_sentences(documents, lengths), max_seq_length, short_seq_prob, random.Random(seed))
        return [assemble(tokens, pair, tokenizer.cls_token_id, tokenizer.sep_token_id) for pair in pairs]
