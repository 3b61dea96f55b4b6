"""Training batches from prepared shards: the sample order, the micro-batches a rank trains on, the loader workers.

An epoch's order is a permutation of the global pair indices, of one of two kinds (:data:`ORDERS`, the switch
``pretrain.py --sample-order``): ``keyed``, the default for prepared shards, a keyed bijection of ``range(count)``
computed position by position (:func:`keyed_permutation`: a 4-round Feistel network over the next even power of two,
cycle-walked into the range), so a rank holds nothing that grows with the corpus; and ``randperm``, the embedded
corpus's, ``torch.randperm`` from a generator seeded ``seed * 7919 + epoch`` (:func:`epoch_order`: the order this
example has always drawn, so its recorded runs are reproduced), held as int32 while the epoch lasts (4 bytes a pair:
48 MB at 12.1 million pairs, 1.2 GB at 100 GB of text; its values depend on torch's version, which its name in a
checkpoint records). Either way, step ``s`` of epoch ``s // steps_per_epoch`` takes the next global batch of
positions, laid out as (accumulation, rank, micro-batch) (:class:`PairOrder`), so a micro-batch's pairs are a
function of (seed, step, rank) and the global batch of a step a function of (seed, step) alone: ``--resume``
continues exactly, and a resume at another world size with the same global batch trains on the same pairs in every
step. Reading, masking and collation run in ``DataLoader`` workers that prefetch whole micro-batches
(:func:`loader`), so the step does not wait on data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import faults
import masking
import numpy as np
import shards
import torch
from torch.utils.data import DataLoader, Dataset

Key = tuple[int, tuple[int, ...]]
"""A micro-batch: (epoch, the global indices of its pairs)."""
ORDERS = ("keyed", "randperm")
"""The kinds of sample order (the module docstring)."""
_GOLDEN = 0x9E3779B97F4A7C15


def order_name(kind: str) -> str:
    """The order's name as checkpoints record it: its kind and the version of what computes it."""
    return "keyed-feistel-1" if kind == "keyed" else f"randperm-7919-torch-{torch.__version__}"


def epoch_order(count: int, seed: int) -> np.ndarray:
    """A permutation of ``range(count)`` from ``torch.randperm`` seeded ``seed``, as int32 where the indices fit."""
    dtype = torch.int32 if count < 2**31 else torch.int64  # the same permutation in either dtype
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed), dtype=dtype).numpy()


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic): a well-spread hash of each value."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_permutation(positions: np.ndarray, count: int, seed: int) -> np.ndarray:
    """The images of ``positions`` under a bijection of ``range(count)`` keyed by ``seed``: a 4-round Feistel
    network on ``2 * half`` bits (``4 ** half`` at most 4 ``count``), applied again to an image outside the range
    until it falls inside (cycle walking keeps a bijection; at most 4 rounds trips on average). O(1) memory."""
    half = max(1, (max(count - 1, 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    keys = _mix(np.arange(1, 5, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(seed % 2**64))
    out = np.asarray(positions, dtype=np.uint64).copy()
    walking = np.ones(len(out), dtype=bool)
    while walking.any():
        left, right = out[walking] >> shift, out[walking] & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        out[walking] = (left << shift) | right
        walking = out >= np.uint64(count)
    return out.astype(np.int64)


class PairOrder:
    """Which pairs each micro-batch of one rank holds: ``micro`` per micro-batch, ``accum`` micro-batches per step,
    ``world`` ranks; epoch ``e`` is a permutation of the ``kind`` (:data:`ORDERS`) seeded ``seed * 7919 + e``, its
    last partial global batch unused."""

    def __init__(
        self, count: int, micro: int, accum: int, world: int, rank: int, seed: int, kind: str = "keyed"
    ) -> None:
        if kind not in ORDERS:
            raise ValueError(f"sample order {kind!r}: expected one of {', '.join(ORDERS)}")
        self.count, self.micro, self.accum, self.world, self.rank, self.seed = count, micro, accum, world, rank, seed
        self.kind = kind
        self.global_batch = micro * accum * world
        self.steps_per_epoch = count // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{count} training pairs cannot fill one global batch of {self.global_batch}")
        self._epoch: tuple[int, np.ndarray] | None = None

    def step(self, step: int) -> list[Key]:
        """The rank's micro-batches of optimizer step ``step`` (0-based), in accumulation order."""
        epoch, position = divmod(step, self.steps_per_epoch)
        seed, window = self.seed * 7919 + epoch, slice(position * self.global_batch, (position + 1) * self.global_batch)
        if self.kind == "keyed":
            batch = keyed_permutation(np.arange(window.start, window.stop), self.count, seed)
        else:
            if self._epoch is None or self._epoch[0] != epoch:
                self._epoch = None  # the last epoch's order is let go before the next is drawn
                self._epoch = epoch, epoch_order(self.count, seed)
            batch = self._epoch[1][window]
        rows = batch.reshape(self.accum, self.world, self.micro)[:, self.rank]
        return [(epoch, tuple(row.tolist())) for row in rows]


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
    :class:`masking.PretrainingDataset` masks, so a batch is the same whichever worker makes it."""

    def __init__(
        self, shards_: shards.ShardSet, vocab: masking.Vocabulary, cls_id: int, sep_id: int, seed: int, split: str
    ) -> None:
        self.shards, self.vocab, self.cls_id, self.sep_id, self.seed, self.split = (
            shards_, vocab, cls_id, sep_id, seed, split,
        )  # fmt: skip

    def item(self, epoch: int, index: int) -> dict[str, Any]:
        example = self.shards.example(self.split, index, self.cls_id, self.sep_id)
        return masking.masked_item(example, self.vocab, f"{self.seed}:{epoch}:{index}")

    @faults.caught
    def __getitem__(self, key: Key) -> dict[str, np.ndarray]:
        epoch, indices = key
        return masking.collate_arrays([self.item(epoch, index) for index in indices], self.vocab.pad_id)


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


def held_out(dataset: Dataset, keys: Iterable[Any]) -> list[dict[str, torch.Tensor]]:
    """The held-out micro-batches, made here before step 1: a fault in them refuses the run (a ``ValueError``)."""
    made = [dataset[key] for key in keys]
    fault = next((batch for batch in made if isinstance(batch, faults.Fault)), None)
    if fault is not None:
        raise ValueError(fault.message)
    return [tensors(batch) for batch in made]


def loader(
    dataset: Dataset, keys: Iterable[Any], workers: int, prefetch: int
) -> Iterator[dict[str, torch.Tensor] | faults.Fault]:
    """Each key's micro-batch, made in ``workers`` processes (none: in this one) ``prefetch`` micro-batches ahead;
    a :class:`faults.Fault` where one could not be made."""
    made = DataLoader(
        dataset,
        batch_size=None,
        sampler=keys,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        collate_fn=as_is,
    )
    return (batch if isinstance(batch, faults.Fault) else tensors(batch) for batch in made)
