"""transformers' own reading of a GGUF file (the tests' reference for the embedded model), with
gguf's reader on a plain array and its tensor-name table built once: the same model, faster."""

import contextlib
import functools
from collections.abc import Iterator

import gguf
import pytest

from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader


@contextlib.contextmanager
def fast_gguf_reads() -> Iterator[None]:
    """transformers imports GGUFReader and get_tensor_name_map from gguf at each call. The
    plain-array reader parses the same fields (tests/engine/models/test_loader.py), and the
    name table is a pure function of (architecture, layers) that transformers rebuilt for each
    of its ~400 lookups: the embedded model's load took 11.5 CPU s, 2.4 s so."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", PlainArrayGGUFReader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
