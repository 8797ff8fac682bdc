"""Fixtures for structured output: the tiny random Llama with a byte-level tokenizer."""

from pathlib import Path

import llguidance
import pytest

from deepwell.engine import EngineArgs, EngineCore

from ..tiny_llama import TINY_CONFIG, write_tiny_llama
from .tiny_tokenizer import EOS_ID, tiny_tokenizer


def heavy_schema(num_fields: int = 5000) -> dict:
    """A schema whose grammar takes about a second to compile (measured 1.07 s)."""
    names = [f"field_{i}" for i in range(num_fields)]
    return {
        "type": "object",
        "properties": {
            name: {"type": "string", "pattern": f"^[a-z]{{2,8}}{i}[0-9]{{1,4}}(-[A-Z]{{3}})?$"}
            for i, name in enumerate(names)
        },
        "required": names,
    }


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tokenizer"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def grammar_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(
        tiny_tokenizer().to_str(), n_vocab=TINY_CONFIG["vocab_size"], eos_token=EOS_ID
    )


@pytest.fixture
def make_core(tiny_llama_with_tokenizer):
    def make(**kwargs) -> EngineCore:
        kwargs = {"dtype": "float32", "block_size": 16, "memory_gib": 0.25} | kwargs
        return EngineCore(EngineArgs(model=str(tiny_llama_with_tokenizer), **kwargs))

    return make
