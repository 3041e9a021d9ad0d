"""The README stays true: its file map matches the tree, its links resolve, and it reads as a product
page (no development history).

The file map is the fenced ``text`` block under ``## File map``. Each line there is
``path — description``. A line whose path ends in ``/`` and that starts at column 0 opens a folder:
the indented lines below it name paths relative to that folder. These tests parse it, and then
check two things. Every path it names exists. Every tracked source file under the mapped folders
(``*.py``, ``*.sh``) and ``.ci/run`` has its own line. A file added or removed without its line
fails here, naming the file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAPPED_DIRS = ("src", "tests", "benchmarks", "recipes", "scripts")
MAPPED_SUFFIXES = (".py", ".sh")
ALWAYS_MAPPED = (".ci/run",)
SEP = " — "
# Words that describe how the project was built rather than what it does.
# "session" alone is the Tinker API's own word (a client's session); a working session is not
HISTORY_WORDS = (
    r"\b(this|last|next|previous|working|development) sessions?\b",
    r"\bquiet machine\b",
    r"\bhelpers?\b",
    r"\bissue\s*#?\d+",
)


def file_map_lines(text: str) -> list[str]:
    """The lines of the fenced block that follows the ``## File map`` heading."""
    _, found, rest = text.partition("\n## File map\n")
    assert found, "README.md has no '## File map' section"
    match = re.search(r"^```text\n(.*?)^```", rest, flags=re.S | re.M)
    assert match, "the File map section has no ```text block"
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


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def file_map(readme: str) -> dict[str, str]:
    return parse_file_map(file_map_lines(readme))


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


def test_every_path_in_the_file_map_exists(file_map: dict[str, str]) -> None:
    missing = [p for p in file_map if not (ROOT / p).exists()]
    assert not missing, f"the README's file map names paths that do not exist: {missing}"
    wrong_kind = [p for p in file_map if p.endswith("/") != (ROOT / p).is_dir()]
    assert not wrong_kind, f"folders must end in '/', files must not: {wrong_kind}"


def test_every_source_file_has_a_line_in_the_file_map(file_map: dict[str, str]) -> None:
    required = must_be_mapped(tracked_files())
    assert "src/opentinker/engine/engine.py" in required  # the walk found the tree
    unlisted = [f for f in required if f not in file_map]
    assert not unlisted, (
        f"files missing from the README's file map (add one 'path — description' line each): {unlisted}"
    )


def test_the_readme_has_no_development_history(readme: str) -> None:
    hits = [
        (m.group(0), readme.count("\n", 0, m.start()) + 1)
        for pattern in HISTORY_WORDS
        for m in re.finditer(pattern, readme, flags=re.I)
    ]
    assert not hits, f"README.md describes how it was developed (word, line): {hits}"


def test_local_links_resolve_inside_the_repository(readme: str) -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not re.match(r"[a-z]+://|mailto:", t)]
    assert local, "expected links to the docs (docs/PROTOCOL.md, benchmarks/RESULTS.md)"
    outside = [t for t in local if not (ROOT / t).resolve().is_relative_to(ROOT)]
    assert not outside, f"README.md links outside the repository: {outside}"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
