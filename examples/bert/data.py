"""BERT pretraining data: corpora, a WordPiece tokenizer, NSP sentence pairs and MLM masking.

Follows the original BERT recipe (``create_pretraining_data.py``) and NVIDIA's
PyTorch port of it, written from scratch for this repository:

* a corpus is a list of documents, each a list of sentences; it comes from a
  directory of text files, a Hugging Face dataset saved with ``save_to_disk``,
  or an embedded corpus built from docstrings, so the example runs offline
  with nothing to download. The "packages" corpus (``docstring_corpus``, the
  pretraining script's default) parses with ``ast``, without importing them,
  the ``.py`` sources of the standard library and of the pinned dependencies
  (``CORPUS_PACKAGES``): with Python 3.11 and requirements-dev.txt's versions,
  about 34k documents, 237k sentences and 18 MB of text, 120k NSP training
  pairs at sequence length 64 and a 1024-token vocabulary; it takes about 30 s
  to build and is cached. The "stdlib" corpus (``stdlib_corpus``, the
  library's default) takes the docstrings of ~230 imported standard-library
  modules: 2.3k documents, 0.8 MB, 5.4k such pairs;
* a lowercase WordPiece vocabulary is trained on it with ``tokenizers``;
* documents (never sentences) are split into a training set and a held-out set;
* sentence pairs ``[CLS] A [SEP] B [SEP]`` are built for next-sentence
  prediction, B being the true continuation of A half of the time and a segment
  of another document otherwise;
* masked-LM labels are drawn per access (dynamic masking, as RoBERTa and
  NVIDIA's recipe do): each (seed, epoch, example) triple has its own RNG, so a
  run is reproducible whatever the DataLoader order or number of workers.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import os
import platform
import random
import re
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from torch.utils.data import Dataset

Document = list[str]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: its id is 0, collate's default.
IGNORE_INDEX = -100  # What torch's cross-entropy (and BertForPreTraining) skips.

# Standard-library modules whose docstrings make the embedded corpus. A fixed,
# sorted list (not sys.stdlib_module_names) so the corpus only changes with the
# Python version; modules a given build lacks are skipped.
EMBEDDED_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio.base_events", "asyncio.base_subprocess", "asyncio.coroutines",
    "asyncio.events", "asyncio.futures", "asyncio.locks", "asyncio.protocols", "asyncio.queues", "asyncio.runners",
    "asyncio.selector_events", "asyncio.streams", "asyncio.subprocess", "asyncio.tasks", "asyncio.transports",
    "asyncio.unix_events", "atexit", "base64", "bdb", "binascii", "bisect", "builtins", "bz2", "calendar", "cmath",
    "cmd", "code", "codecs", "codeop", "collections", "collections.abc", "colorsys", "compileall",
    "concurrent.futures", "concurrent.futures.process", "concurrent.futures.thread", "configparser", "contextlib",
    "copy", "copyreg", "csv", "ctypes", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest",
    "email.charset", "email.contentmanager", "email.feedparser", "email.generator", "email.header",
    "email.headerregistry", "email.message", "email.mime.base", "email.mime.multipart", "email.mime.text",
    "email.parser", "email.policy", "email.utils", "enum", "faulthandler", "fcntl", "filecmp", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "gc", "getopt", "gettext", "glob", "graphlib", "grp", "gzip", "hashlib",
    "heapq", "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.cookies", "http.server", "imaplib",
    "importlib", "importlib.abc", "importlib.machinery", "importlib.metadata", "importlib.resources",
    "importlib.util", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder", "json.encoder", "keyword",
    "linecache", "locale", "logging", "logging.config", "logging.handlers", "lzma", "mailbox", "marshal", "math",
    "mimetypes", "mmap", "modulefinder", "multiprocessing.connection", "multiprocessing.context",
    "multiprocessing.managers", "multiprocessing.pool", "multiprocessing.process", "multiprocessing.queues",
    "multiprocessing.shared_memory", "multiprocessing.synchronize", "netrc", "numbers", "operator", "optparse", "os",
    "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "posix", "pprint",
    "profile", "pstats", "pty", "pwd", "py_compile", "pyclbr", "pydoc", "queue", "quopri", "random", "re", "reprlib",
    "resource", "rlcompleter", "runpy", "sched", "secrets", "select", "selectors", "shelve", "shlex", "shutil",
    "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess",
    "symtable", "sys", "sysconfig", "syslog", "tabnanny", "tarfile", "tempfile", "termios", "textwrap", "threading",
    "time", "timeit", "token", "tokenize", "tomllib", "trace", "traceback", "tracemalloc", "tty", "types", "typing",
    "unicodedata", "unittest", "unittest.case", "unittest.loader", "unittest.mock", "unittest.result",
    "unittest.runner", "unittest.suite", "urllib.parse", "urllib.request", "urllib.response", "uuid", "warnings",
    "wave", "weakref", "webbrowser", "wsgiref.handlers", "wsgiref.simple_server", "wsgiref.util", "xml.dom",
    "xml.dom.minidom", "xml.dom.pulldom", "xml.etree.ElementTree", "xml.parsers.expat", "xml.sax",
    "xml.sax.expatreader", "xml.sax.handler", "xml.sax.saxutils", "xml.sax.xmlreader", "xmlrpc.client",
    "xmlrpc.server", "zipapp", "zipfile", "zipimport", "zlib", "zoneinfo",
)  # fmt: skip

EMBEDDED_CORPORA = ("packages", "stdlib")

# Packages whose source docstrings join the standard library's in the "packages" corpus, sorted (import name:
# distribution, for the version): the BERT example's pinned requirements (requirements-dev.txt) and packages
# they require (scipy for scikit-learn; filelock, fsspec, jinja2, networkx for torch; huggingface_hub and
# packaging for transformers). A package the environment lacks is skipped, and missing from corpus_sources().
CORPUS_PACKAGES = {
    "accelerate": "accelerate",
    "datasets": "datasets",
    "deepspeed": "deepspeed",
    "filelock": "filelock",
    "fsspec": "fsspec",
    "huggingface_hub": "huggingface_hub",
    "jinja2": "jinja2",
    "matplotlib": "matplotlib",
    "megatron": "megatron-core",
    "networkx": "networkx",
    "numpy": "numpy",
    "packaging": "packaging",
    "pydantic": "pydantic",
    "scipy": "scipy",
    "sklearn": "scikit-learn",
    "tokenizers": "tokenizers",
    "torch": "torch",
    "tqdm": "tqdm",
    "transformers": "transformers",
}
# Directories not read: tests (little prose, much time), and the packages installed under the standard library.
_SKIPPED_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
# Keys the cached corpora with the sources: a change to this module (its filters, say) rebuilds them.
_CODE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()

# A sentence ends at ". ", "? " or "! " (not after "e.g." / "i.e.", which docstrings use a lot).
_SENTENCE_END = re.compile(r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<=[.?!])\s+")
_CODE_CHARS = set('()[]{}<>=_*/\\|#@$%^&~`;"')
_CODE_LINE = re.compile(r"^(@|(def|class|with|for|if|while|import|from|return|assert|raise|print)\b.*([:=(]))")


# --------------------------------------------------------------------------- corpora


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Cyclic garbage collection off for a block that makes millions of acyclic objects.

    Reference counting frees them all the same; collections would only slow
    the block down: by ~20% when parsing sources, 2.5x in ``build_examples``.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def split_sentences(text: str) -> list[str]:
    """Split a line or paragraph on sentence-final punctuation followed by whitespace."""
    return [s for s in (part.strip() for part in _SENTENCE_END.split(" ".join(text.split()))) if s]


def _blocks_to_documents(text: str) -> list[Document]:
    """Documents are blocks of non-blank lines; each line holds one or more sentences."""
    documents, current = [], []
    for line in text.splitlines() + [""]:
        if line.strip():
            current.extend(split_sentences(line))
        elif current:
            documents.append(current)
            current = []
    return documents


def read_text_dir(path: str | os.PathLike) -> list[Document]:
    """Documents from the ``*.txt`` files of a directory (sorted by name), separated by blank lines."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"text corpus directory {str(root)!r} does not exist")
    files = sorted(root.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {str(root)!r}")
    documents = [doc for file in files for doc in _blocks_to_documents(file.read_text(encoding="utf-8"))]
    if not documents:
        raise ValueError(f"the .txt files in {str(root)!r} hold no text")
    return documents


def read_hf_dataset(path: str | os.PathLike, text_column: str = "text") -> list[Document]:
    """Documents from a ``datasets`` dataset saved with ``save_to_disk``: one row, one document.

    A row's lines are split into sentences as in ``read_text_dir``. A
    ``DatasetDict`` must have a "train" split, which is the one read.
    """
    import datasets  # Imported here: only this source needs it.

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"dataset at {str(path)!r} has no 'train' split (splits: {sorted(loaded)})")
        loaded = loaded["train"]
    if text_column not in loaded.column_names:
        raise ValueError(f"dataset at {str(path)!r} has no column {text_column!r} (columns: {loaded.column_names})")
    documents = [
        sentences
        for text in loaded[text_column]
        if text and (sentences := [s for line in text.splitlines() for s in split_sentences(line)])
    ]
    if not documents:
        raise ValueError(f"column {text_column!r} of the dataset at {str(path)!r} holds no text")
    return documents


def _is_prose(line: str) -> bool:
    """False for doctest, code-like and decoration lines, which would teach the vocabulary nothing English."""
    text = line.strip()
    if text.startswith((">>>", "...")) or not any(c.isalpha() for c in text):
        return False
    non_space = [c for c in text if not c.isspace()]
    return not _CODE_LINE.match(text) and sum(c in _CODE_CHARS for c in non_space) <= 0.1 * len(non_space)


def _docstring_sentences(doc: str) -> list[str]:
    """Sentences of a docstring's prose: paragraphs (broken at blank or dropped lines) joined, then split."""
    sentences, paragraph = [], []
    for line in doc.splitlines() + [""]:
        if line.strip() and _is_prose(line):
            paragraph.append(line)
            continue
        if paragraph:
            sentences.extend(split_sentences(" ".join(paragraph)))
            paragraph = []
    return [s for s in sentences if len(s.split()) >= 3]


def _public_docstrings(module: object) -> list[str]:
    """The docstrings of a module and of its own public classes (and their methods) and functions.

    Hooks that programs rebind (``sys.excepthook``, ``threading.excepthook``,
    which pytest replaces, ...) are read from the pristine ``__name__`` copy
    Python keeps, so the corpus does not depend on who runs it.
    """
    docs = [inspect.getdoc(module)]
    namespace = vars(module)
    for name in sorted(namespace):
        pristine = namespace.get(f"__{name}__")
        obj = pristine if inspect.isroutine(pristine) else namespace[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            docs.append(inspect.getdoc(obj))
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if not attr.startswith("_") and inspect.isroutine(member):
                    docs.append(inspect.getdoc(member))
        elif inspect.isroutine(obj):
            docs.append(inspect.getdoc(obj))
    return [doc for doc in docs if doc]


def stdlib_corpus() -> list[Document]:
    """The small "stdlib" corpus: docstrings of the imported ``EMBEDDED_MODULES``, >= 2 prose sentences each.

    Deterministic for a given Python version (fixed module list, sorted members,
    duplicates such as inherited docstrings kept once). About 2.3k documents
    (0.8 MB of text) on Python 3.11.
    """
    documents, seen = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in EMBEDDED_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for doc in _public_docstrings(module):
                if doc in seen:
                    continue
                seen.add(doc)
                sentences = _docstring_sentences(doc)
                if len(sentences) >= 2:
                    documents.append(sentences)
    return documents


def _source_docstrings(source: bytes) -> list[str]:
    """The docstrings of a module's source and of all its classes, functions and methods, in source order.

    Parsed with ``ast``, never imported. A file this Python cannot parse (newer
    syntax, a template, a NUL byte) gives none.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    docs = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)  # Indentation cleaned as inspect.getdoc does.
            if doc:
                docs.append(doc)
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # Statements only, no expressions.
            children = getattr(node, field, None)
            if isinstance(children, list):
                for child in children:
                    if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                        visit(child)

    visit(tree)
    return docs


def _source_roots(packages: Sequence[str], stdlib: bool) -> list[tuple[str, str, list[Path]]]:
    """(name, version, source directories) of the standard library and of each installed package, in order.

    Packages are found with ``importlib.util.find_spec`` (which does not import
    a top-level package) and their versions read from their distribution's
    metadata; packages this environment lacks are left out.
    """
    roots = []
    if stdlib:
        roots.append(("python", platform.python_version(), [Path(sysconfig.get_path("stdlib"))]))
    for name in packages:
        spec = importlib.util.find_spec(name)
        locations = sorted(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            continue
        try:
            version = importlib.metadata.version(CORPUS_PACKAGES.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        roots.append((name, version, [Path(location) for location in locations]))
    return roots


def _source_files(directory: Path) -> list[str]:
    """The ``.py`` files under a directory, as sorted relative POSIX paths, skipping ``_SKIPPED_DIRS``."""
    files = []
    for folder, subdirs, names in os.walk(directory):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        relative = Path(folder).relative_to(directory)
        files.extend((relative / name).as_posix() for name in names if name.endswith(".py"))
    return sorted(files)


def corpus_sources(name: str = "packages") -> dict[str, str]:
    """What an embedded corpus is built from: Python's version and, for "packages", each package's version.

    Cheap (no parsing): record it with ``corpus_digest`` so a run says which
    environment made its corpus.
    """
    if name == "stdlib":
        return {"python": platform.python_version()}
    if name == "packages":
        return {source: version for source, version, _ in _source_roots(CORPUS_PACKAGES, stdlib=True)}
    raise ValueError(f"unknown embedded corpus {name!r} (choose from {', '.join(EMBEDDED_CORPORA)})")


def docstring_corpus(
    packages: Sequence[str] = tuple(CORPUS_PACKAGES),
    stdlib: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> list[Document]:
    """Documents from the docstrings in the ``.py`` sources of the standard library and of installed packages.

    Every module, class, function and method docstring of every source file
    (test directories skipped), parsed with ``ast`` without importing anything,
    in a fixed order: the standard library, then ``packages`` in the order
    given, each one's files sorted by path. A docstring whose prose makes two
    or more sentences is a document; documents are kept once. The corpus is
    thus deterministic for the installed versions (see ``corpus_sources``).

    With ``cache_dir`` the corpus is saved there as JSON under a key hashed from
    this module's code, the source versions and every source file's path and
    size, and later calls with the same sources load it instead of parsing
    (about 1 s instead of tens of seconds).
    """
    roots = _source_roots(packages, stdlib)
    listing = [(name, version, [(d, _source_files(d)) for d in dirs]) for name, version, dirs in roots]
    cache_file = None
    if cache_dir is not None:
        sizes = [
            [name, version, [[path, (d / path).stat().st_size] for d, files in trees for path in files]]
            for name, version, trees in listing
        ]
        key = hashlib.sha256(json.dumps([_CODE_DIGEST, sizes]).encode()).hexdigest()[:20]
        cache_file = Path(cache_dir) / f"docstring-corpus-{key}.json"
        if cache_file.is_file():
            return json.loads(cache_file.read_text(encoding="utf-8"))["documents"]

    documents, seen_docs, seen_documents = [], set(), set()
    with _gc_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for invalid escapes in old sources, and the like.
        for _, _, trees in listing:
            for directory, files in trees:
                for path in files:
                    for doc in _source_docstrings((directory / path).read_bytes()):
                        if doc in seen_docs:
                            continue
                        seen_docs.add(doc)
                        sentences = _docstring_sentences(doc)
                        if len(sentences) >= 2 and tuple(sentences) not in seen_documents:
                            seen_documents.add(tuple(sentences))
                            documents.append(sentences)

    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        sources = {name: version for name, version, _ in roots}
        partial.write_text(json.dumps({"sources": sources, "documents": documents}, ensure_ascii=False), "utf-8")
        os.replace(partial, cache_file)  # Atomic: a concurrent reader never sees half a file.
    return documents


def embedded_corpus(name: str = "stdlib", cache_dir: str | os.PathLike | None = None) -> list[Document]:
    """An embedded (offline) corpus by name: "packages" (``docstring_corpus``) or "stdlib" (``stdlib_corpus``).

    ``cache_dir`` caches the "packages" corpus; "stdlib" is built in about a
    second and not cached. The default stays "stdlib" for the callers that
    want the small corpus; the BERT example's ``pretrain.py`` defaults to
    "packages".
    """
    if name == "stdlib":
        return stdlib_corpus()
    if name == "packages":
        return docstring_corpus(cache_dir=cache_dir)
    raise ValueError(f"unknown embedded corpus {name!r} (choose from {', '.join(EMBEDDED_CORPORA)})")


def load_corpus(
    text_dir: str | os.PathLike | None = None,
    hf_dataset: str | os.PathLike | None = None,
    text_column: str = "text",
    embedded: str = "stdlib",
    cache_dir: str | os.PathLike | None = None,
) -> list[Document]:
    """The corpus from a text directory, a saved Hugging Face dataset, or (neither given) an embedded one."""
    if text_dir is not None and hf_dataset is not None:
        raise ValueError("give a text directory or a Hugging Face dataset, not both")
    if text_dir is not None:
        return read_text_dir(text_dir)
    if hf_dataset is not None:
        return read_hf_dataset(hf_dataset, text_column)
    return embedded_corpus(embedded, cache_dir)


# --------------------------------------------------------------------------- tokenizer


def corpus_digest(documents: Sequence[Document]) -> str:
    """SHA-256 of the documents' sentences and their grouping; keys the tokenizer and sentence-ids caches."""
    return hashlib.sha256(json.dumps(documents, ensure_ascii=False).encode("utf-8")).hexdigest()


def _wrap(backend: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """A ``transformers`` tokenizer over a trained ``tokenizers`` one, with BERT's special tokens named."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def _bert_tokenizer(vocab: dict[str, int] | None = None) -> Tokenizer:
    """BERT's WordPiece pipeline (lowercasing BERT normalizer, BERT word splitting) over a vocabulary, or none yet."""
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def _train_wordpiece(documents: Sequence[Document], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Learn a WordPiece vocabulary deterministically and return the pipeline using it.

    ``tokenizers``' trainer numbers the "##x" continuation pieces in hash-map
    order and breaks ties between equally frequent merges by those numbers, so
    two runs can learn different vocabularies (huggingface/tokenizers#1794).
    Declaring every "##x" up front, sorted, fixes their numbers; they are
    passed as trainer special tokens only for that, and the final tokenizer is
    rebuilt from the learned vocabulary so that they are ordinary pieces.
    """
    draft = _bert_tokenizer()
    continuation_chars = sorted(
        {
            char
            for doc in documents
            for word, _ in draft.pre_tokenizer.pre_tokenize_str(draft.normalizer.normalize_str("\n".join(doc)))
            for char in word[1:]
        }
    )
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + [f"##{char}" for char in continuation_chars],
        show_progress=False,
        continuing_subword_prefix="##",
    )
    draft.train_from_iterator((sentence for doc in documents for sentence in doc), trainer=trainer)
    tokenizer = _bert_tokenizer(draft.get_vocab(with_added_tokens=False))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def train_tokenizer(
    documents: Sequence[Document], vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None
) -> transformers.PreTrainedTokenizerFast:
    """Train BERT's lowercase WordPiece tokenizer on the documents' sentences.

    With ``cache_dir`` the trained tokenizer is saved there as ``tokenizers``
    JSON under a key hashed from the settings and the corpus digest, and later
    calls with the same corpus and settings load it instead of retraining.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    settings = {"vocab_size": vocab_size, "min_frequency": 2, "special_tokens": SPECIAL_TOKENS, "lowercase": True}
    cache_file = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps([settings, corpus_digest(documents)]).encode()).hexdigest()[:20]
        cache_file = Path(cache_dir) / f"bert-wordpiece-{key}.json"
        if cache_file.is_file():
            return _wrap(Tokenizer.from_file(str(cache_file)))

    backend = _train_wordpiece(documents, vocab_size, settings["min_frequency"])
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(partial))
        os.replace(partial, cache_file)  # Atomic: a concurrent reader never sees half a file.
    return _wrap(backend)


# --------------------------------------------------------------------------- held-out split


def split_documents(
    documents: Sequence[Document], held_out_fraction: float = 0.02, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Split whole documents (never sentences) into (train, held-out), keeping the corpus order in each.

    Splitting by document keeps held-out text, and every sentence pair built
    from it, out of training (train the tokenizer on the training part too).
    At least one document is held out when the fraction is positive and there
    are two or more.
    """
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    count = round(len(documents) * held_out_fraction)
    if held_out_fraction > 0 and len(documents) >= 2:
        count = min(max(count, 1), len(documents) - 1)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    train = [doc for i, doc in enumerate(documents) if i not in held]
    return train, [doc for i, doc in enumerate(documents) if i in held]


# --------------------------------------------------------------------------- NSP pairs and MLM masking


Span = tuple[int, int, int]  # (document index, first sentence, end sentence) in the documents given.
_Sentence = tuple[int, list[int]]  # (sentence index in its document, token ids)


class PretrainingExample(NamedTuple):
    """One unmasked ``[CLS] A [SEP] B [SEP]`` instance and where its two segments came from."""

    input_ids: list[int]
    token_type_ids: list[int]
    special_mask: list[int]  # 1 at [CLS] and the two [SEP]s: never masked.
    next_sentence_label: int  # 0: B follows A in the document; 1: B is from another document.
    a_span: Span
    b_span: Span


def _truncate_pair(tokens_a: list[int], tokens_b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment, from its front or back at random, until the pair fits (as BERT does)."""
    while len(tokens_a) + len(tokens_b) > max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _span(doc_index: int, sentences: list[_Sentence]) -> Span:
    return doc_index, sentences[0][0], sentences[-1][0] + 1


def _document_examples(
    corpus: list[list[_Sentence]],
    usable: list[int],
    position: int,
    max_tokens: int,
    short_seq_prob: float,
    cls_id: int,
    sep_id: int,
    rng: random.Random,
) -> list[PretrainingExample]:
    """BERT's instances for document ``usable[position]``: chunks of consecutive sentences cut into A and B.

    Unlike the original, a one-sentence chunk does not force a random B: when
    the coin says "actual next", A borrows the following (or preceding)
    sentence of its document, so NSP labels stay a fair coin; only a
    one-sentence document always gets a random B.
    """
    doc_index = usable[position]
    document = corpus[doc_index]
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    examples, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i][1])
        if i == len(document) - 1 or length >= target:
            random_next = rng.random() < 0.5
            if len(chunk) == 1 and not random_next:
                if i + 1 < len(document):
                    i += 1
                    chunk.append(document[i])
                elif i > 0:
                    chunk.insert(0, document[i - 1])
                else:
                    random_next = True
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            segment_a = chunk[:a_end]
            tokens_a = [t for _, ids in segment_a for t in ids]
            if random_next:
                other = rng.randrange(len(usable) - 1)
                b_index = usable[other + (other >= position)]
                other_doc = corpus[b_index]
                segment_b, b_length = [], 0
                for sentence in other_doc[rng.randrange(len(other_doc)) :]:
                    segment_b.append(sentence)
                    b_length += len(sentence[1])
                    if b_length >= target - len(tokens_a):
                        break
                i -= len(chunk) - a_end  # The sentences not used for A start the next chunk, as in BERT.
            else:
                b_index, segment_b = doc_index, chunk[a_end:]
            tokens_b = [t for _, ids in segment_b for t in ids]
            _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            examples.append(
                PretrainingExample(
                    input_ids=[cls_id, *tokens_a, sep_id, *tokens_b, sep_id],
                    token_type_ids=[0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1),
                    special_mask=[1] + [0] * len(tokens_a) + [1] + [0] * len(tokens_b) + [1],
                    next_sentence_label=int(random_next),
                    a_span=_span(doc_index, segment_a),
                    b_span=_span(b_index, segment_b),
                )
            )
            chunk, length = [], 0
        i += 1
    return examples


def encode_sentences(
    documents: Sequence[Document],
    tokenizer: transformers.PreTrainedTokenizerBase,
    cache_dir: str | os.PathLike | None = None,
) -> list[list[int]]:
    """The token ids (no special tokens) of every sentence of the documents, in order.

    With ``cache_dir`` (which needs a fast tokenizer) the ids are saved there
    as ``.npz``, one flat array of ids and the sentences' offsets into it,
    under a key hashed from this module's code, the corpus digest, the
    tokenizer's class and serialized pipeline and the ``tokenizers`` and
    ``transformers`` versions; later calls with the same documents and
    tokenizer load them instead of encoding (a second or two instead of 20-30 s
    for the "packages" corpus's training split).
    """
    with _gc_paused():
        return _encode_sentences(documents, tokenizer, cache_dir)


def _encode_sentences(
    documents: Sequence[Document],
    tokenizer: transformers.PreTrainedTokenizerBase,
    cache_dir: str | os.PathLike | None,
) -> list[list[int]]:
    cache_file = None
    if cache_dir is not None:
        identity = [
            _CODE_DIGEST,
            corpus_digest(documents),
            type(tokenizer).__name__,
            tokenizer.backend_tokenizer.to_str(),
            tokenizers.__version__,
            transformers.__version__,
        ]
        key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
        cache_file = Path(cache_dir) / f"sentence-ids-{key}.npz"
        if cache_file.is_file():
            with np.load(cache_file) as saved:
                ids, offsets = saved["ids"].tolist(), saved["offsets"].tolist()
            return [ids[start:end] for start, end in zip(offsets, offsets[1:])]

    flat = [sentence for doc in documents for sentence in doc]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    if cache_file is not None:
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in encoded], out=offsets[1:])
        dtype = np.min_scalar_type(len(tokenizer) - 1)  # uint16 for vocabularies up to 64k.
        ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(offsets[-1]))
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        with partial.open("wb") as file:  # A file, not a name: np.savez would append ".npz" to the name.
            np.savez(file, ids=ids, offsets=offsets)
        os.replace(partial, cache_file)  # Atomic: a concurrent reader never sees half a file.
    return encoded


def build_examples(
    documents: Sequence[Document],
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_seq_length: int = 128,
    short_seq_prob: float = 0.1,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> list[PretrainingExample]:
    """Sentence-pair instances for NSP and MLM from every document, deterministic for a seed:
    :func:`pair_examples` of the documents' :func:`encode_sentences` (``cache_dir`` caches those; the examples
    are the same with or without it)."""
    encoded = encode_sentences(documents, tokenizer, cache_dir)
    return pair_examples(documents, encoded, tokenizer, max_seq_length, short_seq_prob, seed)


def pair_examples(
    documents: Sequence[Document],
    encoded: Sequence[list[int]],
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_seq_length: int = 128,
    short_seq_prob: float = 0.1,
    seed: int = 0,
) -> list[PretrainingExample]:
    """The instances of :func:`build_examples` from the documents' sentences encoded by :func:`encode_sentences`.

    As in BERT's ``create_pretraining_data.py``: each document is cut into
    chunks of consecutive sentences filling ``max_seq_length - 3`` tokens
    (shorter with probability ``short_seq_prob``), A is a prefix of a chunk and
    B is the rest of it or, half of the time, a run of sentences from another
    document. Sentences that tokenize to nothing are skipped.
    """
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must leave room for [CLS] A [SEP] B [SEP], got {max_seq_length}")
    with _gc_paused():
        corpus, start = [], 0
        for doc in documents:
            corpus.append([(j, ids) for j, ids in enumerate(encoded[start : start + len(doc)]) if ids])
            start += len(doc)
        usable = [i for i, doc in enumerate(corpus) if doc]
        if len(usable) < 2:
            raise ValueError("next-sentence prediction needs at least two documents with text")
        rng = random.Random(seed)
        cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        return [
            example
            for position in range(len(usable))
            for example in _document_examples(
                corpus, usable, position, max_seq_length - 3, short_seq_prob, cls_id, sep_id, rng
            )
        ]


def mask_tokens(
    input_ids: Sequence[int],
    special_mask: Sequence[int],
    tokenizer: transformers.PreTrainedTokenizerBase,
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
    special_ids = set(tokenizer.all_special_ids)
    vocab_size = len(tokenizer)
    corrupted, labels = list(input_ids), [IGNORE_INDEX] * len(input_ids)
    for pos in sorted(rng.sample(candidates, count)):
        labels[pos] = input_ids[pos]
        draw = rng.random()
        if draw < 0.8:
            corrupted[pos] = tokenizer.mask_token_id
        elif draw < 0.9:
            token = rng.randrange(vocab_size)
            while token in special_ids:
                token = rng.randrange(vocab_size)
            corrupted[pos] = token
    return corrupted, labels


# --------------------------------------------------------------------------- dataset and batching


class PretrainingDataset(Dataset):
    """Examples with masks drawn per access (dynamic masking), from an RNG seeded by (seed, epoch, index).

    Every epoch (see ``set_epoch``) sees fresh masks, yet an item is the same
    whichever worker loads it and in whatever order. With persistent DataLoader
    workers call ``set_epoch`` before the workers are started, as they hold a
    copy of the dataset.
    """

    def __init__(
        self,
        examples: Sequence[PretrainingExample],
        tokenizer: transformers.PreTrainedTokenizerBase,
        mlm_probability: float = 0.15,
        seed: int = 0,
    ) -> None:
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the masks of another epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int] | int]:
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{self.epoch}:{index}")  # str seeds hash with SHA-512: stable.
        input_ids, labels = mask_tokens(
            example.input_ids, example.special_mask, self.tokenizer, rng, self.mlm_probability
        )
        return {
            "input_ids": input_ids,
            "token_type_ids": example.token_type_ids,
            "labels": labels,
            "next_sentence_label": example.next_sentence_label,
        }


def collate(batch: Sequence[dict[str, list[int] | int]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad items to the longest and stack them as ``BertForPreTraining.forward``'s keyword arguments.

    ``pad_token_id`` defaults to 0, the id of [PAD] in ``train_tokenizer``'s
    vocabulary. Padding gets attention mask 0 and label -100.
    """
    length = max(len(item["input_ids"]) for item in batch)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.tensor([item[key] + [value] * (length - len(item[key])) for item in batch], dtype=torch.long)

    return {
        "input_ids": padded("input_ids", pad_token_id),
        "token_type_ids": padded("token_type_ids", 0),
        "attention_mask": torch.tensor(
            [[1] * len(item["input_ids"]) + [0] * (length - len(item["input_ids"])) for item in batch],
            dtype=torch.long,
        ),
        "labels": padded("labels", IGNORE_INDEX),
        "next_sentence_label": torch.tensor([item["next_sentence_label"] for item in batch], dtype=torch.long),
    }
