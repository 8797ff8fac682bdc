"""Tiny random Qwen models served for real with their chat templates, driven with the SDKs.

The weights are noise: forced tool calls (kept on track by the Hermes grammar) must come
back parsed in all three dialects, streamed or not, and a Llama-3 JSON call through Chat; a
template that fails or probes outside its sandbox is a 400; one that does not compile
stops `serve` before it loads anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from servers import DEEPWELL, REPO, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.models.tiny_qwen import HERMES_TEMPLATE, write_tiny_qwen  # noqa: E402

QUESTION = "What is the weather in Paris?"
CALL_TOKENS = 300
# Bounded values only, so a random model cannot wander off inside one.
TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Zürich", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "metric": {"type": "boolean"},
        },
        "required": ["city", "days"],
    },
    "lookup": {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": 6}},
        "required": ["code"],
    },
}
NAMED = "lookup"
# The served template: Hermes, behind two traps a request can spring by its first message.
TRAPS = (
    "{%- if messages[0].content == 'RAISE' %}{{ raise_exception('RAISE is not allowed') }}"
    "{%- endif %}"
    "{%- if messages[0].content == 'ESCAPE' %}{{ ''.__class__.__mro__[1].__subclasses__() }}"
    "{%- endif %}"
    # A variable only a request's chat_template_kwargs sets.
    "{%- if preamble is defined %}{{ preamble }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    # The checkpoint's own template has no tools; --chat-template replaces it.
    model = write_tiny_qwen(root / "tiny-qwen2", template="{{ messages[0].content }}")
    template = root / "hermes.jinja"
    template.write_text(TRAPS + HERMES_TEMPLATE)
    server = start_server(
        root,
        "--model",
        str(model),
        "--chat-template",
        str(template),
        "--tool-call-parser",
        "hermes",
        "--threads",
        "1",
        "--memory-gib",
        "0.5",
        "--max-model-len",
        "2048",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def openai_client(qwen_server):
    return openai.OpenAI(base_url=f"{qwen_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(qwen_server):
    return anthropic.Anthropic(base_url=qwen_server.base_url, api_key="unused", max_retries=0)


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    """At least one call, each of an allowed tool, with JSON arguments its schema accepts."""
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), TOOLS[name])


CHAT_CHOICES = {
    "required": ("required", set(TOOLS)),
    "named": ({"type": "function", "function": {"name": NAMED}}, {NAMED}),
}


@pytest.mark.parametrize("choice", CHAT_CHOICES)
def test_chat_forced_tool_calls_come_back_parsed(qwen_server, openai_client, choice):
    tool_choice, allowed = CHAT_CHOICES[choice]
    request = {
        "model": qwen_server.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"type": "function", "function": {"name": name, "parameters": parameters}}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": tool_choice,
        "max_tokens": CALL_TOKENS,
        "temperature": 0,
    }
    completion = openai_client.chat.completions.create(**request)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    check_calls(calls, allowed)

    streamed: dict[int, list[str]] = {}
    finish_reasons = []
    for chunk in openai_client.chat.completions.create(**request, stream=True):
        for streamed_choice in chunk.choices:
            for delta in streamed_choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            if streamed_choice.finish_reason:
                finish_reasons.append(streamed_choice.finish_reason)
    assert finish_reasons == ["tool_calls"]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


def test_responses_forced_tool_calls_come_back_as_function_calls(qwen_server, openai_client):
    request = {
        "model": qwen_server.model,
        "input": QUESTION,
        "tools": [
            {"type": "function", "name": name, "parameters": parameters}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": "required",
        "max_output_tokens": CALL_TOKENS,
        "temperature": 0,
    }
    response = openai_client.responses.create(**request)
    assert response.status == "completed"
    calls = [
        (item.name, item.arguments) for item in response.output if item.type == "function_call"
    ]
    check_calls(calls, set(TOOLS))

    deltas: dict[str, str] = {}
    done: dict[str, str] = {}
    final = None
    for event in openai_client.responses.create(**request, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
        elif event.type == "response.function_call_arguments.done":
            done[event.item_id] = event.arguments
        elif event.type == "response.completed":
            final = event.response
    assert deltas == done
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls


def test_messages_forced_tool_use_comes_back_as_tool_use_blocks(qwen_server, anthropic_client):
    request = {
        "model": qwen_server.model,
        "max_tokens": CALL_TOKENS,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"name": name, "description": "", "input_schema": parameters}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": {"type": "tool", "name": NAMED},
        "extra_body": {"temperature": 0},
    }
    message = anthropic_client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    uses = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    check_calls([(name, json.dumps(arguments)) for name, arguments in uses], {NAMED})

    partial: dict[int, str] = {}
    with anthropic_client.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [json.loads(partial[i]) for i in sorted(partial)] == [arguments for _, arguments in uses]
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == uses


def test_tool_call_history_is_rendered_into_the_prompt(qwen_server, openai_client):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": TOOLS["lookup"]}}]
    ask = {"role": "user", "content": QUESTION}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"code": "PAR"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}

    def prompt_tokens(messages: list[dict]) -> int:
        completion = openai_client.chat.completions.create(
            model=qwen_server.model, messages=messages, tools=tools, max_tokens=1
        )
        return completion.usage.prompt_tokens

    bare = prompt_tokens([ask])
    # '<tool_call>\n{"name": "lookup", "arguments": {"code": "PAR"}}\n</tool_call>' and the
    # '<tool_response>' turn are dozens of tokens; a dropped call would cost none.
    assert prompt_tokens([ask, call, result]) > bare + 30


def test_a_template_error_is_a_clear_400_in_each_dialect(
    qwen_server, openai_client, anthropic_client
):
    with pytest.raises(openai.BadRequestError, match="chat template error: RAISE is not allowed"):
        openai_client.chat.completions.create(
            model=qwen_server.model, messages=[{"role": "user", "content": "RAISE"}]
        )
    with pytest.raises(openai.BadRequestError, match="RAISE is not allowed"):
        openai_client.responses.create(model=qwen_server.model, input="RAISE")
    with pytest.raises(anthropic.BadRequestError, match="RAISE is not allowed"):
        anthropic_client.messages.create(
            model=qwen_server.model, max_tokens=8, messages=[{"role": "user", "content": "RAISE"}]
        )


def test_a_sandbox_escape_is_refused_and_the_server_keeps_serving(qwen_server, openai_client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="chat template refused: access to"):
            openai_client.chat.completions.create(
                model=qwen_server.model,
                messages=[{"role": "user", "content": "ESCAPE"}],
                stream=stream,
            )
    completion = openai_client.chat.completions.create(
        model=qwen_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_chat_template_kwargs_must_be_an_object(qwen_server):
    response = httpx.post(
        f"{qwen_server.base_url}/v1/chat/completions",
        json={
            "model": qwen_server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": ["enable_thinking"],
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "chat_template_kwargs must be an object."


def test_tokenize_renders_messages_with_the_requests_chat_template_kwargs(qwen_server):
    def tokenize(**extra) -> dict:
        body = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
        response = httpx.post(f"{qwen_server.base_url}/tokenize", json={**body, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    plain = tokenize()
    preamble = "Answer in French."
    with_kwargs = tokenize(chat_template_kwargs={"preamble": preamble})
    assert with_kwargs["count"] > plain["count"]
    assert "".join(with_kwargs["token_strs"]).startswith(preamble)
    assert "".join(with_kwargs["token_strs"]).endswith("".join(plain["token_strs"]))
    bad = httpx.post(
        f"{qwen_server.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "chat_template_kwargs must be an object."


def test_a_template_that_does_not_compile_stops_serve_before_loading(tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in messages %}{{ message.content }}")
    result = subprocess.run(
        [
            DEEPWELL,
            "serve",
            "--model",
            str(tmp_path / "never-read"),
            "--chat-template",
            str(template),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    assert "chat template line 1" in result.stderr


# A Llama-3.1-style tool prompt in ChatML turns (the tiny model's tokenizer is SmolLM2's).
LLAMA3_JSON_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if tools %}<|im_start|>system\nRespond with a JSON function call from:"
    "{%- for tool in tools %} {{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def llama3_json_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3_json")
    model = write_tiny_qwen(root / "tiny-qwen3", "Qwen3ForCausalLM", template=LLAMA3_JSON_TEMPLATE)
    server = start_server(
        root,
        "--model",
        str(model),
        "--tool-call-parser",
        "llama3_json",
        "--threads",
        "1",
        "--memory-gib",
        "0.5",
        "--max-model-len",
        "2048",
    )
    yield server
    assert server.stop() == 0


def test_llama3_json_forced_call_comes_back_parsed_streamed_or_not(llama3_json_server):
    client = openai.OpenAI(
        base_url=f"{llama3_json_server.base_url}/v1", api_key="unused", max_retries=0
    )
    request = {
        "model": llama3_json_server.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"type": "function", "function": {"name": name, "parameters": parameters}}
            for name, parameters in TOOLS.items()
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": CALL_TOKENS,
        "temperature": 0,
    }
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert len(calls) == 1
    check_calls(calls, {"get_weather"})
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            streamed[0] += delta.function.name or ""
            streamed[1] += delta.function.arguments or ""
    assert tuple(streamed) == calls[0]
