"""Training batches from prepared shards: the sample order, the micro-batches a rank trains on, the loader workers.

The order of an epoch is a pseudorandom permutation of the global pair indices, evaluated per position
(:func:`permute`, a keyed Feistel network): nothing of the size of the corpus is ever built. Step ``s`` of epoch
``s // steps_per_epoch`` takes the next global batch of positions, laid out as (accumulation, rank, micro-batch)
(:class:`PairOrder`), so a micro-batch's pairs are a function of (seed, step, rank) and the global batch of a step a
function of (seed, step) alone: ``--resume`` continues exactly, and a resume at another world size with the same
global batch trains on the same pairs in every step. Reading, masking and collation run in ``DataLoader`` workers
that prefetch whole micro-batches (:func:`loader`), so the step does not wait on data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import data
import numpy as np
import shards
import torch
from torch.utils.data import DataLoader, Dataset

Key = tuple[int, tuple[int, ...]]
"""A micro-batch: (epoch, the global indices of its pairs)."""
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a 64-bit mix (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _MULTIPLIERS[0]
    x = (x ^ (x >> np.uint64(27))) * _MULTIPLIERS[1]
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, key: str, rounds: int = 6) -> np.ndarray:
    """The values at ``positions`` (each in ``[0, n)``) of a pseudorandom permutation of ``range(n)`` keyed by
    ``key``: a balanced Feistel network on the smallest even number of bits covering ``n``, cycle-walked into
    range. Memory and time are proportional to ``len(positions)``, not to ``n``."""
    positions = np.asarray(positions, dtype=np.int64)
    if n <= 0 or (positions.size and (positions.min() < 0 or positions.max() >= n)):
        raise ValueError(f"positions must lie in [0, {n})")
    half = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
    mask = (np.uint64(1) << half) - np.uint64(1)
    keys = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=8 * rounds).digest(), dtype="<u8")
    out = positions.astype(np.uint64)
    todo = np.arange(out.size)
    while todo.size:  # cycle walking: values outside [0, n) go round again; each step is a bijection
        left, right = out[todo] >> half, out[todo] & mask
        for round_key in keys:
            left, right = right, left ^ (_mix(right ^ round_key) & mask)
        value = (left << half) | right
        out[todo] = value
        todo = todo[value >= np.uint64(n)]
    return out.astype(np.int64)


class PairOrder:
    """Which pairs each micro-batch of one rank holds: ``micro`` per micro-batch, ``accum`` micro-batches per step,
    ``world`` ranks; epoch ``e`` is :func:`permute` keyed ``"<seed>:<e>"``, its last partial global batch unused."""

    def __init__(self, count: int, micro: int, accum: int, world: int, rank: int, seed: int) -> None:
        self.count, self.micro, self.accum, self.world, self.rank, self.seed = count, micro, accum, world, rank, seed
        self.global_batch = micro * accum * world
        self.steps_per_epoch = count // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{count} training pairs cannot fill one global batch of {self.global_batch}")

    def step(self, step: int) -> list[Key]:
        """The rank's micro-batches of optimizer step ``step`` (0-based), in accumulation order."""
        epoch, position = divmod(step, self.steps_per_epoch)
        positions = np.arange(position * self.global_batch, (position + 1) * self.global_batch)
        rows = permute(positions, self.count, f"{self.seed}:{epoch}").reshape(self.accum, self.world, self.micro)
        return [(epoch, tuple(row.tolist())) for row in rows[:, self.rank]]


class StepKeys:
    """The micro-batch keys of steps ``[start, stop)`` in order, made as the loader asks for them."""

    def __init__(self, order: Any, start: int, stop: int) -> None:
        self.order, self.start, self.stop = order, start, stop

    def __iter__(self) -> Iterator[Any]:
        for step in range(self.start, self.stop):
            yield from self.order.step(step)

    def __len__(self) -> int:
        return (self.stop - self.start) * self.order.accum


class ShardBatches(Dataset):
    """Collated micro-batches of prepared shards: each pair masked by an RNG seeded by (seed, epoch, index), as
    :class:`data.PretrainingDataset` masks, so a batch is the same whichever worker makes it."""

    def __init__(
        self, shards_: shards.ShardSet, vocab: data.Vocabulary, cls_id: int, sep_id: int, seed: int, split: str
    ) -> None:
        self.shards, self.vocab, self.cls_id, self.sep_id, self.seed, self.split = (
            shards_, vocab, cls_id, sep_id, seed, split,
        )  # fmt: skip

    def item(self, epoch: int, index: int) -> dict[str, Any]:
        example = self.shards.example(self.split, index, self.cls_id, self.sep_id)
        return data.masked_item(example, self.vocab, f"{self.seed}:{epoch}:{index}")

    def __getitem__(self, key: Key) -> dict[str, np.ndarray]:
        epoch, indices = key
        return data.collate_arrays([self.item(epoch, index) for index in indices], self.vocab.pad_id)


def held_out_keys(starts: np.ndarray, count: int, micro: int) -> list[Key]:
    """The held-out micro-batches evaluated, masked as epoch 0: ``count`` pairs taken from the front of every shard
    (``starts``: each shard's first global index, and the total), as evenly as the shards' sizes allow, so that a
    corpus's every piece is scored (one shard: its first ``count`` pairs). The same for every run of a corpus."""
    sizes = np.diff(starts)
    share = np.zeros_like(sizes)
    left = min(count, int(sizes.sum()))
    while left:  # one more pair from each shard that has one, in shard order, until enough
        more = (share < sizes) & (np.cumsum(share < sizes) <= left)
        share += more
        left -= int(more.sum())
    chosen = [int(start) + k for start, n in zip(starts[:-1], share) for k in range(n)]
    return [(0, tuple(chosen[j : j + micro])) for j in range(0, len(chosen), micro)]


def as_is(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The loader's collate function: a micro-batch arrives collated, as numpy arrays, and crosses from the worker
    by pickle (0.4-0.5 ms a micro-batch of 32 x 64 on the 2-core CPU machine, against 2.1 ms for the same five
    arrays as tensors through shared memory)."""
    return batch


def tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A micro-batch as ``BertForPreTraining.forward``'s keyword arguments (sharing the arrays' memory)."""
    return {key: torch.from_numpy(value) for key, value in batch.items()}


def loader(dataset: Dataset, keys: Iterable[Any], workers: int, prefetch: int) -> Iterator[dict[str, torch.Tensor]]:
    """Each key's micro-batch, made in ``workers`` processes (none: in this one) ``prefetch`` micro-batches ahead."""
    made = DataLoader(
        dataset,
        batch_size=None,
        sampler=keys,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        collate_fn=as_is,
    )
    return (tensors(batch) for batch in made)
