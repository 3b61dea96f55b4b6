"""The run's data on every rank: the embedded corpus prepared once (rank 0 first), prepared shards or NVIDIA's HDF5
files opened and their contents checked once (:mod:`stamps`), each source's batches and order, and what a checkpoint
records of them (``pins``, :func:`check_pins`). Bad data found here is a ``ValueError`` (or ``ShardError``) on every
rank: ``pretrain.py`` refuses the run in one line."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import corpora
import faults
import loading
import masking
import nvidia_ahead
import prepare
import shards
import stamps
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

T = TypeVar("T")

PREPARATION_CODE = hashlib.sha256(
    b"".join(
        (Path(__file__).parent / f).read_bytes()
        for f in ("corpora.py", "wordpiece.py", "pairing.py", "sources.py", "corpus.py", "out_dir.py", "shards.py")
        + ("shard_jobs.py", "prepare.py")
    )
).hexdigest()
"""Keys the embedded corpus's prepared shards with the code that prepares them."""


def rank_zero_first(build: Callable[[], T]) -> T:
    """``build()`` on rank 0, then on the other ranks: rank 0 fills a cache the others read. Rank 0's failure
    (bad input) is every rank's (:class:`faults.DataFault`), none left waiting for it."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = build()
        except (ValueError, OSError) as caught:  # ShardError and ConfigError included
            error = str(caught)
    faults.agree(error)
    return build() if dist.get_rank() != 0 else result


def embedded_shards(args: argparse.Namespace, bert: dict[str, Any], cache: Path, given: Any) -> Path:
    """The embedded corpus prepared into shards under ``cache/shards/`` (rank 0 prepares, once; keyed by the corpus
    name and its sources' versions, the preparing code, the settings and the tokenizer, without building the
    corpus). With a tokenizer given (phase 2 takes phase 1's), the shards prepared with the trained one serve when
    it is that one."""
    settings = prepare.Settings(bert["max_seq_length"], held_out_fraction=args.held_out_fraction, seed=args.data_seed)

    def directory(tokenizer: str) -> Path:
        identity = [args.corpus, corpora.corpus_sources(args.corpus), PREPARATION_CODE, asdict(settings)]
        key = json.dumps([*identity, bert["vocab_size"], tokenizer])
        return cache / "shards" / hashlib.sha256(key.encode()).hexdigest()[:16]

    out, train_one = directory("trained"), True
    if given is not None:
        trained, wanted = out / shards.MANIFEST, shards.tokenizer_digest(given)
        if not (trained.is_file() and shards.read_json(trained, "manifest")["tokenizer"]["digest"] == wanted):
            out, train_one = directory(wanted), False

    def build() -> Path:
        if not (out / shards.MANIFEST).is_file():
            source = prepare.embedded_source(args.corpus, cache / "corpus-cache", prepare.PIECE_BYTES)
            prepare.prepare(source, out, settings, bert["vocab_size"], None if train_one else given, progress=False)
        return out

    return rank_zero_first(build)


def rank_zero_broadcast(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, its result sent to every rank (a ``ValueError`` there raised on every rank)."""
    found: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = make()
        except ValueError as error:
            found[0] = error
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], ValueError):
        raise ValueError(str(found[0]))
    return found[0]


def verify_once(
    stamp: stamps.Stamp,
    items: dict[str, list[Path]],
    every: bool,
    verify: Callable[[list[str]], list[str]],
    what: str,
) -> None:
    """Check the contents of the ``items`` the stamp does not cover (``every``: all of them), each rank a share
    (``verify(names)``: the problems found), refused on every rank with all the problems, else stamped (rank 0):
    start-up reads what changed since the last check, nothing per gigabyte of data otherwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    todo = rank_zero_broadcast(lambda: list(items) if every else stamp.unverified(items))
    problems: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(problems, verify(todo[rank::world]))
    if any(problems):
        raise shards.ShardError("; ".join(p for found in problems for p in found))
    if todo and rank == 0:
        place = stamp.write(stamps.identities(items))
        print(f"checked the contents of {len(todo)} of {len(items)} {what}" + (f", stamped in {place}" if place else ""))


class ShardSource:
    """Prepared shards, checked (settings, sizes, and each rank's share of the contents) when opened."""

    def __init__(self, args: argparse.Namespace, bert: dict[str, Any], root: Path, given: Any, cache: Path) -> None:
        self.args = args
        self.order = args.sample_order or ("keyed" if args.shards is not None else "randperm")
        self.shards = shards.ShardSet.open(root, bert["max_seq_length"], bert["vocab_size"], given)
        stamp = stamps.Stamp(root, self.shards.manifest["digest"], cache)
        verify_once(stamp, self.shards.items(), args.verify_data, self.shards.verify, "shards")
        self.tokenizer: Optional[PreTrainedTokenizerFast] = given or self.shards.tokenizer()
        self.vocab_size = len(self.tokenizer)
        manifest = self.shards.manifest
        self.pins = {
            "data": manifest["digest"],
            "vocabulary": f"tokenizer {manifest['tokenizer']['digest']}",
            "order": loading.order_name(self.order),
        }
        """What a checkpoint records of the data (``--resume`` and phase 2 check it): see :func:`check_pins`."""
        self.record = {
            **manifest["source"],
            "shards": str(root),
            "text_digest": manifest["text_digest"],
            "manifest_digest": manifest["digest"],
            **manifest["totals"],
            "max_seq_length": manifest["max_seq_length"],
            "vocab_size": self.vocab_size,
            "sample_order": loading.order_name(self.order),
        }

    def batches(self, micro: int, accum: int) -> tuple[Dataset, Any, list[dict[str, torch.Tensor]]]:
        """(the training micro-batches by key, the keys of each step's, the held-out micro-batches)."""
        args, tokenizer = self.args, self.tokenizer
        vocab, cls_id, sep_id = masking.Vocabulary.of(tokenizer), tokenizer.cls_token_id, tokenizer.sep_token_id
        train = loading.ShardBatches(self.shards, vocab, cls_id, sep_id, args.seed, "train")
        held = loading.ShardBatches(self.shards, vocab, cls_id, sep_id, args.data_seed + 1, "held_out")
        keys = loading.held_out_keys(self.shards.starts["held_out"], args.eval_batches * micro, micro)
        world, rank = dist.get_world_size(), dist.get_rank()
        order = loading.PairOrder(len(self.shards), micro, accum, world, rank, args.seed, self.order)
        return train, order, loading.held_out(held, keys)

    def loader(self, dataset: Dataset, order: Any, start: int, stop: int) -> Iterator[Any]:
        """Steps ``[start, stop)``'s micro-batches, made in the loader workers."""
        keys = loading.StepKeys(order, start, stop)
        return loading.loader(dataset, keys, self.args.loader_workers, self.args.prefetch)


class NvidiaSource:
    """NVIDIA's HDF5 shards (``nvidia.py``), every file's layout checked when opened."""

    def __init__(self, args: argparse.Namespace, bert: dict[str, Any], cache: Path) -> None:
        import nvidia  # only this source needs h5py

        self.nvidia, self.args = nvidia, args
        self.training, self.test = rank_zero_broadcast(lambda: nvidia.discover(args.nvidia_hdf5, bert["max_seq_length"]))
        files = {Path(f.path).name: f for f in self.training + self.test}
        stamp = stamps.Stamp(args.nvidia_hdf5, f"NVIDIA HDF5, vocabulary {bert['vocab_size']}", cache)
        items = {name: [Path(f.path)] for name, f in files.items()}
        check = lambda names: nvidia.verify([files[name] for name in names], bert["vocab_size"])  # noqa: E731
        verify_once(stamp, items, args.verify_data, check, "NVIDIA files")
        self.tokenizer: Optional[PreTrainedTokenizerFast] = None  # the ids are NVIDIA's vocabulary's
        self.vocab_size = bert["vocab_size"]
        files = json.dumps([(Path(f.path).name, f.rows) for f in self.training + self.test])
        vocabulary = f"NVIDIA's ids, {self.vocab_size} tokens"
        if args.tokenizer is not None:  # the tokenizer NVIDIA's ids come from, named by the user
            given = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer))
            if len(given) != self.vocab_size:
                raise ValueError(
                    f"{args.tokenizer}: a {len(given)}-token vocabulary, the config's bert.vocab_size is "
                    f"{self.vocab_size}"
                )
            vocabulary = f"tokenizer {shards.tokenizer_digest(given)}"
        self.pins = {
            "data": hashlib.sha256(files.encode()).hexdigest(),
            "vocabulary": vocabulary,
            "order": nvidia.ORDER,
        }
        self.record = {
            "nvidia_hdf5": str(args.nvidia_hdf5),
            "training_files": len(self.training),
            "test_files": len(self.test),
            "train_pairs": sum(f.rows for f in self.training),
            "held_out_pairs": sum(f.rows for f in self.test),
            "max_seq_length": bert["max_seq_length"],
            "vocab_size": self.vocab_size,
        }
        if dist.get_rank() == 0 and not self.test:
            print(f"{args.nvidia_hdf5} holds no test files (with 'test' in their names): no held-out evaluation")

    def batches(self, micro: int, accum: int) -> tuple[Dataset, Any, list[dict[str, torch.Tensor]]]:
        nvidia, seed = self.nvidia, self.args.seed
        order = nvidia.NvidiaOrder(self.training, micro, accum, dist.get_world_size(), dist.get_rank(), seed)
        held = nvidia.NvidiaBatches(self.test, self.vocab_size)
        keys = nvidia.held_out_keys(self.test, self.args.eval_batches * micro, micro)
        return nvidia.NvidiaBatches(self.training, self.vocab_size), order, loading.held_out(held, keys)

    def loader(self, dataset: Dataset, order: Any, start: int, stop: int) -> Iterator[Any]:
        """Steps ``[start, stop)``'s micro-batches, made in the loader workers from the copies a reader process
        decompresses a file ahead (:mod:`nvidia_ahead`): the workers' prefetch and the file after it."""
        args = self.args
        lead = max(1, args.loader_workers) * args.prefetch + order.accum
        ahead = nvidia_ahead.Ahead(order, start * order.accum, lead)
        dataset.shared = ahead.shared
        made = loading.loader(dataset, loading.StepKeys(order, start, stop), args.loader_workers, args.prefetch)
        return ahead.count(made)


def open_data(args: argparse.Namespace, bert: dict[str, Any], cache: Path) -> ShardSource | NvidiaSource:
    """The run's data from ``--nvidia-hdf5``, ``--shards`` or the embedded corpus (prepared into shards)."""
    if args.nvidia_hdf5 is not None:
        return NvidiaSource(args, bert, cache)
    given = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer)) if args.tokenizer is not None else None
    root = args.shards if args.shards is not None else embedded_shards(args, bert, cache, given)
    return ShardSource(args, bert, root, given, cache)


def check_pins(flag: str, client: dict[str, Any], pins: dict[str, Any], keys: tuple[str, ...], allow: bool) -> None:
    """A ``ValueError`` naming what of ``keys`` differs between the checkpoint's recorded data (``client["data"]``)
    and this run's ``pins``, unless ``allow`` (``--new-data``); a checkpoint that recorded none is said once."""
    recorded = client.get("data")
    if recorded is None:
        if dist.get_rank() == 0:
            print(f"{flag}: the checkpoint records no data identity (written by an older pretrain.py): not checked")
        return
    differ = [key for key in keys if recorded.get(key) != pins[key]]
    if differ and not allow:

        def short(value: Any) -> str:  # digests to their first 12 digits
            return re.sub(r"[0-9a-f]{32,}", lambda digest: f"{digest.group()[:12]}...", str(value))

        changed = ", ".join(f"{key} {short(recorded.get(key))} -> {short(pins[key])}" for key in differ)
        raise ValueError(
            f"{flag}: the checkpoint was trained on other data than this run's ({changed}): give the data it was "
            f"trained on, or --new-data to go on with this on purpose"
        )


