"""Data verified once, remembered: a stamp of the identities (size, modification time, inode) of the files whose
contents were checked, so that a launch or a ``--resume`` checks only what changed since, and its start-up costs
nothing per gigabyte of data.

A stamp is kept beside the data (``.verified.json``), or, where that directory is read-only (a shared dataset), in
the run's cache directory under a name drawn from the data's path. It is keyed to what the contents were checked
against (a manifest's digest, or the settings an NVIDIA file was checked under): a stamp of another key covers
nothing. A file changed in place changes its size or modification time, a file replaced changes its inode; either
way its entry no longer matches and it is checked again. ``prepare.py`` stamps the shards it writes, whose digests
it has just computed from the bytes on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

NAME = ".verified.json"

Entries = dict[str, list[list[int]]]
"""Per item (a shard, an HDF5 file): the identities of its files, in a fixed order."""


def identity(path: Path) -> list[int]:
    """What changes when a file's contents may have: its size, modification time (ns) and inode."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def identities(items: dict[str, list[Path]]) -> Entries:
    return {name: [identity(path) for path in files] for name, files in items.items()}


class Stamp:
    """The stamp of ``data_dir`` for ``key``: beside it, else under ``cache_dir`` (``None``: beside it only)."""

    def __init__(self, data_dir: Path, key: str, cache_dir: Optional[Path] = None) -> None:
        self.key = key
        self.places = [Path(data_dir) / NAME]
        if cache_dir is not None:
            where = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
            self.places.append(Path(cache_dir) / f"verified-{where}.json")

    def entries(self) -> Entries:
        """What the stamp covers (nothing where there is none for this key)."""
        for place in self.places:
            try:
                content = json.loads(place.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(content, dict) and content.get("key") == self.key and isinstance(content.get("items"), dict):
                return content["items"]
        return {}

    def unverified(self, items: dict[str, list[Path]]) -> list[str]:
        """The names of ``items`` whose files the stamp does not cover as they are now, in order."""
        covered = self.entries()
        return [name for name, now in identities(items).items() if covered.get(name) != now]

    def write(self, entries: Entries) -> Optional[Path]:
        """Record ``entries`` (besides what the stamp already covers) in the first place that takes it, atomically;
        the place, or ``None`` where none does."""
        content = {"key": self.key, "items": {**self.entries(), **entries}}
        for place in self.places:
            partial = place.with_name(f".{place.name}.{os.getpid()}.tmp")
            try:
                place.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(content) + "\n")
                os.replace(partial, place)
                return place
            except OSError:
                partial.unlink(missing_ok=True)
        return None
