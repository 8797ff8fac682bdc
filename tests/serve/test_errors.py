"""Internal failures answer 500 with a request id the log shares, never the exception's text;
bad input keeps its 400. Checked through the official OpenAI and Anthropic SDKs in-process."""

from __future__ import annotations

import asyncio
import json
import logging

import anthropic
import httpx
import httpx2
import openai
import pytest

from deepwell.serve.api import create_app
from deepwell.serve.frontend import Frontend
from deepwell.serve.settings import ServeSettings

MODEL = "DeepSeek-V4.1-Flash"
# What the injected bug says: internals a client must never see.
SECRET = "internal detail /srv/secret.py"
FAIL_ON = "please fail"


@pytest.fixture
def failing_frontend(monkeypatch):
    """Fault injection: preparing a request that says FAIL_ON raises, as a bug in our code
    would; every other request runs as usual."""
    prepare = Frontend.prepare

    def failing_prepare(self, route, body, *args):
        if FAIL_ON.encode() in body:
            raise RuntimeError(SECRET)
        return prepare(self, route, body, *args)

    monkeypatch.setattr(Frontend, "prepare", failing_prepare)


def sdk_clients(app) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    """Both SDKs talking to `app` in-process (the anthropic SDK is built on httpx2)."""
    options = {"api_key": "unused", "max_retries": 0}
    openai_http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    anthropic_http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    return (
        openai.AsyncOpenAI(base_url="http://test/v1", http_client=openai_http, **options),
        anthropic.AsyncAnthropic(base_url="http://test", http_client=anthropic_http, **options),
    )


def chat(client: openai.AsyncOpenAI, text: str, **fields):
    fields.setdefault("model", MODEL)
    return client.chat.completions.create(messages=[{"role": "user", "content": text}], **fields)


def message(client: anthropic.AsyncAnthropic, text: str, **fields):
    fields.setdefault("model", MODEL)
    return client.messages.create(
        max_tokens=16, messages=[{"role": "user", "content": text}], **fields
    )


def logged_ids(caplog) -> dict[str, logging.LogRecord]:
    return {
        record.getMessage().split("request id ")[1].rstrip(")"): record
        for record in caplog.records
        if "request id" in record.getMessage()
    }


def check_logged(caplog, request_id: str) -> None:
    record = logged_ids(caplog)[request_id]
    assert record.levelno == logging.ERROR
    # The traceback is in the log, with the exception's text the client never got.
    assert record.exc_info is not None
    assert SECRET in "".join(logging.Formatter().formatException(record.exc_info))


def test_an_internal_error_is_a_500_with_a_request_id_through_both_sdks(failing_frontend, caplog):
    openai_client, anthropic_client = sdk_clients(create_app())

    async def run():
        with pytest.raises(openai.InternalServerError) as openai_failure:
            await chat(openai_client, FAIL_ON)
        with pytest.raises(anthropic.InternalServerError) as anthropic_failure:
            await message(anthropic_client, FAIL_ON)
        # The server keeps serving.
        served = await chat(openai_client, "Hi"), await message(anthropic_client, "Hi")
        return openai_failure.value, anthropic_failure.value, served

    with caplog.at_level(logging.ERROR):
        openai_error, anthropic_error, (completion, reply) = asyncio.run(run())

    assert openai_error.status_code == 500
    assert openai_error.request_id.startswith("req_")
    assert openai_error.body["type"] == "internal_error"
    assert openai_error.request_id in openai_error.body["message"]
    assert SECRET not in json.dumps(openai_error.body)
    check_logged(caplog, openai_error.request_id)

    assert anthropic_error.status_code == 500
    assert anthropic_error.request_id.startswith("req_")
    error = anthropic_error.body["error"]
    assert anthropic_error.body["type"] == "error" and error["type"] == "api_error"
    assert anthropic_error.request_id in error["message"]
    assert SECRET not in json.dumps(anthropic_error.body)
    check_logged(caplog, anthropic_error.request_id)

    assert openai_error.request_id != anthropic_error.request_id
    assert completion.choices[0].message.content == "Hello world!"
    assert reply.content[-1].text == "Hello world!"


def test_bad_input_stays_a_400_through_both_sdks(failing_frontend):
    openai_client, anthropic_client = sdk_clients(create_app())

    async def run():
        with pytest.raises(openai.BadRequestError) as unknown_model:
            await chat(openai_client, "Hi", model="gpt-9")
        with pytest.raises(openai.BadRequestError) as too_many_tokens:
            await chat(openai_client, "Hi", max_tokens=10**9)
        with pytest.raises(anthropic.BadRequestError) as anthropic_unknown:
            await message(anthropic_client, "Hi", model="gpt-9")
        return unknown_model.value, too_many_tokens.value, anthropic_unknown.value

    unknown_model, too_many_tokens, anthropic_unknown = asyncio.run(run())
    assert "you passed gpt-9" in unknown_model.body["message"]
    assert unknown_model.body["type"] == "invalid_request_error"
    assert "max_tokens" in too_many_tokens.body["message"]
    assert anthropic_unknown.body["error"]["type"] == "invalid_request_error"
    assert "you passed gpt-9" in anthropic_unknown.body["error"]["message"]


UNREADABLE_BODIES = [
    b'{"model": "m", "max_tokens": 1, "messages": ' + b"[" * 200 + b"]" * 200 + b"}",  # too deep
    b'{"model": "m", "messages": [], "max_tokens": 1' + b"0" * 30 + b"}",  # beyond i64/u64
]


@pytest.mark.parametrize("body", UNREADABLE_BODIES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages/count_tokens"])
def test_an_unreadable_body_is_a_400_not_a_500(path, body):
    # count_tokens hands the recipe a parsed object, where depth and range are checked apart.
    async def run():
        transport = httpx.ASGITransport(app=create_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=body)

    response = asyncio.run(run())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"


def test_a_bug_mid_stream_ends_it_with_an_error_event_carrying_a_request_id(monkeypatch, caplog):
    async def broken_events(self, prepared, timer):
        raise RuntimeError(SECRET)
        yield  # makes this an async generator, as `events` is

    monkeypatch.setattr(Frontend, "events", broken_events)

    async def run():
        transport = httpx.ASGITransport(app=create_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            return await client.post("/v1/chat/completions", json={**body, "stream": True})

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(run())
    assert response.status_code == 200  # the stream had started
    assert SECRET not in response.text
    frame = json.loads(response.text.strip().split("data: ")[-1])
    assert frame["error"]["type"] == "internal_error"
    (request_id,) = logged_ids(caplog)
    assert request_id in frame["error"]["message"]
    check_logged(caplog, request_id)


def ask(
    method: str,
    path: str,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    app=None,
) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app or create_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/no-such-route", 404),
        ("POST", "/v1/chat/completion", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models/" + MODEL, 405),
        ("POST", "/v1/models/" + MODEL, 405),
    ],
)
def test_an_unrouted_request_on_an_openai_path_answers_openais_shape(method, path, status):
    response = ask(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert path in error["message"]
    assert error["type"] == "invalid_request_error"
    if status == 405:
        assert method in error["message"]
        assert "GET" in response.headers["allow"] or "POST" in response.headers["allow"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/messages", 405), ("POST", "/v1/messages/nothing", 404)],
)
def test_an_unrouted_request_on_a_messages_path_answers_anthropics_shape(method, path, status):
    response = ask(method, path)
    assert response.status_code == status
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    assert path in body["error"]["message"]


def test_an_unknown_route_is_a_not_found_error_through_the_openai_sdk():
    openai_client, _ = sdk_clients(create_app())

    async def run():
        with pytest.raises(openai.NotFoundError) as missing:
            await openai_client.get("/no-such-route", cast_to=object)
        return missing.value

    assert "/v1/no-such-route" in asyncio.run(run()).body["message"]


# Every route that reads a JSON body, with a body it would accept.
JSON_ROUTES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": MODEL, "input": "Hi"},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi"},
    "/tokenize": {"model": MODEL, "prompt": "Hi"},
    "/detokenize": {"model": MODEL, "tokens": [1]},
    "/v1/render": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}
NOT_JSON = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


def check_dialect_error(response: httpx.Response, path: str, status: int) -> str:
    assert response.status_code == status, (path, response.text)
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_every_json_route_refuses_other_media_types_and_oversized_bodies_in_its_shape(path):
    body = json.dumps(JSON_ROUTES[path]).encode()
    for media_type in NOT_JSON:
        response = ask("POST", path, body, {"content-type": media_type})
        message = check_dialect_error(response, path, 415)
        assert media_type in message and "application/json" in message
    # A JSON type with parameters, or a +json type, is JSON; the refusal is not about it.
    for media_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = ask("POST", path, body, {"content-type": media_type})
        assert response.status_code != 415, (path, media_type)
    small = create_app(settings=ServeSettings(max_body_bytes=len(body) - 1))
    response = ask("POST", path, body, {"content-type": "application/json"}, small)
    assert "bytes" in check_dialect_error(response, path, 413)
