"""BERT's masked-LM corruption and batching: masks drawn per access (dynamic masking, as RoBERTa and NVIDIA's
recipe do), from an RNG seeded by (seed, epoch, example), so a run is reproducible whatever the data loader's
order or number of workers (:func:`masked_item`); items padded and stacked as ``BertForPreTraining``'s
arguments (:func:`collate_arrays`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # imported where used: a preparation worker needs neither (torch alone is 220 MB of memory)
    import torch
    import transformers
from pairing import PretrainingExample

IGNORE_INDEX = -100  # What torch's cross-entropy (and BertForPreTraining) skips.


class Vocabulary(NamedTuple):
    """What masking needs of a tokenizer (small and picklable, for data-loader workers)."""

    size: int
    mask_id: int
    pad_id: int
    special_ids: frozenset[int]

    @classmethod
    def of(cls, tokenizer: transformers.PreTrainedTokenizerBase) -> "Vocabulary":
        special = frozenset(tokenizer.all_special_ids)
        return cls(len(tokenizer), tokenizer.mask_token_id, tokenizer.pad_token_id, special)


def mask_tokens(
    input_ids: Sequence[int],
    special_mask: Sequence[int],
    vocab: Vocabulary,
    rng: random.Random,
    mlm_probability: float = 0.15,
) -> tuple[list[int], list[int]]:
    """BERT's masked-LM corruption: return (corrupted ids, labels).

    ``round(mlm_probability * n)`` of the n non-special positions (at least one
    when the probability is positive) are chosen; each becomes [MASK] with
    probability 0.8, a token drawn uniformly from the non-special vocabulary
    with probability 0.1, and stays as it is otherwise. Labels hold the
    original id at chosen positions and -100 (ignored by the loss) elsewhere.
    """
    candidates = [pos for pos, special in enumerate(special_mask) if not special]
    count = round(len(candidates) * mlm_probability)
    if mlm_probability > 0 and candidates:
        count = max(count, 1)
    corrupted, labels = list(input_ids), [IGNORE_INDEX] * len(input_ids)
    for pos in sorted(rng.sample(candidates, count)):
        labels[pos] = input_ids[pos]
        draw = rng.random()
        if draw < 0.8:
            corrupted[pos] = vocab.mask_id
        elif draw < 0.9:
            token = rng.randrange(vocab.size)
            while token in vocab.special_ids:
                token = rng.randrange(vocab.size)
            corrupted[pos] = token
    return corrupted, labels


def masked_item(
    example: PretrainingExample, vocab: Vocabulary, key: str, mlm_probability: float = 0.15
) -> dict[str, list[int] | int]:
    """An instance with its masks drawn from an RNG seeded by ``key`` (``"seed:epoch:index"``: a string seed hashes
    with SHA-512, stably), as ``BertForPreTraining.forward``'s unpadded keyword arguments."""
    input_ids, labels = mask_tokens(
        example.input_ids, example.special_mask, vocab, random.Random(key), mlm_probability
    )
    return {
        "input_ids": input_ids,
        "token_type_ids": example.token_type_ids,
        "labels": labels,
        "next_sentence_label": example.next_sentence_label,
    }


# --------------------------------------------------------------------------- dataset and batching


class PretrainingDataset:
    """A map-style dataset (``__len__``, ``__getitem__``, as ``DataLoader`` and ``Trainer`` take) of examples with
    masks drawn per access (dynamic masking), from an RNG seeded by (seed, epoch, index).

    Every epoch (see ``set_epoch``) sees fresh masks, yet an item is the same
    whichever worker loads it and in whatever order. With persistent DataLoader
    workers call ``set_epoch`` before the workers are started, as they hold a
    copy of the dataset. For a corpus held in memory (the Trainer example); the
    pretraining script reads prepared shards (``loading.py``).
    """

    def __init__(
        self,
        examples: Sequence[PretrainingExample],
        tokenizer: transformers.PreTrainedTokenizerBase,
        mlm_probability: float = 0.15,
        seed: int = 0,
    ) -> None:
        self.examples = list(examples)
        self.vocab = Vocabulary.of(tokenizer)
        self.mlm_probability = mlm_probability
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the masks of another epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int] | int]:
        key = f"{self.seed}:{self.epoch}:{index}"
        return masked_item(self.examples[index], self.vocab, key, self.mlm_probability)


def collate_arrays(batch: Sequence[dict[str, list[int] | int]], pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """Pad items to the longest and stack them as ``BertForPreTraining.forward``'s keyword arguments, in int64
    numpy arrays (which cross from a data-loader worker by pickle, cheaper than tensors through shared memory).

    ``pad_token_id`` defaults to 0, the id of [PAD] in ``train_tokenizer``'s
    vocabulary. Padding gets attention mask 0 and label -100.
    """
    length = max(len(item["input_ids"]) for item in batch)
    shape = (len(batch), length)
    arrays = {
        "input_ids": np.full(shape, pad_token_id, dtype=np.int64),
        "token_type_ids": np.zeros(shape, dtype=np.int64),
        "attention_mask": np.zeros(shape, dtype=np.int64),
        "labels": np.full(shape, IGNORE_INDEX, dtype=np.int64),
    }
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        arrays["input_ids"][row, :n] = item["input_ids"]
        arrays["token_type_ids"][row, :n] = item["token_type_ids"]
        arrays["attention_mask"][row, :n] = 1
        arrays["labels"][row, :n] = item["labels"]
    arrays["next_sentence_label"] = np.array([item["next_sentence_label"] for item in batch], dtype=np.int64)
    return arrays


def collate(batch: Sequence[dict[str, list[int] | int]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """:func:`collate_arrays` as tensors (a ``DataLoader``'s or ``Trainer``'s collate function)."""
    import torch

    return {key: torch.from_numpy(value) for key, value in collate_arrays(batch, pad_token_id).items()}
