"""No function in deepwell runs over ~80 lines (issue 28): a longer one does more than one
job and is split by job.

Read from the source with `ast`, every function and method, nested ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
PACKAGES = ("deepwell",)


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of each function in `source` longer than `limit` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_a_function_over_the_limit_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    assert long_functions(f"def short():\n    pass\n\ndef long():\n{body}", 5) == [("long", 6)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_80_lines(package):
    found = [
        f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, lines in long_functions(path.read_text(encoding="utf-8"), MAX_LINES)
    ]
    assert found == []
