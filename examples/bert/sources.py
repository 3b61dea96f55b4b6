"""Where BERT's documents come from, cut into pieces that are read on their own (one preparation shard each).

A corpus of any size is planned as a list of :class:`Piece` s of about ``piece_bytes`` of text each, cheaply and
deterministically (the same pieces for the same input, whatever the number of workers), and each piece is read
whole by whichever process prepares it. Nothing here holds more than one piece's text:

* a directory of text files (sorted by name) in one of three :data:`LAYOUTS`: ``blank-lines`` (``*.txt``, a
  document is a block of non-blank lines, Google's ``create_pretraining_data.py`` layout), ``lines`` (``*.txt``, one
  document per line, NVIDIA's formatted Wikipedia and BooksCorpus) or ``jsonl`` (``*.jsonl``, one JSON object per
  line, its text under a field): a large file is cut at document ends into byte ranges, small files are grouped
  (:func:`text_dir_pieces`). A document longer than :data:`MAX_DOCUMENT_PIECES` pieces is refused by name (the
  evident sign of a wrong layout), so a piece stays under 6.5 pieces' bytes whatever the input;
* a ``datasets`` dataset saved with ``save_to_disk`` (one row, one document; a ``DatasetDict``'s "train" split): rows
  in ranges, read from its memory-mapped Arrow files (:func:`hf_dataset_pieces`);
* documents already in memory, such as an embedded corpus (:func:`document_pieces`).

:func:`read_text_dir` and :func:`read_hf_dataset` read every piece of a small corpus into one list.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import corpora
import pairing

Document = pairing.Document
LAYOUTS = ("blank-lines", "lines", "jsonl")
"""How documents lie in text files: blocks of lines ended by a blank line, one per line, one JSON object per line."""
SUFFIXES = {"blank-lines": "*.txt", "lines": "*.txt", "jsonl": "*.jsonl"}
MAX_DOCUMENT_PIECES = 4
"""The longest document taken, in pieces (``--shard-mb``): past it, a document end is looked for in vain, and the
layout is evidently not the file's (a file of one document per line read as blank-line separated, say)."""


def layout_documents(text: str, layout: str, field: str = "text") -> list[Document]:
    """The documents (lists of sentences) of ``text`` laid out as ``layout`` (``field``: a JSON line's text; a
    ``ValueError`` for a line that is not a JSON object with it)."""
    if layout == "blank-lines":
        return corpora.text_documents(text)
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if layout == "jsonl":
            try:
                line = json.loads(line)[field]
            except (json.JSONDecodeError, TypeError, KeyError) as error:
                raise ValueError(f"line {number}: not a JSON object with a {field!r} text field ({error})") from None
            if not isinstance(line, str):
                raise ValueError(f"line {number}: its {field!r} field holds {type(line).__name__}, not text")
        if sentences := _row_sentences(line):
            documents.append(sentences)
    return documents


@dataclass(frozen=True)
class TextRanges:
    """Byte ranges ``(path, start, end)`` of text files, each starting at a document and ending at one, laid out as
    ``layout`` (``field``: the text's field in a JSON line)."""

    ranges: tuple[tuple[str, int, int], ...]
    layout: str = "blank-lines"
    field: str = "text"

    def read(self) -> tuple[list[Document], str]:
        documents, digest = [], hashlib.sha256()
        for path, start, end in self.ranges:
            with open(path, "rb") as file:
                file.seek(start)
                raw = file.read(end - start)
            if len(raw) != end - start:
                raise ValueError(f"{path}: expected bytes {start}-{end}, the file now ends at {start + len(raw)}")
            digest.update(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}: not UTF-8 text at byte {start + error.start} ({error.reason})") from None
            try:
                documents.extend(layout_documents(text, self.layout, self.field))
            except ValueError as error:
                raise ValueError(f"{path} (bytes {start}-{end}): {error}") from None
        return documents, digest.hexdigest()

    def describe(self, root: Path) -> list[list[Any]]:
        return [[Path(path).relative_to(root).as_posix(), start, end] for path, start, end in self.ranges]


@dataclass(frozen=True)
class DatasetRows:
    """Rows ``[start, stop)`` of a saved ``datasets`` dataset's text column: a row a document, or, for datasets
    whose rows are sentences, ``group_rows`` consecutive rows a document, or the consecutive rows sharing a value
    of ``document_column`` (a document cut by a piece's end becomes two)."""

    path: str
    column: str
    start: int
    stop: int
    group_rows: int = 1
    document_column: Optional[str] = None

    def read(self) -> tuple[list[Document], str]:
        rows = _train_split(self.path, self.column)[self.start : self.stop]
        texts = rows[self.column]
        digest = hashlib.sha256()
        for text in texts:
            digest.update((text or "").encode("utf-8") + b"\0")
        if self.document_column is not None:
            ids = rows[self.document_column]
            groups = [[t for t, _ in run] for _, run in itertools.groupby(zip(texts, ids), key=lambda row: row[1])]
        else:
            groups = [texts[i : i + self.group_rows] for i in range(0, len(texts), self.group_rows)]
        documents = [doc for group in groups if (doc := [s for t in group if t for s in _row_sentences(t)])]
        return documents, digest.hexdigest()

    def describe(self, root: Path) -> list[Any]:
        return [self.start, self.stop]


@dataclass(frozen=True)
class InMemory:
    """Documents held by the caller (an embedded corpus)."""

    documents: tuple[tuple[str, ...], ...]

    def read(self) -> tuple[list[Document], str]:
        documents = [list(doc) for doc in self.documents]
        return documents, corpora.corpus_digest(documents)

    def describe(self, root: Path) -> list[Any]:
        return [len(self.documents)]


@dataclass(frozen=True)
class PreparedShard:
    """A prepared shard whose tokens are paired again (phase 2 from phase 1's shards): its text is not read."""

    path: str

    def read(self) -> tuple[list[Document], str]:
        raise ValueError(f"{self.path}: a prepared shard is paired again from its tokens, not read as text")

    def describe(self, root: Path) -> list[Any]:
        return [Path(self.path).name]


Reader = Union[TextRanges, DatasetRows, InMemory, PreparedShard]


@dataclass(frozen=True)
class Piece:
    """One piece of a corpus: its number, where its text is and about how many bytes it holds."""

    index: int
    reader: Reader
    text_bytes: int

    def read(self) -> tuple[list[Document], str]:
        """The piece's documents (lists of sentences) and the SHA-256 of the text they came from."""
        return self.reader.read()


def _row_sentences(text: str) -> Document:
    return [s for line in text.splitlines() for s in corpora.split_sentences(line)]


# --------------------------------------------------------------------------- text files


def _cut_points(path: Path, size: int, piece_bytes: int, layout: str = "blank-lines") -> list[int]:
    """Offsets cutting a file into ranges of about ``piece_bytes``, each cut just after a document's end (a blank
    line; for one document per line, any line's end); the file's start and end included. A last range under half a
    piece joins the one before it. A document end looked for over :data:`MAX_DOCUMENT_PIECES` pieces in vain is a
    ``ValueError`` naming the file and the layout."""
    cuts, longest = [0], MAX_DOCUMENT_PIECES * piece_bytes
    with path.open("rb") as file:
        while cuts[-1] + piece_bytes < size:
            file.seek(cuts[-1] + piece_bytes)
            file.readline(longest)  # the rest of the line the seek landed in (a line read at most this far)
            while layout == "blank-lines" and (line := file.readline(longest)):
                if not line.strip():
                    break
                if file.tell() - cuts[-1] - piece_bytes > longest:
                    break
            position = file.tell()
            if position - cuts[-1] - piece_bytes > longest:
                what = "blank line" if layout == "blank-lines" else "line end"
                raise ValueError(
                    f"{path}: no {what} in the {longest / 1e6:.0f} MB from byte {cuts[-1] + piece_bytes} (a document "
                    f"over {MAX_DOCUMENT_PIECES} x --shard-mb): "
                    + ("one document per line takes --layout lines" if layout == "blank-lines" else "not text lines")
                )
            if position >= size:
                break
            cuts.append(position)
    if len(cuts) > 1 and size - cuts[-1] < piece_bytes // 2:
        cuts.pop()
    return [*cuts, size]


def text_dir_pieces(
    root: str | os.PathLike, piece_bytes: int, layout: str = "blank-lines", field: str = "text"
) -> list[Piece]:
    """The pieces of a directory of text files laid out as ``layout`` (:data:`SUFFIXES`): large files cut at
    document ends, small ones grouped, in name order, each piece about ``piece_bytes`` (a last range under half a
    piece joins the one before it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"text corpus directory {str(root)!r} does not exist")
    files = sorted(path for path in root.glob(SUFFIXES[layout]) if path.is_file())
    if not files:
        raise FileNotFoundError(f"no {SUFFIXES[layout].removeprefix('*')} files in {str(root)!r}")
    groups: list[list[tuple[str, int, int]]] = [[]]
    sizes = [0]  # each group's bytes, kept as it grows: grouping is linear in the number of files
    for path in files:
        size = path.stat().st_size
        cuts = _cut_points(path, size, piece_bytes, layout)
        for start, end in zip(cuts, cuts[1:]):
            if sizes[-1] >= piece_bytes:
                groups.append([])
                sizes.append(0)
            groups[-1].append((str(path), start, end))
            sizes[-1] += end - start
    if len(groups) > 1 and sizes[-1] < piece_bytes // 2:
        groups[-2].extend(groups.pop())  # a small remainder joins the piece before it
        sizes[-2] += sizes.pop()
    return [
        Piece(index, TextRanges(tuple(ranges), layout, field), sizes[index]) for index, ranges in enumerate(groups)
    ]


def text_dir_identity(root: str | os.PathLike, layout: str = "blank-lines") -> list[list[Any]]:
    """What a text directory's pieces depend on: each file's name, size and modification time."""
    return [
        [path.name, path.stat().st_size, path.stat().st_mtime_ns]
        for path in sorted(Path(root).glob(SUFFIXES[layout]))
        if path.is_file()
    ]


def read_text_dir(path: str | os.PathLike) -> list[Document]:
    """Every document of a directory of ``*.txt`` files (sorted by name), in order, in memory: for a small corpus."""
    documents = [doc for piece in text_dir_pieces(path, 64 << 20) for doc in piece.read()[0]]
    if not documents:
        raise ValueError(f"the .txt files in {str(path)!r} hold no text")
    return documents


# --------------------------------------------------------------------------- saved datasets


@functools.lru_cache(maxsize=4)
def _train_split(path: str, column: str) -> Any:
    """A ``datasets`` dataset saved with ``save_to_disk`` (memory-mapped), its "train" split for a
    ``DatasetDict``, checked to have the text column."""
    import datasets  # Imported here: only this source needs it.

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"dataset at {path!r} has no 'train' split (splits: {sorted(loaded)})")
        loaded = loaded["train"]
    if column not in loaded.column_names:
        raise ValueError(f"dataset at {path!r} has no column {column!r} (columns: {loaded.column_names})")
    return loaded


def hf_dataset_pieces(
    path: str | os.PathLike, column: str, piece_bytes: int, group_rows: int = 1, document_column: Optional[str] = None
) -> list[Piece]:
    """The pieces of a saved dataset: equal row ranges holding about ``piece_bytes`` of text each (from the Arrow
    size of its text column), each a whole number of ``group_rows`` groups (:class:`DatasetRows`)."""
    dataset = _train_split(str(path), column)
    rows = len(dataset)
    if rows == 0:
        raise ValueError(f"dataset at {str(path)!r} has no rows")
    if document_column is not None and document_column not in dataset.column_names:
        raise ValueError(f"dataset at {path!r} has no column {document_column!r} (columns: {dataset.column_names})")
    text_bytes = dataset.data.column(column).nbytes
    per_piece = max(1, math.ceil(rows * piece_bytes / max(text_bytes, 1)))
    per_piece = math.ceil(per_piece / group_rows) * group_rows
    return [
        Piece(
            index,
            DatasetRows(str(path), column, start, min(start + per_piece, rows), group_rows, document_column),
            text_bytes * per_piece // rows,
        )
        for index, start in enumerate(range(0, rows, per_piece))
    ]


def hf_dataset_identity(path: str | os.PathLike, column: str) -> dict[str, Any]:
    """What a saved dataset's pieces depend on: its fingerprint (``datasets``' hash of its content and history),
    rows and column."""
    dataset = _train_split(str(path), column)
    return {"fingerprint": dataset._fingerprint, "rows": len(dataset), "column": column}


def read_hf_dataset(path: str | os.PathLike, text_column: str = "text") -> list[Document]:
    """Every document of a saved dataset in memory (one row, one document; sentences split as in text files)."""
    documents = [doc for piece in hf_dataset_pieces(path, text_column, 64 << 20) for doc in piece.read()[0]]
    if not documents:
        raise ValueError(f"column {text_column!r} of the dataset at {str(path)!r} holds no text")
    return documents


# --------------------------------------------------------------------------- documents in memory


def document_pieces(documents: list[Document], piece_bytes: int) -> list[Piece]:
    """Documents in memory cut into consecutive runs of about ``piece_bytes`` of text."""
    pieces, current, current_bytes = [], [], 0
    for doc in documents:
        current.append(tuple(doc))
        current_bytes += sum(len(s.encode("utf-8")) + 1 for s in doc)
        if current_bytes >= piece_bytes:
            pieces.append(Piece(len(pieces), InMemory(tuple(current)), current_bytes))
            current, current_bytes = [], 0
    if current:
        pieces.append(Piece(len(pieces), InMemory(tuple(current)), current_bytes))
    return pieces


def load_corpus(
    text_dir: str | os.PathLike | None = None,
    hf_dataset: str | os.PathLike | None = None,
    text_column: str = "text",
    embedded: str = "stdlib",
    cache_dir: str | os.PathLike | None = None,
) -> list[Document]:
    """A small corpus in memory: from a text directory, a saved Hugging Face dataset, or (neither given) an
    embedded one."""
    if text_dir is not None and hf_dataset is not None:
        raise ValueError("give a text directory or a Hugging Face dataset, not both")
    if text_dir is not None:
        return read_text_dir(text_dir)
    if hf_dataset is not None:
        return read_hf_dataset(hf_dataset, text_column)
    return corpora.embedded_corpus(embedded, cache_dir)
