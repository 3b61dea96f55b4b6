"""BERT's lowercase WordPiece tokenizer, trained deterministically with ``tokenizers`` (:func:`train_wordpiece`)
and wrapped for ``transformers`` (:func:`wrap_tokenizer`); :func:`train_tokenizer` caches it by corpus."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

if TYPE_CHECKING:  # imported where used: a preparation worker needs neither (torch alone is 220 MB of memory)
    import transformers
from corpora import corpus_digest
from pairing import Document

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: its id is 0, collate's default.


def _bert_tokenizer(vocab: dict[str, int] | None = None) -> Tokenizer:
    """BERT's WordPiece pipeline (lowercasing BERT normalizer, BERT word splitting) over a vocabulary, or none yet."""
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def train_wordpiece(sentences: Callable[[], Iterable[str]], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Learn a WordPiece vocabulary deterministically from the sentences ``sentences()`` yields (called twice, so a
    large sample streams from disk instead of being held) and return the pipeline using it.

    ``tokenizers``' trainer numbers the "##x" continuation pieces in hash-map
    order and breaks ties between equally frequent merges by those numbers, so
    two runs can learn different vocabularies (huggingface/tokenizers#1794).
    Declaring every "##x" up front, sorted, fixes their numbers; they are
    passed as trainer special tokens only for that, and the final tokenizer is
    rebuilt from the learned vocabulary so that they are ordinary pieces.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    draft = _bert_tokenizer()
    continuation_chars: set[str] = set()
    stream = iter(sentences())
    while batch := list(itertools.islice(stream, 1024)):  # one normalizer call per 1,024 sentences
        words = draft.pre_tokenizer.pre_tokenize_str(draft.normalizer.normalize_str("\n".join(batch)))
        continuation_chars.update(char for word, _ in words for char in word[1:])
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + [f"##{char}" for char in sorted(continuation_chars)],
        show_progress=False,
        continuing_subword_prefix="##",
    )
    draft.train_from_iterator(sentences(), trainer=trainer)
    tokenizer = _bert_tokenizer(draft.get_vocab(with_added_tokens=False))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def wrap_tokenizer(backend: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """A ``transformers`` tokenizer over a ``tokenizers`` one, with BERT's special tokens named."""
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def train_tokenizer(
    documents: Sequence[Document], vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None
) -> transformers.PreTrainedTokenizerFast:
    """Train BERT's lowercase WordPiece tokenizer on the documents' sentences (:func:`train_wordpiece`).

    With ``cache_dir`` the trained tokenizer is saved there as ``tokenizers``
    JSON under a key hashed from the settings and the corpus digest, and later
    calls with the same corpus and settings load it instead of retraining.
    """
    settings = {"vocab_size": vocab_size, "min_frequency": 2, "special_tokens": SPECIAL_TOKENS, "lowercase": True}
    cache_file = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps([settings, corpus_digest(documents)]).encode()).hexdigest()[:20]
        cache_file = Path(cache_dir) / f"bert-wordpiece-{key}.json"
        if cache_file.is_file():
            return wrap_tokenizer(Tokenizer.from_file(str(cache_file)))

    backend = train_wordpiece(lambda: (s for doc in documents for s in doc), vocab_size, settings["min_frequency"])
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(partial))
        os.replace(partial, cache_file)  # Atomic: a concurrent reader never sees half a file.
    return wrap_tokenizer(backend)
