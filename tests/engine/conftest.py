"""Shared engine fixtures."""

from pathlib import Path

import pytest

from deepwell.engine import EngineArgs, EngineCore

from .tiny_llama import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def make_core(tiny_llama):
    """Build an EngineCore on the tiny model; keyword arguments are EngineArgs fields."""

    def make(**kwargs) -> EngineCore:
        kwargs = {"dtype": "float32", "block_size": 16, "memory_gib": 0.25} | kwargs
        return EngineCore(EngineArgs(model=str(tiny_llama), **kwargs))

    return make
