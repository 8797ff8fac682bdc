"""Every DEEPWELL_* variable deepwell reads is registered once and read through the registry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import deepwell.serve.settings  # noqa: F401 - registers DEEPWELL_API_KEY
from deepwell.settings import environment
from deepwell.settings.engine import EngineArgs  # noqa: F401 - registers the engine's

PACKAGE = Path(environment.__file__).resolve().parents[1]
# Preprocessor switches of the C++ kernels (layers/decode_kernel.py), not variables.
COMPILER_DEFINES = {"DEEPWELL_QUANT_AVX2", "DEEPWELL_QUANT_SCALAR", "DEEPWELL_ONE_EXTENSION"}


def test_every_variable_named_in_the_package_is_registered() -> None:
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bDEEPWELL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named - COMPILER_DEFINES <= set(environment.registered())
    assert "DEEPWELL_EXPAND_WEIGHTS" in environment.registered()


def test_the_package_reads_them_only_through_the_registry() -> None:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"environ(\.get)?\W+\"DEEPWELL_", text), path


def test_read_parses_and_names_the_variable_it_refuses() -> None:
    name = "DEEPWELL_YOCO_PREFILL_KEEP_TOKENS"
    assert environment.read(name, {}) is None
    assert environment.read(name, {name: ""}) is None
    assert environment.read(name, {name: "150"}) == 150
    with pytest.raises(ValueError, match=f"{name} must be an integer, got 'lots'"):
        environment.read(name, {name: "lots"})
    with pytest.raises(KeyError):
        environment.read("DEEPWELL_NOT_DECLARED", {})


def test_a_variable_cannot_be_declared_twice() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        environment.register("DEEPWELL_BATCH_INVARIANT", "again", environment.parse_flag)


def _environment_reads(tree: ast.AST) -> tuple[set[str], list[int]]:
    """The variable names a module reads or writes through `os.environ` (or an `environ`
    mapping handed in) and `os.getenv`, and the lines where the name is not a literal."""
    names: set[str] = set()
    unnamed: list[int] = []

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    def key(node: ast.AST, at: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        else:
            unnamed.append(at.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key(node.slice, node)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key(node.left, node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            reads_mapping = is_environ(func.value) and func.attr in ("get", "pop", "setdefault")
            getenv = func.attr == "getenv" and isinstance(func.value, ast.Name)
            if (reads_mapping or getenv) and node.args:
                key(node.args[0], node)
    return names, unnamed


def test_every_variable_read_anywhere_in_the_package_is_in_the_registry() -> None:
    known = set(environment.registered()) | set(environment.foreign())
    registry = PACKAGE / "settings" / "environment.py"
    for path in PACKAGE.rglob("*.py"):
        names, unnamed = _environment_reads(ast.parse(path.read_text()))
        assert names <= known, (path, sorted(names - known))
        # Only the registry reads a variable whose name it is handed.
        assert not unnamed or path == registry, (path, unnamed)


def test_the_scan_finds_each_way_of_reading_a_variable() -> None:
    source = (
        "import os\n"
        "a = os.environ['A']\n"
        "b = os.environ.get('B', '')\n"
        "c = os.getenv('C')\n"
        "d = 'D' in os.environ\n"
        "def f(environ):\n"
        "    return environ.get('E'), environ[name]\n"
    )
    names, unnamed = _environment_reads(ast.parse(source))
    assert names == {"A", "B", "C", "D", "E"}
    assert unnamed == [7]


def test_an_empty_switch_is_off_and_an_empty_number_keeps_its_default() -> None:
    flag = "DEEPWELL_ZERO_OVERHEAD_SCHEDULING"
    for text, expected in [("", False), ("0", False), ("false", False), ("False", False)]:
        assert environment.read(flag, {flag: text}) is expected
    for text in ["1", "true", "no", "off", "FALSE"]:
        assert environment.read(flag, {flag: text}) is True
    assert environment.read(flag, {}) is None
    assert (
        environment.read("DEEPWELL_LOGGING_INTERVAL_STEP", {"DEEPWELL_LOGGING_INTERVAL_STEP": ""})
        is None
    )
