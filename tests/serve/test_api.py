"""The HTTP app in-process: error shapes per dialect, auth, limits, SSE framing, metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deepwell.recipe import InferenceChunk, InferenceFinishReason
from deepwell.serve.api import create_app
from deepwell.serve.cluster.inference_errors import EngineUnavailable
from deepwell.serve.errors import internal_error_message
from deepwell.serve.model import ServedModel, mock_model
from deepwell.serve.settings import ServeSettings

MODEL = "DeepSeek-V4.1-Flash"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
# Custom sources below emit no `</think>`, so their text is content only without thinking.
CHAT_NO_THINKING = {**CHAT_BODY, "thinking": {"type": "disabled"}}
RESPONSES_BODY = {"model": MODEL, "input": "Hi"}
MESSAGES_BODY = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


def call(app, method, path, **kwargs) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def anthropic_error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for frame in text.split("\n\n"):
        if not frame:
            continue
        name = None
        data = None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((name, data))
    return events


def test_mock_reply_in_every_dialect():
    app = create_app()
    chat = call(app, "POST", "/v1/chat/completions", json=CHAT_BODY).json()
    assert chat["choices"][0]["message"]["content"] == "Hello world!"
    responses = call(app, "POST", "/v1/responses", json=RESPONSES_BODY).json()
    assert responses["output"][-1]["content"][0]["text"] == "Hello world!"
    messages = call(app, "POST", "/v1/messages", json=MESSAGES_BODY).json()
    assert [b["text"] for b in messages["content"] if b["type"] == "text"] == ["Hello world!"]


def test_streams_end_with_each_dialects_terminal_frame():
    app = create_app()
    chat = call(app, "POST", "/v1/chat/completions", json={**CHAT_BODY, "stream": True})
    assert chat.headers["content-type"].startswith("text/event-stream")
    assert sse_events(chat.text)[-1] == (None, "[DONE]")
    responses = call(app, "POST", "/v1/responses", json={**RESPONSES_BODY, "stream": True})
    names = [name for name, _ in sse_events(responses.text)]
    assert names[-1] == "response.completed" and None not in names
    messages = call(app, "POST", "/v1/messages", json={**MESSAGES_BODY, "stream": True})
    events = sse_events(messages.text)
    assert events[-1][0] == "message_stop"
    assert all(json.loads(data)["type"] == name for name, data in events)


def test_malformed_json_is_a_400_in_each_dialects_shape():
    app = create_app()
    error = openai_error(call(app, "POST", "/v1/chat/completions", content=b"{nope"), 400)
    assert error["message"].startswith("invalid JSON request")
    error = anthropic_error(call(app, "POST", "/v1/messages", content=b"{nope"), 400)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("invalid JSON request")


def test_unknown_model_returns_the_recipes_error():
    app = create_app()
    response = call(app, "POST", "/v1/chat/completions", json={**CHAT_BODY, "model": "gpt-9"})
    error = openai_error(response, 400)
    assert error["message"] == (
        "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, "
        "but you passed gpt-9."
    )
    # OpenAI routes return the recipe's body byte for byte.
    assert response.text == (
        '{"error":{"message":"' + error["message"] + '","type":"invalid_request_error",'
        '"param":null,"code":"invalid_request_error"}}'
    )
    response = call(app, "POST", "/v1/messages", json={**MESSAGES_BODY, "model": "gpt-9"})
    assert anthropic_error(response, 400)["message"] == error["message"]


def test_conversion_errors_keep_the_recipes_status_and_message():
    app = create_app()
    response = call(app, "POST", "/v1/responses", json={**RESPONSES_BODY, "temperature": 3})
    assert "valid range of temperature" in openai_error(response, 400)["message"]


def test_prompt_plus_max_tokens_beyond_the_context_is_refused():
    model = ServedModel(
        names=(MODEL,),
        conversion_options=mock_model().conversion_options,
        context_limit=100,
        encoder=lambda conversation: [7] * 50,
    )
    app = create_app(model=model)
    response = call(app, "POST", "/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 60})
    assert openai_error(response, 400)["message"] == (
        "This model's maximum context length is 100 tokens. However, you requested 110 "
        "tokens (50 in the messages, 60 in the completion). Please reduce the length of the "
        "messages or completion."
    )
    response = call(app, "POST", "/v1/messages", json={**MESSAGES_BODY, "max_tokens": 60})
    assert anthropic_error(response, 400)["message"].startswith(
        "This model's maximum context length is 100 tokens."
    )


def test_tools_are_refused_for_a_model_without_tool_support():
    model = ServedModel(
        names=(MODEL,),
        conversion_options=mock_model().conversion_options,
        context_limit=100,
        supports_tools=False,
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = call(
        create_app(model=model), "POST", "/v1/chat/completions", json={**CHAT_BODY, "tools": tools}
    )
    assert openai_error(response, 400)["message"] == f"The model {MODEL} does not support tools."


def test_a_body_over_the_limit_is_a_413():
    app = create_app(settings=ServeSettings(max_body_bytes=1000))
    big = {**CHAT_BODY, "messages": [{"role": "user", "content": "x" * 2000}]}
    error = openai_error(call(app, "POST", "/v1/chat/completions", json=big), 413)
    assert "1000 bytes" in error["message"]
    error = anthropic_error(call(app, "POST", "/v1/messages", json=big), 413)
    assert error["type"] == "request_too_large"


def test_api_keys_per_dialect():
    app = create_app(settings=ServeSettings(api_keys=("secret",)))
    error = openai_error(call(app, "POST", "/v1/chat/completions", json=CHAT_BODY), 401)
    assert error["code"] == "invalid_api_key"
    ok = call(
        app,
        "POST",
        "/v1/chat/completions",
        json=CHAT_BODY,
        headers={"Authorization": "Bearer secret"},
    )
    assert ok.status_code == 200
    wrong = call(app, "POST", "/v1/messages", json=MESSAGES_BODY, headers={"x-api-key": "nope"})
    assert anthropic_error(wrong, 401)["type"] == "authentication_error"
    ok = call(app, "POST", "/v1/messages", json=MESSAGES_BODY, headers={"x-api-key": "secret"})
    assert ok.status_code == 200
    # The OpenAI routes do not read the Anthropic header.
    response = call(
        app, "POST", "/v1/responses", json=RESPONSES_BODY, headers={"x-api-key": "secret"}
    )
    openai_error(response, 401)
    assert call(app, "GET", "/health").status_code == 200


def test_a_full_queue_is_a_429_with_retry_after():
    release = asyncio.Event()

    async def slow(request):
        yield InferenceChunk.ready()
        await release.wait()
        yield InferenceChunk.text("done", 1)
        yield InferenceChunk.finish(InferenceFinishReason.Stop)

    app = create_app(infer=slow, settings=ServeSettings(max_pending_requests=1))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            request = client.post("/v1/chat/completions", json=CHAT_NO_THINKING)
            first = asyncio.create_task(request)
            while "deepwell_requests_running 1.0" not in (await client.get("/metrics")).text:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/messages", json=MESSAGES_BODY)
            release.set()
            return await first, refused

    first, refused = asyncio.run(run())
    assert first.json()["choices"][0]["message"]["content"] == "done"
    assert anthropic_error(refused, 429)["type"] == "rate_limit_error"
    assert refused.headers["retry-after"] == "1"


def test_a_custom_inference_source_replaces_the_engine():
    async def french(request):
        yield InferenceChunk.ready()
        for piece in ("Bon", "jour"):
            yield InferenceChunk.text(piece, 1)
        yield InferenceChunk.finish(InferenceFinishReason.Length)

    app = create_app(infer=french)
    chat = call(app, "POST", "/v1/chat/completions", json=CHAT_NO_THINKING).json()
    assert chat["choices"][0]["message"]["content"] == "Bonjour"
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 2
    metrics = call(app, "GET", "/metrics").text
    assert "deepwell_generation_tokens_total 2.0" in metrics
    assert "deepwell_time_to_first_token_seconds_count 1.0" in metrics


def test_an_engine_failure_mid_stream_ends_with_an_error_event():
    async def failing(request):
        yield InferenceChunk.ready()
        yield InferenceChunk.text("Hel", 1)
        raise EngineUnavailable("engine worker 0 stopped: killed")

    app = create_app(infer=failing)
    response = call(app, "POST", "/v1/messages", json={**MESSAGES_BODY, "stream": True})
    name, data = sse_events(response.text)[-1]
    assert name == "error"
    assert json.loads(data)["error"]["message"] == "engine worker 0 stopped: killed"
    response = call(app, "POST", "/v1/chat/completions", json=CHAT_BODY)
    assert "killed" in openai_error(response, 503)["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
def test_read_only_routes_answer(path):
    assert call(create_app(), "GET", path).status_code == 200


def test_an_internal_error_is_a_500_in_the_routes_shape():
    def broken(conversation):
        raise KeyError("bug")

    model = ServedModel(
        names=(MODEL,),
        conversion_options=mock_model().conversion_options,
        context_limit=100,
        encoder=broken,
    )
    app = create_app(model=model, settings=ServeSettings(max_pending_requests=1))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = await client.post("/v1/messages", json=MESSAGES_BODY)
            return first, await client.post("/v1/chat/completions", json=CHAT_BODY)

    first, second = asyncio.run(run())
    error = anthropic_error(first, 500)
    request_id = first.headers["request-id"]
    assert first.headers["x-request-id"] == request_id
    assert error == {"type": "api_error", "message": internal_error_message(request_id)}
    assert "bug" not in first.text
    # The failed request gave its admission back: the next one is not refused with 429.
    assert openai_error(second, 500)["type"] == "internal_error"
