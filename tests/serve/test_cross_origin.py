"""CORS: a preflight from an allowed origin gets the CORS headers; other origins, and every
origin on a server without --allowed-origins, get none."""

from __future__ import annotations

import httpx
import pytest
from servers import start_server

ALLOWED = "https://app.example.com"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def _cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("cors"), "--mock", "--allowed-origins", ALLOWED, "--api-key", "k"
    )
    yield server
    assert server.stop() == 0


def test_a_preflight_from_an_allowed_origin_gets_the_cors_headers(cors_server):
    url = f"{cors_server.base_url}/v1/chat/completions"
    response = httpx.options(url, headers={"Origin": ALLOWED, **PREFLIGHT})
    assert response.status_code == 200
    headers = _cors_headers(response)
    assert headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    answer = httpx.post(
        url,
        json={"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Hi"}]},
        headers={"Origin": ALLOWED, "Authorization": "Bearer k"},
    )
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in answer.headers["access-control-expose-headers"]


def test_other_origins_get_no_cors_headers(cors_server, mock_server):
    for server, origin in ((cors_server, "https://elsewhere.example.com"), (mock_server, ALLOWED)):
        response = httpx.options(
            f"{server.base_url}/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT}
        )
        assert response.status_code == 405
        assert _cors_headers(response) == {}
