"""Fixtures for structured output: the tiny random Llama with a byte-level tokenizer."""

from pathlib import Path

import llguidance
import pytest

from deepwell.engine import EngineArgs, EngineCore

from ..tiny_llama import TINY_CONFIG, write_tiny_llama
from .tiny_tokenizer import EOS_ID, tiny_tokenizer


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
