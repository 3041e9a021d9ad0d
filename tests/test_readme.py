"""The README and the docs stay true: the file maps match the tree, links resolve, the README stays
short and reads as a product page (no development history), and code names no missing document.

Two maps. ``docs/FILES.md`` lists every file: its fenced ``text`` block has one ``path — description``
line each. A line whose path ends in ``/`` and that starts at column 0 opens a folder: the indented
lines below it name paths relative to that folder. Every path it names exists, and every tracked
source file under the mapped folders (``*.py``, ``*.sh``) and ``.ci/run`` has its own line. The
README's ``## Folder map`` block has one ``folder/ — description`` line per folder: every folder it
names exists, and every folder holding a source file (each package under ``src/opentinker/``, each
other top-level folder) has its line. A file or folder added or removed without its line fails
here, naming it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FILES = ROOT / "docs" / "FILES.md"
README_MAX_BYTES = 15 * 1024
MAPPED_DIRS = ("src", "tests", "benchmarks", "recipes", "scripts")
MAPPED_SUFFIXES = (".py", ".sh")
ALWAYS_MAPPED = (".ci/run",)
PACKAGE = "src/opentinker/"
SEP = " — "
# Words that describe how the project was built rather than what it does.
# "session" alone is the Tinker API's own word (a client's session); a working session is not
HISTORY_WORDS = (
    r"\b(this|last|next|previous|working|development) sessions?\b",
    r"\bquiet machine\b",
    r"\bhelpers?\b",
    r"\bissue\s*#?\d+",
)
# Markdown links and images: ``[text](target)`` / ``![alt](target)``; the anchor is dropped.
LINK = re.compile(r"\]\(([^)#\s]*)(?:#[^)\s]*)?\)")
# A Markdown file named in code: ``docs/DESIGN.md``, ``PROTOCOL.md``, ...
MD_NAME = re.compile(r"[\w./-]*\w\.md\b")


def fenced_map_lines(text: str, heading: str) -> list[str]:
    """The lines of the first fenced ``text`` block after the ``heading`` line."""
    _, found, rest = ("\n" + text).partition(f"\n{heading}\n")
    assert found, f"no {heading!r} section"
    match = re.search(r"^```text\n(.*?)^```", rest, flags=re.S | re.M)
    assert match, f"the {heading!r} section has no ```text block"
    return match.group(1).splitlines()


def parse_file_map(lines: list[str]) -> dict[str, str]:
    """``{path: description}`` for every entry; folder lines map to their own (maybe empty) text."""
    entries: dict[str, str] = {}
    folder: str | None = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        indented = line.startswith(" ")
        path, sep, desc = line.strip().partition(SEP)
        path = path.strip()
        if indented:
            assert folder is not None, f"file map line {n}: an indented line needs a folder line above it"
            assert sep and desc.strip(), f"file map line {n}: expected 'name{SEP}description': {line!r}"
            path = folder + path
        elif path.endswith("/") and not sep:
            folder = path  # a folder line without a description: a heading only
        else:
            assert sep and desc.strip(), f"file map line {n}: expected 'path{SEP}description': {line!r}"
            folder = path if path.endswith("/") else None
        assert path not in entries, f"file map line {n}: {path} is listed twice"
        entries[path] = desc.strip()
    return entries


def parse_folder_map(lines: list[str]) -> dict[str, str]:
    """``{folder/: description}``: one unindented ``folder/ — description`` line per folder."""
    entries: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        path, sep, desc = line.partition(SEP)
        assert not line.startswith(" "), f"folder map line {n}: one line per folder, not indented: {line!r}"
        assert path.endswith("/"), f"folder map line {n}: a folder ends in '/': {line!r}"
        assert sep and desc.strip(), f"folder map line {n}: expected 'folder/{SEP}description': {line!r}"
        assert path not in entries, f"folder map line {n}: {path} is listed twice"
        entries[path] = desc.strip()
    return entries


def tracked_files() -> list[str]:
    """Repository files, as git tracks them; a plain walk where there is no git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout
        files = [f for f in out.splitlines() if f and (ROOT / f).exists()]  # not deleted unstaged
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {"__pycache__", ".venv", ".git", "runs", ".pytest_cache", ".ruff_cache"}
    return [
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*")
        if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
    ]


def must_be_mapped(files: list[str]) -> list[str]:
    top = tuple(d + "/" for d in MAPPED_DIRS)
    return sorted(
        f for f in files if (f.startswith(top) and f.endswith(MAPPED_SUFFIXES)) or f in ALWAYS_MAPPED
    )


def folder_of(path: str) -> str | None:
    """The README map's folder for a source file: its package under ``src/opentinker/``, else its
    top-level folder (``None`` for the package's own top-level files: docs/FILES.md lists those)."""
    if path.startswith(PACKAGE):
        rest = path[len(PACKAGE) :]
        return PACKAGE + rest.split("/")[0] + "/" if "/" in rest else None
    return path.split("/")[0] + "/"


def markdown_docs() -> list[Path]:
    return [README, ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def file_map() -> dict[str, str]:
    return parse_file_map(fenced_map_lines(FILES.read_text(encoding="utf-8"), "# Files"))


@pytest.fixture(scope="module")
def folder_map(readme: str) -> dict[str, str]:
    return parse_folder_map(fenced_map_lines(readme, "## Folder map"))


def test_the_parser_reads_folders_and_full_paths() -> None:
    lines = [
        "a.toml — top",
        "",
        "src/pkg/",
        "  x.py — one",
        "  sub/ — a folder",
        "b/c.sh — two",
        "  d.py — three",
    ]
    with pytest.raises(AssertionError, match="indented line needs a folder"):
        parse_file_map(["x.py — top", "  y.py — orphan"])
    assert parse_file_map(lines[:5]) == {
        "a.toml": "top",
        "src/pkg/": "",
        "src/pkg/x.py": "one",
        "src/pkg/sub/": "a folder",
    }
    with pytest.raises(AssertionError, match="needs a folder"):
        parse_file_map(lines)  # d.py follows a file line, not a folder line
    with pytest.raises(AssertionError, match="expected"):
        parse_file_map(["src/", "  x.py"])
    with pytest.raises(AssertionError, match="listed twice"):
        parse_file_map(["src/", "  x.py — a", "src/x.py — b"])


def test_the_folder_parser_takes_one_line_per_folder() -> None:
    assert parse_folder_map(["src/a/ — one", "", "tests/ — two"]) == {"src/a/": "one", "tests/": "two"}
    with pytest.raises(AssertionError, match="not indented"):
        parse_folder_map(["src/ — one", "  a/ — two"])
    with pytest.raises(AssertionError, match="ends in '/'"):
        parse_folder_map(["src/a.py — a file"])
    with pytest.raises(AssertionError, match="expected"):
        parse_folder_map(["src/"])
    with pytest.raises(AssertionError, match="listed twice"):
        parse_folder_map(["src/ — a", "src/ — b"])
    assert folder_of("src/opentinker/engine/engine.py") == "src/opentinker/engine/"
    assert folder_of("src/opentinker/__init__.py") is None
    assert folder_of("tests/test_readme.py") == "tests/"
    assert folder_of(".ci/run") == ".ci/"


def test_every_path_in_the_file_map_exists(file_map: dict[str, str]) -> None:
    missing = [p for p in file_map if not (ROOT / p).exists()]
    assert not missing, f"docs/FILES.md names paths that do not exist: {missing}"
    wrong_kind = [p for p in file_map if p.endswith("/") != (ROOT / p).is_dir()]
    assert not wrong_kind, f"folders must end in '/', files must not: {wrong_kind}"


def test_every_source_file_has_a_line_in_the_file_map(file_map: dict[str, str]) -> None:
    required = must_be_mapped(tracked_files())
    assert "src/opentinker/engine/engine.py" in required  # the walk found the tree
    unlisted = [f for f in required if f not in file_map]
    assert not unlisted, (
        f"files missing from docs/FILES.md (add one 'path — description' line each): {unlisted}"
    )


def test_every_folder_in_the_readme_map_exists(folder_map: dict[str, str]) -> None:
    missing = [p for p in folder_map if not (ROOT / p).is_dir()]
    assert not missing, f"the README's folder map names folders that do not exist: {missing}"


def test_every_source_folder_has_a_line_in_the_readme_map(folder_map: dict[str, str]) -> None:
    required = sorted({f for p in must_be_mapped(tracked_files()) if (f := folder_of(p))})
    assert "src/opentinker/engine/" in required  # the walk found the tree
    unlisted = [f for f in required if f not in folder_map]
    assert not unlisted, (
        f"folders missing from the README's folder map (add one 'folder/ — description' line each): {unlisted}"
    )


def test_the_readme_is_at_most_15_kb() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/ and link to it"
    )


def test_the_readme_has_no_development_history(readme: str) -> None:
    hits = [
        (m.group(0), readme.count("\n", 0, m.start()) + 1)
        for pattern in HISTORY_WORDS
        for m in re.finditer(pattern, readme, flags=re.I)
    ]
    assert not hits, f"README.md describes how it was developed (word, line): {hits}"


@pytest.mark.parametrize("doc", markdown_docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    targets = [t for t in LINK.findall(doc.read_text(encoding="utf-8")) if t]
    local = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    if doc == README:
        assert local, "expected links to the docs (docs/SERVER.md, benchmarks/RESULTS.md)"
    outside = [t for t in local if not (doc.parent / t).resolve().is_relative_to(ROOT)]
    assert not outside, f"{doc.name} links outside the repository: {outside}"
    missing = [t for t in local if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_the_link_pattern_reads_links_images_and_anchors() -> None:
    text = "[a](docs/X.md) ![b](shots/y.png) [c](X.md#part) [d](#top) [e](https://e.org/f)"
    assert LINK.findall(text) == ["docs/X.md", "shots/y.png", "X.md", "", "https://e.org/f"]


def test_code_names_only_documents_that_exist() -> None:
    """A Markdown file named in src/, tests/ or benchmarks/ (``docs/DESIGN.md``, ``PROTOCOL.md``)
    exists: at that path from the repository root, or, for a bare name, at the root, in docs/ or
    beside the file that names it; a design section is cited by name. This file is left out: the names in its tests are data."""
    missing = []
    for rel in tracked_files():
        if not rel.startswith(("src/", "tests/", "benchmarks/")) or not rel.endswith(MAPPED_SUFFIXES):
            continue
        if rel == "tests/test_readme.py":
            continue
        path = ROOT / rel
        text = path.read_text(encoding="utf-8")
        # docs/DESIGN.md's sections have names, not numbers: a "§N" points at no section
        missing += [f"{rel}: {m.group(0)}" for m in re.finditer(r"DESIGN\.md,? §\s*\d+", text)]
        for name in set(MD_NAME.findall(text)):
            name = name.lstrip("./")
            places = [ROOT / name] if "/" in name else [ROOT / name, ROOT / "docs" / name, path.parent / name]
            if not any(p.is_file() for p in places):
                missing.append(f"{rel}: {name}")
    assert not missing, f"code names Markdown files that are not in the repository: {missing}"


def test_the_document_pattern_finds_paths_and_bare_names() -> None:
    text = "see docs/DESIGN.md, invariant 3; PROTOCOL.md (Futures); recipes/<t>/README.md; x.mdx"
    assert MD_NAME.findall(text) == ["docs/DESIGN.md", "PROTOCOL.md", "/README.md"]
