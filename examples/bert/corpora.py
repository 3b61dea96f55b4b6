"""BERT's embedded corpora, so the example runs offline with nothing to download: documents (lists of sentences)
from docstrings. The "packages" corpus (:func:`docstring_corpus`, the pretraining script's default) parses with
``ast``, without importing them, the ``.py`` sources of the standard library and of the pinned dependencies
(:data:`CORPUS_PACKAGES`): with Python 3.11 and requirements-dev.txt's versions, about 34k documents, 237k
sentences and 18 MB of text; it takes about 30 s to build and is cached. The "stdlib" corpus
(:func:`stdlib_corpus`) takes the docstrings of ~230 imported standard-library modules: 2.3k documents, 0.8 MB.
Sentences are split at ``. ``, ``? ``, ``! `` (:func:`split_sentences`), as in text files (:func:`text_documents`)."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pairing import Document, gc_paused

if TYPE_CHECKING:  # imported where used: a preparation worker needs neither (torch alone is 220 MB of memory)
    pass

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
    with gc_paused(), warnings.catch_warnings():
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


def corpus_digest(documents: Sequence[Document]) -> str:
    """SHA-256 of the documents' sentences and their grouping; keys the tokenizer and sentence-ids caches."""
    return hashlib.sha256(json.dumps(documents, ensure_ascii=False).encode("utf-8")).hexdigest()
