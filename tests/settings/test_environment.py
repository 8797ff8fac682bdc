"""Every DEEPWELL_* variable deepwell reads is registered once and read through the registry."""

from __future__ import annotations

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
