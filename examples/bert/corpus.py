"""A corpus to prepare (:class:`Source`): its pieces (:mod:`sources`) and the record that identifies it, so that
shards of other input are never mixed with its own."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import corpora
import shards
import sources
import stamps


@dataclass(frozen=True)
class Source:
    """A corpus to prepare: its pieces and what identifies it (to refuse mixing preparations of other inputs)."""

    pieces: list[sources.Piece]
    record: dict[str, Any]
    root: Path

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.record, sort_keys=True).encode()).hexdigest()


def text_dir_source(root: Path, piece_bytes: int, layout: str = "blank-lines", field: str = "text") -> Source:
    root = root.resolve()
    pieces = sources.text_dir_pieces(root, piece_bytes, layout, field)
    record = {"text_dir": str(root), "layout": layout, "files": sources.text_dir_identity(root, layout)}
    record |= {"field": field} if layout == "jsonl" else {}
    return Source(pieces, record | {"piece_bytes": piece_bytes}, root)


def hf_dataset_source(
    path: Path, column: str, piece_bytes: int, group_rows: int = 1, document_column: Optional[str] = None
) -> Source:
    pieces = sources.hf_dataset_pieces(path, column, piece_bytes, group_rows, document_column)
    identity = sources.hf_dataset_identity(path, column)
    record = {"hf_dataset": str(path.resolve()), **identity, "piece_bytes": piece_bytes}
    record |= {"group_rows": group_rows} if group_rows != 1 else {}
    record |= {"document_column": document_column} if document_column is not None else {}
    return Source(pieces, record, path.resolve())


def embedded_source(name: str, cache_dir: Optional[Path], piece_bytes: int) -> Source:
    documents = corpora.embedded_corpus(name, cache_dir)
    record = {
        "embedded": name,
        "versions": corpora.corpus_sources(name),
        "digest": corpora.corpus_digest(documents),
        "piece_bytes": piece_bytes,
    }
    return Source(sources.document_pieces(documents, piece_bytes), record, Path("."))


def shards_source(root: Path) -> tuple[Source, dict[str, Any]]:
    """Prepared shards (format 2) as a corpus to pair again, a piece a shard (phase 2 from phase 1's tokens: only
    the pairs depend on the sequence length), their contents checked against the manifest where no stamp covers
    them; with their manifest (its tokenizer and settings are the new preparation's)."""
    opened = shards.ShardSet.open(root)
    manifest = opened.manifest
    if manifest["format"] < 2:
        raise shards.ShardError(
            f"{root}: format {manifest['format']} keeps no sentences to pair again: prepare from the text"
        )
    stamp = stamps.Stamp(root, manifest["digest"])
    problems = opened.verify(stamp.unverified(opened.items()))
    if problems:
        raise shards.ShardError("; ".join(problems))
    pieces = [
        sources.Piece(i, sources.PreparedShard(str(Path(root) / shard["name"])), shard["text_bytes"])
        for i, shard in enumerate(manifest["shards"])
    ]
    record = {"from_shards": str(Path(root).resolve()), "manifest_digest": manifest["digest"]}
    return Source(pieces, record, Path(root).resolve()), manifest
