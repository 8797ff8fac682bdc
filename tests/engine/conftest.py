"""Shared engine fixtures."""

import os
from pathlib import Path

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore

from .structured.tiny_tokenizer import tiny_tokenizer
from .tiny_llama import write_tiny_llama

# The test machine's 2 cores are shared: with 2 threads, a busy neighbour stalls every
# parallel region (measured 50x slower matmuls); one thread degrades gracefully.
torch.set_num_threads(1)
# Without a GPU, Triton's interpreter runs the Triton kernel set on CPU tensors; Triton reads
# this when a kernel is defined, so before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory) -> Path:
    """The tiny Llama with a byte-level tokenizer, for grammars and text."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tokenizer"))
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def make_core(tiny_llama):
    """Build an EngineCore on the tiny model; keyword arguments are EngineArgs fields."""

    def make(**kwargs) -> EngineCore:
        kwargs = {"dtype": "float32", "block_size": 16, "memory_gib": 0.25} | kwargs
        return EngineCore(EngineArgs(model=str(tiny_llama), **kwargs))

    return make
