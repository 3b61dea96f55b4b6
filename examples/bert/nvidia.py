"""NVIDIA's preprocessed BERT shards (HDF5), read as they are: ``pretrain.py --nvidia-hdf5 DIR``.

NVIDIA's BERT recipe, DeepSpeedExamples' and KAISA's BERT code train on HDF5 files written by NVIDIA's
``create_pretraining_data.py``, one file per shard, each holding ``N`` instances with their masks drawn once, at
preparation (static masking)::

    input_ids             [N, seq]       int32   the masked token ids, padded with 0
    input_mask            [N, seq]       int8    1 on tokens, 0 on padding (the attention mask)
    segment_ids           [N, seq]       int8    0 for [CLS] A [SEP], 1 for B [SEP] (token types)
    masked_lm_positions   [N, max_pred]  int32   the masked positions, padded with 0
    masked_lm_ids         [N, max_pred]  int32   the original ids there
    next_sentence_labels  [N]            int8    1 where B is a random segment

(phase 1: seq 128, max_pred 20; phase 2: 512 and 80; any sequence length the config's ``bert.max_seq_length``
names is read, and a file of another length is refused by name). Files with "training" in their name are trained
on, those with "test" held out, as NVIDIA's loader picks them. Each rank reads its own files as NVIDIA's
``run_pretraining.py`` assigns them: the sorted training files shuffled per epoch by ``random.Random(seed + epoch)``,
rank ``r`` reading ``files[(f * world + r) % n]`` in round ``f`` of ``n`` (shifted by ``world % n`` per round when
there are more ranks than files). Within a file the rows come in a permutation seeded by (seed, epoch, round, rank),
in micro-batches (a last partial one unused); like NVIDIA's loader, a worker holds the file it reads in memory, one
file at a time, so memory follows the largest file, never the corpus. The labels are NVIDIA's: -100 (ignored)
everywhere but ``masked_lm_positions[:k]``, ``k`` the first padded (0) position, which hold ``masked_lm_ids``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import faults
import numpy as np
import nvidia_ahead
from loading import epoch_order, order_name
from torch.utils.data import Dataset

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
PER_TOKEN = ("input_ids", "input_mask", "segment_ids")
PER_PREDICTION = ("masked_lm_positions", "masked_lm_ids")
ORDER = f"nvidia-rounds-1, rows {order_name('randperm')}"
Rows = tuple[int, int, tuple[int, ...]]
"""A micro-batch: its visit (the rank's epoch * files + round; -1 for held-out files), its file's index, its rows."""
"""The file and row order's kind, recorded in checkpoints."""


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise ImportError("--nvidia-hdf5 reads HDF5 with h5py: pip install h5py") from None
    return h5py


@dataclass(frozen=True)
class File:
    """One HDF5 shard and its instance count."""

    path: str
    rows: int


def _check(path: Path, max_seq_length: int) -> File:
    """``path`` as a :class:`File`, or a ``ValueError`` naming it and what in it is not NVIDIA's layout."""
    h5py = _h5py()
    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        raise ValueError(f"{path}: not a readable HDF5 file ({error})") from None
    with handle:
        missing = [key for key in KEYS if key not in handle]
        if missing:
            raise ValueError(f"{path}: no dataset {', '.join(missing)} (NVIDIA's shards hold {', '.join(KEYS)})")
        shapes = {key: handle[key].shape for key in KEYS}
        for key in KEYS:
            if handle[key].dtype.kind not in "iu":
                raise ValueError(f"{path}: {key} holds {handle[key].dtype}, not integers")
    rows = shapes["next_sentence_labels"][0] if len(shapes["next_sentence_labels"]) == 1 else None
    seq, predictions = shapes["input_ids"][1:], shapes["masked_lm_positions"][1:]
    if (
        rows is None
        or len(seq) != 1
        or len(predictions) != 1
        or any(shapes[key] != (rows, *seq) for key in PER_TOKEN)
        or any(shapes[key] != (rows, *predictions) for key in PER_PREDICTION)
    ):
        raise ValueError(f"{path}: shapes {shapes} are not NVIDIA's [N, seq] / [N, max_pred] / [N]")
    if seq[0] != max_seq_length:
        raise ValueError(f"{path}: sequence length {seq[0]}, the config's bert.max_seq_length is {max_seq_length}")
    return File(str(path), rows)


def discover(root: str | Path, max_seq_length: int) -> tuple[list[File], list[File]]:
    """The (training, test) files of a directory of NVIDIA shards, sorted by name, each checked (before step 1)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: no such directory of NVIDIA HDF5 shards")
    names = sorted(p for p in root.iterdir() if p.is_file())
    training = [_check(p, max_seq_length) for p in names if "training" in p.name]
    test = [_check(p, max_seq_length) for p in names if "test" in p.name and "training" not in p.name]
    if not training:
        raise ValueError(f"{root} holds no NVIDIA training shards (files with 'training' in their names)")
    return training, test


class NvidiaOrder:
    """Which rows each micro-batch of one rank holds (see the module docstring): a function of (seed, rank, world
    size, micro-batch number), so ``--resume`` continues exactly."""

    def __init__(self, files: list[File], micro: int, accum: int, world: int, rank: int, seed: int) -> None:
        if all(f.rows < micro for f in files):
            largest = max(f.rows for f in files)
            raise ValueError(f"no training file holds a micro-batch of {micro} rows (the largest holds {largest})")
        self.files, self.micro, self.accum, self.world, self.rank, self.seed = files, micro, accum, world, rank, seed
        self._round: tuple[tuple[int, int], np.ndarray] | None = None
        self._ends: list[int] = []  # micro-batches up to the end of each epoch counted so far
        self._table: tuple[int, list[int], list[int]] | None = None  # an epoch, its files, batches to each's end

    def rounds(self, epoch: int) -> list[int]:
        """The files this rank reads in each round of ``epoch``, as NVIDIA's ``run_pretraining.py`` assigns them."""
        n = len(self.files)
        order = list(range(n))
        random.Random(self.seed + epoch).shuffle(order)
        shift = self.world % n if self.world > n else 0
        return [order[(f * self.world + self.rank + shift * f) % n] for f in range(n)]

    def _epoch(self, epoch: int) -> int:
        """Micro-batches before ``epoch``: each epoch's count is taken once, so finding a micro-batch's epoch is a
        binary search, however far into the run (an epoch whose files give this rank none adds nothing: with more
        ranks than files a rank can draw only files under a micro-batch in some epoch, and moves on to the next)."""
        while len(self._ends) <= epoch:
            count = sum(self.files[i].rows // self.micro for i in self.rounds(len(self._ends)))
            self._ends.append((self._ends[-1] if self._ends else 0) + count)
        return self._ends[epoch - 1] if epoch else 0

    def micro_batch(self, number: int) -> Rows:
        """The rank's ``number``-th micro-batch (0-based): (its visit, the file's index, its rows); two binary
        searches, the epoch's file order kept while it lasts."""
        while not self._ends or number >= self._ends[-1]:
            self._epoch(len(self._ends))
        epoch = bisect.bisect_right(self._ends, number)
        number -= self._epoch(epoch)
        if self._table is None or self._table[0] != epoch:
            rounds = self.rounds(epoch)
            self._table = epoch, rounds, list(itertools.accumulate(self.files[i].rows // self.micro for i in rounds))
        _, rounds, ends = self._table
        round_ = bisect.bisect_right(ends, number)
        number -= ends[round_ - 1] if round_ else 0
        rows = self._rows(epoch, round_, rounds[round_])[number * self.micro : (number + 1) * self.micro]
        return epoch * len(self.files) + round_, rounds[round_], tuple(rows.tolist())

    def visits(self, start: int) -> Iterator[tuple[int, int, int, int]]:
        """The rank's visits of files from the one holding micro-batch ``start`` on, endlessly: (visit, file index,
        its first micro-batch, the one after its last); a file under a micro-batch gives none."""
        self.micro_batch(start)  # counts the epochs up to start's
        epoch = bisect.bisect_right(self._ends, start)
        while True:
            first = self._epoch(epoch)
            for round_, index in enumerate(self.rounds(epoch)):
                count = self.files[index].rows // self.micro
                if count and first + count > start:
                    yield epoch * len(self.files) + round_, index, first, first + count
                first += count
            epoch += 1

    def _rows(self, epoch: int, round_: int, index: int) -> np.ndarray:
        """The order of file ``index``'s rows in ``round_`` of ``epoch`` (:func:`loading.epoch_order`, seeded by
        the seed, epoch, round and rank), kept while that round lasts."""
        key = (epoch, round_)
        if self._round is None or self._round[0] != key:
            seed = ((self.seed * 7919 + epoch) * 1_000_003 + round_) * 65_537 + self.rank
            self._round = key, epoch_order(self.files[index].rows, seed)
        return self._round[1]

    def step(self, step: int) -> list[Rows]:
        return [self.micro_batch(step * self.accum + m) for m in range(self.accum)]


def held_out_keys(files: list[File], count: int, micro: int) -> list[Rows]:
    """The first ``count`` rows of the test files, in order, as micro-batches (never across files; read directly,
    visit -1)."""
    keys: list[Rows] = []
    for index, file in enumerate(files):
        for start in range(0, file.rows, micro):
            if count <= 0:
                return keys
            rows = tuple(range(start, min(start + micro, file.rows, start + count)))
            keys.append((-1, index, rows))
            count -= len(rows)
    return keys


def read_file(path: str) -> dict[str, np.ndarray]:
    """Every array of an NVIDIA shard, decompressed; an ``OSError`` naming the file where its data cannot be read
    (corrupt compression past a readable header, a file cut short)."""
    try:
        with _h5py().File(path, "r") as handle:
            return {key: np.asarray(handle[key][:]) for key in KEYS}
    except (OSError, ValueError, KeyError) as error:
        raise OSError(f"{path}: cannot read its arrays ({error})") from None


def verify(files: list[File], vocab_size: int) -> list[str]:
    """Problems found reading each of ``files`` whole: data that does not decompress, ids outside the vocabulary,
    masked positions outside the sequence (each rank checks a share, once: ``pretrain.py`` stamps what passed)."""
    problems = []
    for file in files:
        try:
            check_values(file.path, read_file(file.path), vocab_size)
        except (OSError, ValueError) as error:
            problems.append(str(error))
    return problems


def check_values(path: str, arrays: dict[str, np.ndarray], vocab_size: int) -> None:
    """A ``ValueError`` naming ``path`` where ids fall outside the vocabulary or masked positions outside the
    sequence (both would fail in the model, far from the file)."""
    for name in ("input_ids", "masked_lm_ids"):
        values = arrays[name]
        if values.size and (int(values.max()) >= vocab_size or int(values.min()) < 0):
            bad = int(values.max()) if int(values.max()) >= vocab_size else int(values.min())
            raise ValueError(f"{path}: {name} holds id {bad}, the config's bert.vocab_size is {vocab_size}")
    seq, positions = arrays["input_ids"].shape[-1], arrays["masked_lm_positions"]
    if positions.size and (int(positions.max()) >= seq or int(positions.min()) < 0):
        raise ValueError(f"{path}: masked_lm_positions holds {int(positions.max())}, outside a sequence of {seq}")


class NvidiaBatches(Dataset):
    """Collated micro-batches of NVIDIA shards, with NVIDIA's labels. The file being read is held: mapped from the
    copy the rank's reader made ahead (``shared``: its directory and process id, :mod:`nvidia_ahead`), or, without
    one (held-out files), read here."""

    def __init__(self, files: list[File], vocab_size: int, shared: Optional[tuple[str, int]] = None) -> None:
        self.files, self.vocab_size, self.shared = files, vocab_size, shared
        self._held: tuple[int, dict[str, np.ndarray]] | None = None

    def _arrays(self, visit: int, index: int) -> dict[str, np.ndarray]:
        if self._held is None or self._held[0] != (visit, index):
            self._held = None  # the previous file is let go before the next is read
            path = self.files[index].path
            shared = self.shared is not None and visit >= 0
            self._held = (visit, index), nvidia_ahead.wait_for(*self.shared, visit, path) if shared else read_file(path)
        return self._held[1]

    @faults.caught
    def __getitem__(self, key: Rows) -> dict[str, np.ndarray]:
        visit, index, rows = key
        arrays = self._arrays(visit, index)
        picked = {name: arrays[name][list(rows)].astype(np.int64) for name in KEYS}
        check_values(self.files[index].path, picked, self.vocab_size)
        positions, ids = picked["masked_lm_positions"], picked["masked_lm_ids"]
        valid = np.cumprod(positions != 0, axis=1).astype(bool)  # up to the first padded (0) position
        labels = np.full_like(picked["input_ids"], -100)
        row = np.broadcast_to(np.arange(len(rows))[:, None], positions.shape)
        labels[row[valid], positions[valid]] = ids[valid]
        return {
            "input_ids": picked["input_ids"],
            "token_type_ids": picked["segment_ids"],
            "attention_mask": picked["input_mask"],
            "labels": labels,
            "next_sentence_label": picked["next_sentence_labels"],
        }
