"""BERT pretraining data: corpora, a WordPiece tokenizer, NSP sentence pairs and MLM masking.

Follows the original BERT recipe (``create_pretraining_data.py``) and NVIDIA's
PyTorch port of it, written from scratch for this repository:

* a corpus is documents, each a list of sentences; it comes from a directory of
  text files or a Hugging Face dataset saved with ``save_to_disk`` (read in
  pieces by ``sources.py``), or from an embedded corpus built from docstrings,
  so the example runs offline with nothing to download. The "packages" corpus
  (``docstring_corpus``, the pretraining script's default) parses with ``ast``,
  without importing them, the ``.py`` sources of the standard library and of
  the pinned dependencies (``CORPUS_PACKAGES``): with Python 3.11 and
  requirements-dev.txt's versions, about 34k documents, 237k sentences and
  18 MB of text; it takes about 30 s to build and is cached. The "stdlib"
  corpus (``stdlib_corpus``, the library's default) takes the docstrings of
  ~230 imported standard-library modules: 2.3k documents, 0.8 MB;
* a lowercase WordPiece vocabulary is trained on it with ``tokenizers``;
* documents (never sentences) are split into a training set and a held-out set;
* sentence pairs ``[CLS] A [SEP] B [SEP]`` are built for next-sentence
  prediction, B being the true continuation of A half of the time and a segment
  of another document otherwise, as ranges of a flat array of token ids
  (``pair_ranges``: what ``prepare.py`` writes to a shard, and
  ``build_examples`` builds in memory for a small corpus);
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

if TYPE_CHECKING:  # imported where used: a preparation worker needs neither (torch alone is 220 MB of memory)
    import torch
    import transformers

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


def text_documents(text: str) -> list[Document]:
    """Documents are blocks of non-blank lines; each line holds one or more sentences."""
    documents, current = [], []
    for line in text.splitlines() + [""]:
        if line.strip():
            current.extend(split_sentences(line))
        elif current:
            documents.append(current)
            current = []
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


# --------------------------------------------------------------------------- tokenizer


def corpus_digest(documents: Sequence[Document]) -> str:
    """SHA-256 of the documents' sentences and their grouping; keys the tokenizer and sentence-ids caches."""
    return hashlib.sha256(json.dumps(documents, ensure_ascii=False).encode("utf-8")).hexdigest()


def _bert_tokenizer(vocab: dict[str, int] | None = None) -> Tokenizer:
    """BERT's WordPiece pipeline (lowercasing BERT normalizer, BERT word splitting) over a vocabulary, or none yet."""
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def train_wordpiece(sentences: Callable[[], Iterable[str]], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Learn a WordPiece vocabulary deterministically from the sentences ``sentences()`` yields (called twice, so a
    large sample streams from disk instead of being held) and return the pipeline using it.

    ``tokenizers``' trainer numbers the "##x" continuation pieces in hash-map
    order and breaks ties between equally frequent merges by those numbers, so
    two runs can learn different vocabularies (huggingface/tokenizers#1794).
    Declaring every "##x" up front, sorted, fixes their numbers; they are
    passed as trainer special tokens only for that, and the final tokenizer is
    rebuilt from the learned vocabulary so that they are ordinary pieces.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    draft = _bert_tokenizer()
    continuation_chars: set[str] = set()
    stream = iter(sentences())
    while batch := list(itertools.islice(stream, 1024)):  # one normalizer call per 1,024 sentences
        words = draft.pre_tokenizer.pre_tokenize_str(draft.normalizer.normalize_str("\n".join(batch)))
        continuation_chars.update(char for word, _ in words for char in word[1:])
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + [f"##{char}" for char in sorted(continuation_chars)],
        show_progress=False,
        continuing_subword_prefix="##",
    )
    draft.train_from_iterator(sentences(), trainer=trainer)
    tokenizer = _bert_tokenizer(draft.get_vocab(with_added_tokens=False))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def wrap_tokenizer(backend: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """A ``transformers`` tokenizer over a ``tokenizers`` one, with BERT's special tokens named."""
    import transformers

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def train_tokenizer(
    documents: Sequence[Document], vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None
) -> transformers.PreTrainedTokenizerFast:
    """Train BERT's lowercase WordPiece tokenizer on the documents' sentences (:func:`train_wordpiece`).

    With ``cache_dir`` the trained tokenizer is saved there as ``tokenizers``
    JSON under a key hashed from the settings and the corpus digest, and later
    calls with the same corpus and settings load it instead of retraining.
    """
    settings = {"vocab_size": vocab_size, "min_frequency": 2, "special_tokens": SPECIAL_TOKENS, "lowercase": True}
    cache_file = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps([settings, corpus_digest(documents)]).encode()).hexdigest()[:20]
        cache_file = Path(cache_dir) / f"bert-wordpiece-{key}.json"
        if cache_file.is_file():
            return wrap_tokenizer(Tokenizer.from_file(str(cache_file)))

    backend = train_wordpiece(lambda: (s for doc in documents for s in doc), vocab_size, settings["min_frequency"])
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(partial))
        os.replace(partial, cache_file)  # Atomic: a concurrent reader never sees half a file.
    return wrap_tokenizer(backend)


# --------------------------------------------------------------------------- held-out split


def split_documents(
    documents: Sequence[Document], held_out_fraction: float = 0.02, seed: int | str = 0, minimum: int = 1
) -> tuple[list[Document], list[Document]]:
    """Split whole documents (never sentences) into (train, held-out), keeping the corpus order in each.

    Splitting by document keeps held-out text, and every sentence pair built
    from it, out of training (train the tokenizer on the training part too).
    When the fraction is positive and there are ``2 * minimum`` documents or
    more, each side keeps at least ``minimum`` (a preparation shard holds out
    two, so that its held-out pairs can draw a random B from another document).
    """
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    count = round(len(documents) * held_out_fraction)
    if held_out_fraction > 0 and len(documents) >= 2 * minimum:
        count = min(max(count, minimum), len(documents) - minimum)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    train = [doc for i, doc in enumerate(documents) if i not in held]
    return train, [doc for i, doc in enumerate(documents) if i in held]


# --------------------------------------------------------------------------- NSP pairs and MLM masking


class Pair(NamedTuple):
    """One ``[CLS] A [SEP] B [SEP]`` instance as two ranges of a flat array of token ids (no special tokens).

    A is a run of consecutive sentences of one document, B the rest of its chunk or a run of another document's
    sentences, each cut at either end by the truncation: so each is one contiguous range of the array in which the
    documents' sentences lie one after another (a prepared shard's ``tokens.npy``).
    """

    a_start: int
    a_length: int
    b_start: int
    b_length: int
    next_sentence_label: int  # 0: B follows A in the document; 1: B is from another document.


Sentence = tuple[int, int]
"""A sentence's (start, length) in the flat array of token ids."""


def _truncate(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer of the ``[start, length]`` segments, from its front or back at random, until the pair fits
    (as BERT trims its token lists)."""
    while a[1] + b[1] > max_tokens:
        longer = a if a[1] > b[1] else b
        if rng.random() < 0.5:
            longer[0] += 1
        longer[1] -= 1


def _run(sentences: Sequence[Sentence]) -> list[int]:
    """The ``[start, length]`` of consecutive sentences (empty ones, which hold no tokens, are never in a run)."""
    return [sentences[0][0], sentences[-1][0] + sentences[-1][1] - sentences[0][0]]


def _document_pairs(
    documents: Sequence[Sequence[Sentence]], position: int, max_tokens: int, short_seq_prob: float, rng: random.Random
) -> list[Pair]:
    """BERT's instances for ``documents[position]``: chunks of consecutive sentences cut into A and B.

    As in BERT's ``create_pretraining_data.py``, but a one-sentence chunk does not force a random B: when the coin
    says "actual next", A borrows the following (or preceding) sentence of its document, so NSP labels stay a fair
    coin; only a one-sentence document always gets a random B.
    """
    document = documents[position]
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    pairs, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += document[i][1]
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
            a = _run(chunk[:a_end])
            if random_next:
                other = rng.randrange(len(documents) - 1)
                other_document = documents[other + (other >= position)]
                segment_b, b_length = [], 0
                for sentence in other_document[rng.randrange(len(other_document)) :]:
                    segment_b.append(sentence)
                    b_length += sentence[1]
                    if b_length >= target - a[1]:
                        break
                i -= len(chunk) - a_end  # The sentences not used for A start the next chunk, as in BERT.
            else:
                segment_b = chunk[a_end:]
            b = _run(segment_b)
            _truncate(a, b, max_tokens, rng)
            pairs.append(Pair(a[0], a[1], b[0], b[1], int(random_next)))
            chunk, length = [], 0
        i += 1
    return pairs


def pair_ranges(
    documents: Sequence[Sequence[Sentence]], max_seq_length: int, short_seq_prob: float, rng: random.Random
) -> list[Pair]:
    """The NSP instances of documents given as their sentences' ranges in a flat array of token ids.

    Each document is cut into chunks of consecutive sentences filling ``max_seq_length - 3`` tokens (shorter with
    probability ``short_seq_prob``); A is a prefix of a chunk and B the rest of it or, half of the time, a run of
    sentences from another document. Empty sentences and documents are skipped. The same instances, in the same
    order, whether the ids are held in memory (:func:`build_examples`) or in a prepared shard.
    """
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must leave room for [CLS] A [SEP] B [SEP], got {max_seq_length}")
    usable = [kept for doc in documents if (kept := [s for s in doc if s[1]])]
    if len(usable) < 2:
        raise ValueError("next-sentence prediction needs at least two documents with text")
    return [
        pair
        for position in range(len(usable))
        for pair in _document_pairs(usable, position, max_seq_length - 3, short_seq_prob, rng)
    ]


def encode_flat(
    sentences: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, batch: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Every sentence's token ids (no special tokens) in one flat array of ``dtype``, and each sentence's length.

    Encoded ``batch`` sentences at a time with the fast ``tokenizers`` backend, so memory holds the flat arrays and
    one batch of Python ids, never the whole corpus's.
    """
    tokens, lengths, pending = [], [], []

    def flush() -> None:
        ids = [encoding.ids for encoding in tokenizer.encode_batch(pending, add_special_tokens=False)]
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens.append(np.fromiter(itertools.chain.from_iterable(ids), dtype, int(counts.sum())))
        lengths.append(counts)
        pending.clear()

    for sentence in sentences:
        pending.append(sentence)
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(tokens) if tokens else empty.astype(dtype)), (np.concatenate(lengths) if lengths else empty)


def document_sentences(documents: Sequence[Document], lengths: np.ndarray, start: int = 0) -> list[list[Sentence]]:
    """Each document's sentences as ``(start, length)`` in the flat array :func:`encode_flat` made of them (whose
    first token is at ``start``)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + start
    ranges, first = [], 0
    for doc in documents:
        ranges.append([(int(offsets[k]), int(lengths[k])) for k in range(first, first + len(doc))])
        first += len(doc)
    return ranges


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a vocabulary (uint16 up to 65,536 tokens)."""
    return np.dtype(np.min_scalar_type(max(vocab_size - 1, 0)))


class PretrainingExample(NamedTuple):
    """One unmasked ``[CLS] A [SEP] B [SEP]`` instance."""

    input_ids: list[int]
    token_type_ids: list[int]
    special_mask: list[int]  # 1 at [CLS] and the two [SEP]s: never masked.
    next_sentence_label: int  # 0: B follows A in the document; 1: B is from another document.


def assemble_segments(
    a: list[int], b: list[int], next_sentence_label: int, cls_id: int, sep_id: int
) -> PretrainingExample:
    """The instance ``[CLS] a [SEP] b [SEP]``."""
    return PretrainingExample(
        input_ids=[cls_id, *a, sep_id, *b, sep_id],
        token_type_ids=[0] * (len(a) + 2) + [1] * (len(b) + 1),
        special_mask=[1] + [0] * len(a) + [1] + [0] * len(b) + [1],
        next_sentence_label=int(next_sentence_label),
    )


def assemble(tokens: np.ndarray, pair: Pair, cls_id: int, sep_id: int) -> PretrainingExample:
    """The instance a :class:`Pair` of ranges into ``tokens`` describes."""
    a = tokens[pair.a_start : pair.a_start + pair.a_length].tolist()
    b = tokens[pair.b_start : pair.b_start + pair.b_length].tolist()
    return assemble_segments(a, b, pair.next_sentence_label, cls_id, sep_id)


def build_examples(
    documents: Sequence[Document],
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_seq_length: int = 128,
    short_seq_prob: float = 0.1,
    seed: int = 0,
) -> list[PretrainingExample]:
    """Sentence-pair instances for NSP and MLM from every document, in memory, deterministic for a seed: the
    documents' sentences :func:`encode_flat`-ed and cut by :func:`pair_ranges` (what a preparation shard holds, for
    a corpus small enough to hold; ``prepare.py`` streams a large one to disk)."""
    with _gc_paused():
        dtype = token_dtype(len(tokenizer))
        tokens, lengths = encode_flat((s for doc in documents for s in doc), tokenizer.backend_tokenizer, dtype)
        pairs = pair_ranges(document_sentences(documents, lengths), max_seq_length, short_seq_prob, random.Random(seed))
        return [assemble(tokens, pair, tokenizer.cls_token_id, tokenizer.sep_token_id) for pair in pairs]


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
