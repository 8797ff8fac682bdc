"""Real `deepwell serve` processes shared by the whole session: one mock, one with the model."""

from __future__ import annotations

import pytest
from servers import MODEL_ARGS, start_server


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
