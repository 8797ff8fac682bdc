"""Fixtures for structured output: cores on the tiny Llama with its byte-level tokenizer."""

import llguidance
import pytest

from deepwell.engine import EngineArgs, EngineCore

from ..tiny_llama import TINY_CONFIG
from .tiny_tokenizer import EOS_ID, tiny_tokenizer


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
