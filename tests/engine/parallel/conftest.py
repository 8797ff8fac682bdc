"""The tiny DeepSeek-V4.1 checkpoint the context-parallel tests run on."""

import pytest

from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path
