"""The front door: README.md's length, width and content; every relative link in the docs resolving to a file and,
where it names one, to a heading of that file; no machine's absolute paths in the committed results and docs."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
README_MAX_WIDTH = 120

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

ISSUE_NUMBER = re.compile(r"\bissues?[\s#-]*\d+|\bPR[\s#-]*\d+|(?<![\w&/])#\d+\b", re.IGNORECASE)
"""An issue or pull-request number as prose writes it: "issue 45", "issues 45-46", "#48", "PR 12"."""
COMMIT_HASH = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
"""An abbreviated or full commit hash: 7-40 lowercase hex digits, with at least one digit and one letter."""
MACHINE_PATH = re.compile(r"(?<![\w.$~-])/(?:work|root|home|tmp|opt|mnt|scratch)/")
"""The start of an absolute path on a development or device machine."""


def prose_lines(text: str) -> list[str]:
    """``text``'s lines with fenced code blocks blanked and inline code spans removed (line numbers kept)."""
    lines, fence = [], ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            lines.append("")
        elif match:
            fence = match.group(1)
            lines.append("")
        else:
            lines.append(_CODE_SPAN.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation other than '-' and '_' removed,
    spaces turned into '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' (a repeated one as ``slug-1``, ``slug-2``, ...), and HTML ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence or match:
            if not fence:
                fence = match.group(1)
            elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
            continue
        found.update(_HTML_ANCHOR.findall(line))
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> Iterable[tuple[int, str]]:
    """``(line number, target)`` of every inline, image and reference link outside code."""
    for number, line in enumerate(prose_lines(text), start=1):
        for match in _LINK.finditer(line):
            yield number, match.group(2)
        reference = _REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)


def broken_links(pages: Sequence[Path], root: Path) -> list[str]:
    """``"page:line: target: why"`` for each relative link in ``pages`` whose file (under ``root``) does not exist,
    or whose ``#anchor`` is not a heading of the Markdown file it names. Absolute URLs are not checked."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for number, target in links(text):
            if not target or _SCHEME.match(target) or target.startswith("//"):
                continue
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            where = f"{page.relative_to(root)}:{number}: {target}"
            file = (page.parent / path_part).resolve() if path_part else page.resolve()
            if path_part.startswith("/") or not file.is_relative_to(root.resolve()):
                problems.append(f"{where}: leaves the repository")
                continue
            if not file.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and file.suffix.lower() == ".md":
                if file not in cache:
                    cache[file] = anchors(file.read_text(encoding="utf-8"))
                if unquote(anchor) not in cache[file]:
                    problems.append(f"{where}: no heading #{anchor} in {file.relative_to(root.resolve())}")
    return problems


def checked_pages(root: Path) -> list[Path]:
    """README.md, every page of docs/, and every other README.md in the repository's own folders."""
    readmes = [
        p
        for p in root.rglob("README.md")
        if not any(part.startswith(".") or part in ("runs", "node_modules") for part in p.relative_to(root).parts)
    ]
    return sorted({*readmes, *(root / "docs").glob("*.md")})


# --- the repository's own pages ---------------------------------------------------------------------------------


def test_readme_is_short_and_narrow() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    wide = [f"{n}: {len(line)}" for n, line in enumerate(lines, start=1) if len(line) > README_MAX_WIDTH]
    assert not wide, f"README.md lines over {README_MAX_WIDTH} characters (line: width): {wide}"


def test_readme_names_no_issue_or_commit() -> None:
    """History (which issue or commit measured what) lives in docs/convergence.md, docs/performance.md and
    benchmarks/README.md; the front page gives figures with their commands and result files."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    issues = [f"{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1) for m in ISSUE_NUMBER.finditer(line)]
    commits = [f"{n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1) for m in COMMIT_HASH.finditer(line)]
    assert not issues, f"README.md names issues: {issues}"
    assert not commits, f"README.md names commits: {commits}"


def test_every_relative_link_resolves() -> None:
    pages = checked_pages(ROOT)
    assert ROOT / "README.md" in pages and ROOT / "docs" / "convergence.md" in pages
    assert ROOT / "benchmarks" / "README.md" in pages
    problems = broken_links(pages, ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_no_machine_paths_in_results_or_docs() -> None:
    """Committed results and docs name no machine's directories (benchmarks write them through
    ``time_to_target.portable``)."""
    results = [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file() and p.suffix != ".png"]
    assert results, "benchmarks/results/ holds no results"
    found = []
    for path in [*results, *checked_pages(ROOT)]:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            for match in MACHINE_PATH.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line[match.start():match.start() + 60]}")
    assert not found, "absolute paths of a machine:\n" + "\n".join(found[:20])


# --- the checker itself, on a small tree --------------------------------------------------------------------------


def _tree(root: Path, readme: str) -> list[Path]:
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text(
        "# Guide\n\n## Kept bases: `basis_keep_drift` (item 2, continued)\n\n## Setup\n\n## Setup\n\n"
        '<a id="old-name"></a>\n\n```\n## not a heading\n[not a link](missing.md)\n```\n\n'
        "Back to [the start](../README.md#quick-start) and [here](#setup-1).\n",
        encoding="utf-8",
    )
    (root / "data.json").write_text("{}", encoding="utf-8")
    (root / "README.md").write_text("# Tool\n\n## Quick start\n\n" + readme, encoding="utf-8")
    return [root / "README.md", root / "docs" / "guide.md"]


def test_slug_follows_githubs_rule() -> None:
    assert slug("Kept bases: `basis_keep_drift` (issue 45, item 2, continued)") == (
        "kept-bases-basis_keep_drift-issue-45-item-2-continued"
    )
    assert slug("Against the peers: DeepSpeed's Muon, SOAP and PSGD-Kron") == (
        "against-the-peers-deepspeeds-muon-soap-and-psgd-kron"
    )
    assert slug("ResNet-8 at 1,024 and 4,096") == "resnet-8-at-1024-and-4096"
    assert slug("The [placement](placement.md) modes") == "the-placement-modes"
    assert slug("`make demo`") == "make-demo"


def test_checker_passes_a_sound_tree(tmp_path: Path) -> None:
    pages = _tree(
        tmp_path,
        "See [the guide](docs/guide.md), [a section](docs/guide.md#kept-bases-basis_keep_drift-item-2-continued),\n"
        "[the second Setup](docs/guide.md#setup-1), [an HTML anchor](docs/guide.md#old-name), [data](data.json),\n"
        "[a folder](docs), [the web](https://example.com/x.md#nowhere), `[code](missing.md)`.\n\n"
        "[ref]: docs/guide.md#setup\n",
    )
    assert broken_links(pages, tmp_path) == []


@pytest.mark.parametrize(
    "link, why",
    [
        ("[gone](docs/missing.md)", "no such file"),
        ("[gone](docs/guide.md#no-such-heading)", "no heading #no-such-heading"),
        ("[gone](docs/guide.md#not-a-heading)", "no heading #not-a-heading"),  # a '#' line inside a code block
        ("[gone](#nowhere)", "no heading #nowhere"),
        ("![gone](plot.png)", "no such file"),
        ("[gone](../outside.md)", "leaves the repository"),
        ("[gone]: docs/guide.md#setup-2", "no heading #setup-2"),
    ],
)
def test_checker_fails_a_broken_link(tmp_path: Path, link: str, why: str) -> None:
    pages = _tree(tmp_path, f"Intro.\n\n{link}\n")
    problems = broken_links(pages, tmp_path)
    assert len(problems) == 1 and why in problems[0] and problems[0].startswith("README.md:7: "), problems


def test_front_door_patterns() -> None:
    assert ISSUE_NUMBER.search("since issue 45 the refreshes") and ISSUE_NUMBER.search("see #48")
    assert ISSUE_NUMBER.search("(issues 45-46)") and not ISSUE_NUMBER.search("figure 4.3, 256 sequences")
    assert COMMIT_HASH.search("a fresh clone of 306410f") and COMMIT_HASH.search("at e598fe4:")
    assert not COMMIT_HASH.search("1,024 x 128, 0.0123456 and deadbeef and runs/bert-phase1/9f4a64b5589fc5eb")
    assert MACHINE_PATH.search("--out /work/main/runs/x") and MACHINE_PATH.search("'/tmp/tmpab/spec.json'")
    assert not MACHINE_PATH.search("--out runs/x $TMPDIR/spec.json docs/tmp/ /dev/shm")


def test_portable_makes_results_free_of_machine_paths() -> None:
    import importlib.util
    import sys
    import tempfile

    ttt = sys.modules.get("time_to_target")
    if ttt is None:
        spec = importlib.util.spec_from_file_location("time_to_target", ROOT / "benchmarks" / "time_to_target.py")
        ttt = importlib.util.module_from_spec(spec)
        sys.modules["time_to_target"] = ttt  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(ttt)
    root, tmp = ttt.ROOT, tempfile.gettempdir()
    result = {
        "command": f"python benchmarks/peers.py run bert --out {root}/runs/peers --phase1 {root}/runs/bert-phase1/k",
        "extra_args": ["--init-checkpoint", Path(root) / "runs" / "p1", 3, None],
        "log": f"File {tmp}/tmpab/spec.json; {root}2/other stays",
    }
    other = f"{root}2/other stays"  # not the checkout: kept, unless it lies in the temporary directory itself
    if other.startswith(tmp.rstrip("/") + "/"):
        other = "$TMPDIR" + other[len(tmp.rstrip("/")) :]
    assert ttt.portable(result) == {
        "command": "python benchmarks/peers.py run bert --out runs/peers --phase1 runs/bert-phase1/k",
        "extra_args": ["--init-checkpoint", "runs/p1", 3, None],
        "log": f"File $TMPDIR/tmpab/spec.json; {other}",
    }
