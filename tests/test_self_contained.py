"""The repository stands on its own: no code reaches for files beside the checkout.

A clone has nothing next to it, so a path built from `__file__` that climbs above the
repository root, or one into the project's `../shared` folder, would skip or fail there.
Test data lives in tests/data/, workload W in benchmarks/workload.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("deepwell", "tests", "benchmarks", "docs", "examples", ".ci")
SCANNED_FILES = ("Makefile", "README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".cfg", ".txt", ""}
# `../shared`, `shared/spec`, `shared/bench`, or "shared" joined onto a path.
SHARED = re.compile(r"\.\./shared\b|\bshared/(?:spec|bench)\b|/\s*[\"']shared[\"']")
# This file's own path, N levels up.
CLIMB = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")


def outside_references(text: str, relative: Path) -> list[str]:
    """The lines of a file at `relative` (to the root) that name a path outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        # parents[len(parts) - 1] of a file is the root; a larger index is above it.
        climbs_out = any(
            int(climb.group(1)) >= len(relative.parts) for climb in CLIMB.finditer(line)
        )
        if climbs_out or SHARED.search(line):
            found.append(f"{relative}:{number}: {line.strip()}")
    return found


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES]
    for folder in SCANNED_DIRS:
        files += (
            path
            for path in (ROOT / folder).rglob("*")
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
        )
    return [path for path in files if path != Path(__file__).resolve()]


def test_no_file_reaches_outside_the_repository():
    files = scanned_files()
    assert len(files) > 100  # the scan saw the tree
    found = [
        line
        for path in files
        for line in outside_references(
            path.read_text(encoding="utf-8", errors="replace"), path.relative_to(ROOT)
        )
    ]
    assert found == []


def test_the_check_catches_both_ways_out():
    here = Path("tests/recipe/cases.py")
    climb_out = 'SPEC = Path(__file__).resolve().parents[3] / "spec"'
    assert outside_references(climb_out, here) == [f"{here}:1: {climb_out}"]
    both = 'Path(__file__).resolve().parents[3] / "shared" / "spec"'
    assert outside_references(both, here) == [f"{here}:1: {both}"]
    assert outside_references("Path(__file__).resolve().parents[2] / 'x'", here) == []
    for line in (
        "see ../shared/bench/workload.py",
        'ROOT.parent / "shared" / "x"',
        "shared/spec/a.md",
    ):
        assert outside_references(line, here) == [f"{here}:1: {line}"]
    assert outside_references("a shared prefix; --shared-prefix", here) == []
    assert outside_references("Path(module.__file__).parents[3]", here) == []


def test_the_data_the_tests_read_is_in_the_repository():
    assert (ROOT / "tests" / "data" / "recipe_vectors.json").stat().st_size > 1_000_000
    assert (ROOT / "benchmarks" / "workload.py").is_file()
