"""Prepared shards: the directory ``prepare.py`` writes and ``pretrain.py --shards`` reads.

Layout (numpy's ``.npy`` format throughout: a header, then the array's bytes, so a row is one ``pread`` at a known
offset, served by the page cache every rank of a node shares)::

    SHARDS/manifest.json            written last: settings, tokenizer, versions, counts, each shard's digest
    SHARDS/tokenizer/               the tokenizer the ids come from (``save_pretrained``)
    SHARDS/shard-00000/tokens.npy   every sentence's token ids, document after document (uint16 up to 65,536 ids)
                     /pairs.npy     training NSP instances: two ranges of tokens.npy and the label (PAIR_DTYPE)
                     /held_out_pairs.npy   the same, from this shard's held-out documents
                     /sentences.npy every sentence's length, /documents.npy each document's sentence count (training
                                    documents first): what pairing again needs (phase 2 from phase 1's tokens)
                     /shard.json    what the shard was made from and with, its counts and the digest of its files

A shard is written into a temporary directory and renamed into place when complete, and the manifest is written
last, so a preparation killed half way leaves no shard that reads as complete and no manifest. :meth:`ShardSet.open`
checks everything that is cheap to check before training starts (manifest, settings, sizes of every file), and
:meth:`ShardSet.verify` the contents against their digests, each rank a share.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pairing

FORMAT = 2
"""Written by this code: format 1 and the pair counts (label 1, tokens filled) in each shard and the totals."""
READABLE = (1, 2)
"""Formats read (their arrays are alike)."""
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer"
SHARD_RECORD = "shard.json"
ARRAYS = ("tokens.npy", "pairs.npy", "held_out_pairs.npy", "sentences.npy", "documents.npy")
"""A shard's arrays (format 2); format 1 had the first three."""
FORMAT_ARRAYS = {1: ARRAYS[:3], 2: ARRAYS}
SPLITS = {"train": "pairs.npy", "held_out": "held_out_pairs.npy"}
PAIR_DTYPE = np.dtype(
    [("a_start", "<u4"), ("a_length", "<u2"), ("b_start", "<u4"), ("b_length", "<u2"), ("next_sentence_label", "u1")]
)
"""A :class:`pairing.Pair` on disk: 13 bytes (ranges within one shard, whose tokens stay under 2**32)."""
_CHUNK = 8 << 20


class ShardError(ValueError):
    """Prepared shards that cannot be trained on; the message names the file and the cause."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of a fast tokenizer's whole pipeline (normalizer, pre-tokenizer, vocabulary, special tokens), which
    fixes every id it produces; it survives ``save_pretrained`` / ``from_pretrained``."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()


def files_digest(directory: Path, names: tuple[str, ...] = ARRAYS) -> str:
    """SHA-256 of a shard's arrays ``names`` (each file's name and bytes, in order), read in chunks."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        with (directory / name).open("rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of a manifest's canonical JSON without its own ``digest`` key."""
    body = {key: value for key, value in manifest.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, content: dict[str, Any]) -> None:
    """``content`` to ``path`` atomically: a temporary file beside it, synced, then renamed over it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(content, indent=1) + "\n")
    _fsync(partial)
    os.replace(partial, path)
    _fsync(path.parent)


def write_shard(out: Path, name: str, arrays: dict[str, np.ndarray], record: dict[str, Any]) -> dict[str, Any]:
    """Write one shard atomically (a synced temporary directory renamed to ``out/name``); ``record`` completed
    with the files' sizes and digest, as written to its ``shard.json``."""
    partial = out / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for file in ARRAYS:
        np.save(partial / file, arrays[file])
        _fsync(partial / file)
    record = {**record, "files": {f: (partial / f).stat().st_size for f in ARRAYS}, "digest": files_digest(partial)}
    write_json(partial / SHARD_RECORD, record)
    os.rename(partial, out / name)  # atomic; refuses to replace a complete shard
    _fsync(out)
    return record


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``, or a :class:`ShardError` naming the file."""
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShardError(f"{path}: cannot read the {what} ({error})") from None
    if not isinstance(content, dict):
        raise ShardError(f"{path}: the {what} must be a JSON object, got {type(content).__name__}")
    return content


class _Arrays:
    """Rows of the shards' ``.npy`` arrays read with ``os.pread``: no mapping, so a process's resident memory stays
    what it holds (mapped pages count in it, and Linux maps a file's cached neighbours on every fault: 908 MB after
    8,000 random pairs of a 2 GB corpus's shards), while the page cache, shared by every rank of a node, keeps what
    is read often. Files are opened on first use by the process that reads them (a data-loader worker opens its
    own), at most :data:`OPEN_FILES` at a time."""

    OPEN_FILES = 128

    def __init__(self) -> None:
        self._open: dict[Path, tuple[int, int, np.dtype]] = {}
        self._pid = os.getpid()

    def _file(self, path: Path) -> tuple[int, int, np.dtype]:
        if self._pid != os.getpid():  # forked: this process opens its own
            self._open, self._pid = {}, os.getpid()
        if path not in self._open:
            if len(self._open) >= self.OPEN_FILES:
                os.close(self._open.pop(next(iter(self._open)))[0])
            with path.open("rb") as file:
                version = np.lib.format.read_magic(file)
                header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                _, _, dtype = header(file)
                offset = file.tell()
            self._open[path] = (os.open(path, os.O_RDONLY), offset, dtype)
        return self._open[path]

    def read(self, path: Path, start: int, count: int) -> np.ndarray:
        """Elements ``[start, start + count)`` of the (flattened) array in ``path``."""
        fd, offset, dtype = self._file(path)
        wanted, at = count * dtype.itemsize, offset + start * dtype.itemsize
        raw = os.pread(fd, wanted, at)
        if len(raw) != wanted:  # the file shrank under the run: never train on the cut rows
            raise ShardError(
                f"{path}: truncated after preparation (read {len(raw)} of {wanted} bytes at offset {at}, the file "
                f"now holds {os.fstat(fd).st_size}): prepare the shards again"
            )
        return np.frombuffer(raw, dtype=dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"_open": {}, "_pid": None}  # a process started by spawn opens its own files


class ShardSet:
    """Prepared shards opened for training: counts in memory, rows read on demand (:class:`_Arrays`), a global
    index per split over the shards in order."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = root
        source = manifest["source"]  # its list of input files (one entry per file) is not held: counted instead
        if "files" in source:
            source = {**{k: v for k, v in source.items() if k != "files"}, "input_files": len(source["files"])}
        self.manifest = {**manifest, "source": source}
        self.arrays = FORMAT_ARRAYS[manifest["format"]]
        self.names = [shard["name"] for shard in manifest["shards"]]
        self.starts = {
            split: np.concatenate([[0], np.cumsum([shard[f"{split}_pairs"] for shard in manifest["shards"]])])
            for split in SPLITS
        }
        self._arrays = _Arrays()

    @classmethod
    def open(
        cls,
        root: str | os.PathLike,
        max_seq_length: Optional[int] = None,
        vocab_size: Optional[int] = None,
        tokenizer: Any = None,
    ) -> "ShardSet":
        """The shards under ``root``, refused with a :class:`ShardError` naming the file and the cause if they are
        not complete, not what they claim, or not prepared for this sequence length, vocabulary size or tokenizer."""
        root = Path(root)
        if not root.is_dir():
            raise ShardError(f"{root}: no such directory of prepared shards")
        if not (root / MANIFEST).is_file():
            partial = sorted(p.name for p in root.iterdir() if p.name.startswith("shard-"))
            cause = (
                f"a preparation that did not finish ({len(partial)} shards, no manifest): run prepare.py again "
                f"with the same arguments, it redoes only the missing shards"
                if partial
                else "no shards (no manifest.json): prepare them with examples/bert/prepare.py"
            )
            raise ShardError(f"{root} holds {cause}")
        path = root / MANIFEST
        manifest = read_json(path, "manifest")
        if manifest.get("format") not in READABLE:
            raise ShardError(f"{path}: format {manifest.get('format')!r}, this reader knows formats {READABLE}")
        if manifest.get("digest") != manifest_digest(manifest):
            raise ShardError(
                f"{path}: its digest does not match its contents (edited or damaged after preparation): prepare the "
                f"shards again"
            )
        prepared = manifest["max_seq_length"]
        if max_seq_length is not None and prepared != max_seq_length:
            raise ShardError(
                f"{path}: prepared at sequence length {prepared}, the config's bert.max_seq_length is {max_seq_length}"
            )
        vocabulary = manifest["tokenizer"]["vocab_size"]
        if vocab_size is not None and vocabulary != vocab_size:
            raise ShardError(
                f"{path}: tokenized with a {vocabulary}-token vocabulary, the config's bert.vocab_size is {vocab_size}"
            )
        if tokenizer is not None and tokenizer_digest(tokenizer) != manifest["tokenizer"]["digest"]:
            raise ShardError(
                f"{path}: tokenized with {root / TOKENIZER} (digest {manifest['tokenizer']['digest'][:12]}), not the "
                f"tokenizer given (digest {tokenizer_digest(tokenizer)[:12]}, {len(tokenizer)} tokens)"
            )
        if not manifest["shards"]:
            raise ShardError(f"{path}: lists no shards")
        for shard in manifest["shards"]:
            directory = root / shard["name"]
            if not directory.is_dir():
                raise ShardError(f"{directory}: missing (the manifest lists it)")
            for file, size in shard["files"].items():
                found = (directory / file).stat().st_size if (directory / file).is_file() else None
                if found != size:
                    cause = {None: "missing", 0: "empty"}.get(found) or (
                        f"truncated ({found} of {size} bytes)" if found < size else f"{found} bytes, not {size}"
                    )
                    raise ShardError(f"{directory / file}: {cause}")
        return cls(root, manifest)

    def items(self) -> dict[str, list[Path]]:
        """Each shard's arrays, by shard name (what a verification stamp records: :mod:`stamps`)."""
        return {name: [self.root / name / file for file in self.arrays] for name in self.names}

    def verify(self, names: Optional[list[str]] = None) -> list[str]:
        """Problems found checking the contents of the shards ``names`` (default: all) against the manifest's
        digests (each rank checks a share; gather the lists to refuse the run everywhere)."""
        digests = {shard["name"]: shard["digest"] for shard in self.manifest["shards"]}
        problems = []
        for name in self.names if names is None else names:
            if files_digest(self.root / name, self.arrays) != digests[name]:
                problems.append(
                    f"{self.root / name}: its arrays do not match the manifest's digest (changed after "
                    f"preparation): prepare the shards again"
                )
        return problems

    def tokenizer(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(self.root / TOKENIZER))

    def __len__(self) -> int:
        return int(self.starts["train"][-1])

    def size(self, split: str) -> int:
        return int(self.starts[split][-1])

    def example(self, split: str, index: int, cls_id: int, sep_id: int) -> pairing.PretrainingExample:
        """The ``index``-th instance of ``split`` ("train" or "held_out") over all shards, unmasked."""
        starts = self.starts[split]
        shard = int(np.searchsorted(starts, index, side="right")) - 1
        directory = self.root / self.names[shard]
        row = self._arrays.read(directory / SPLITS[split], int(index - starts[shard]), 1)[0]
        pair = pairing.Pair(*(int(v) for v in row.tolist()))
        a = self._arrays.read(directory / "tokens.npy", pair.a_start, pair.a_length)
        b = self._arrays.read(directory / "tokens.npy", pair.b_start, pair.b_length)
        return pairing.assemble_segments(a.tolist(), b.tolist(), pair.next_sentence_label, cls_id, sep_id)

    def token_counts(self, split: str) -> np.ndarray:
        """How often each token id occurs in the instances of ``split`` (A and B, without the special tokens): a
        token in two instances counts twice."""
        counts = np.zeros(self.manifest["tokenizer"]["vocab_size"], dtype=np.int64)
        for name in self.names:
            tokens, pairs = np.load(self.root / name / "tokens.npy"), np.load(self.root / name / SPLITS[split])
            cover = np.zeros(len(tokens) + 1, dtype=np.int64)  # instances covering each token, as differences
            for side in ("a", "b"):
                start = pairs[f"{side}_start"].astype(np.int64)
                np.add.at(cover, start, 1)
                np.add.at(cover, start + pairs[f"{side}_length"], -1)
            counts += np.bincount(tokens, weights=np.cumsum(cover[:-1]), minlength=len(counts)).astype(np.int64)
        return counts
