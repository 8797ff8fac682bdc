"""Real `deepwell serve` processes shared by the whole session: one mock, one with the
embedded model, and one with a tiny random DeepSeek-V4.1 checkpoint."""

from __future__ import annotations

import pytest
from servers import MODEL_ARGS, V41_ARGS, start_server, write_v41_checkpoint


@pytest.fixture(scope="session")
def mock_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("mock"), "--mock")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def model_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("model"), *MODEL_ARGS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session", params=["mock", "model"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def v41_server(tmp_path_factory):
    checkpoint = write_v41_checkpoint(tmp_path_factory.mktemp("v41"))
    server = start_server(checkpoint.parent, "--model", str(checkpoint), *V41_ARGS)
    yield server
    assert server.stop() == 0
