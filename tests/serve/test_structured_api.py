"""Structured output through the API with both SDKs, on a real server with the embedded model.

Chat `response_format`, Responses `text.format` and Messages `output_config.format`
(Anthropic structured outputs, a deepwell extension over the reference). The default run
checks the first 6 of the 50 schemas; `-m slow` checks all 50.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest
from structured_schemas import ENFORCED_KEYWORDS, SCHEMAS, UNENFORCED, WITH_UNENFORCED_KEYWORDS

from deepwell.serve.frontend import UNENFORCED_HEADER

MAX_TOKENS = 160
PROMPT = "Write one JSON object with made-up example values."
FAST = 6


@pytest.fixture(scope="module")
def openai_client(model_server):
    return openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(model_server):
    return anthropic.Anthropic(base_url=model_server.base_url, api_key="unused", max_retries=0)


def chat_json(client, model: str, index: int, schema: dict) -> str:
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"schema_{index}", "schema": schema},
        },
    )
    return completion.choices[0].message.content


def responses_json(client, model: str, index: int, schema: dict) -> str:
    response = client.responses.create(
        model=model,
        input=PROMPT,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        text={"format": {"type": "json_schema", "name": f"schema_{index}", "schema": schema}},
    )
    return response.output_text


def messages_json(client, model: str, index: int, schema: dict) -> str:
    message = client.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    return "".join(block.text for block in message.content if block.type == "text")


def check_schemas(model_server, openai_client, anthropic_client, indices: range) -> None:
    model = model_server.model
    jobs = []
    for index in indices:
        openai_call = chat_json if index % 2 == 0 else responses_json
        jobs.append((openai_call, openai_client, index))
        jobs.append((messages_json, anthropic_client, index))
    with ThreadPoolExecutor(16) as pool:
        futures = [
            (call.__name__, index, pool.submit(call, client, model, index, SCHEMAS[index]))
            for call, client, index in jobs
        ]
        for name, index, future in futures:
            text = future.result()
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[index])
            except (ValueError, jsonschema.ValidationError) as error:
                raise AssertionError(f"{name} schema {index}: {text!r}: {error}") from None


def test_outputs_validate_against_their_schemas(model_server, openai_client, anthropic_client):
    check_schemas(model_server, openai_client, anthropic_client, range(FAST))


@pytest.mark.slow
def test_all_fifty_schemas_validate(model_server, openai_client, anthropic_client):
    check_schemas(model_server, openai_client, anthropic_client, range(len(SCHEMAS)))


def test_json_object_output_parses(model_server, openai_client):
    # A prompt the 135M model answers in a short object: "Describe a cat as a json object"
    # nests {"looks_at_me": {...}} past any budget on AMX machines' bf16 numerics.
    completion = openai_client.chat.completions.create(
        model=model_server.model,
        messages=[
            {
                "role": "user",
                "content": "Give me a JSON object describing a cat, with its name and age.",
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_regex_output_matches(model_server, openai_client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    completion = openai_client.chat.completions.create(
        model=model_server.model,
        messages=[{"role": "user", "content": "Make up a phone number."}],
        max_tokens=20,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": pattern}},
    )
    assert re.fullmatch(pattern, completion.choices[0].message.content)


def test_streamed_output_validates(model_server, openai_client):
    schema = SCHEMAS[3]
    stream = openai_client.chat.completions.create(
        model=model_server.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_invalid_regex_is_a_400_in_openai_shape(model_server, openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=model_server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"response_format": {"type": "regex", "regex": "[a-z"}},
        )
    assert "unclosed character class" in caught.value.body["message"]


def test_invalid_schema_is_a_400_in_anthropic_shape(model_server, anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model=model_server.model,
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            output_config={"format": {"type": "json_schema", "schema": {"type": "nope"}}},
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_streamed_request_with_invalid_regex_is_a_400(model_server, openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=model_server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            extra_body={"response_format": {"type": "regex", "regex": "(unclosed"}},
        )
    assert "unclosed group" in caught.value.body["message"]


def raw_chat(client, model: str, schema: dict, strict: bool | None) -> tuple[str, dict]:
    json_schema = {"name": "s", "schema": schema}
    if strict is not None:
        json_schema["strict"] = strict
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": json_schema},
    )
    return raw.parse().choices[0].message.content, raw.headers


def raw_responses(client, model: str, schema: dict, strict: bool | None) -> tuple[str, dict]:
    fmt = {"type": "json_schema", "name": "s", "schema": schema}
    if strict is not None:
        fmt["strict"] = strict
    raw = client.responses.with_raw_response.create(
        model=model,
        input=PROMPT,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        text={"format": fmt},
    )
    return raw.parse().output_text, raw.headers


def raw_messages(client, model: str, schema: dict, strict: bool | None) -> tuple[str, dict]:
    raw = client.messages.with_raw_response.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    text = "".join(block.text for block in raw.parse().content if block.type == "text")
    return text, raw.headers


def run_dialects(model_server, openai_client, anthropic_client, schema, calls) -> list:
    clients = {raw_messages: anthropic_client}
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [
            (
                call.__name__,
                strict,
                pool.submit(
                    call, clients.get(call, openai_client), model_server.model, schema, strict
                ),
            )
            for call, strict in calls
        ]
        return [(name, strict, *future.result()) for name, strict, future in futures]


EVERY_DIALECT = [
    (raw_chat, None),
    (raw_chat, True),
    (raw_responses, None),
    (raw_responses, True),
    (raw_messages, None),
]


def test_every_enforced_keyword_holds_in_every_dialect(
    model_server, openai_client, anthropic_client
):
    # minItems, maxLength, const, exclusive bounds and $defs are among what strict
    # normalisation drops from the output constraint's text; the grammar keeps them.
    replies = run_dialects(
        model_server, openai_client, anthropic_client, ENFORCED_KEYWORDS, EVERY_DIALECT
    )
    for name, strict, text, headers in replies:
        try:
            jsonschema.validate(json.loads(text), ENFORCED_KEYWORDS)
        except (ValueError, jsonschema.ValidationError) as error:
            raise AssertionError(f"{name} strict={strict}: {text!r}: {error}") from None
        assert UNENFORCED_HEADER not in headers


def test_keywords_the_grammar_cannot_enforce_are_named_not_promised(
    model_server, openai_client, anthropic_client
):
    # Strict normalisation refuses format uri-reference, so Chat and Responses go non-strict.
    calls = [(raw_chat, None), (raw_responses, None), (raw_messages, None)]
    replies = run_dialects(
        model_server, openai_client, anthropic_client, WITH_UNENFORCED_KEYWORDS, calls
    )
    enforced_part = json.loads(json.dumps(WITH_UNENFORCED_KEYWORDS))
    del enforced_part["properties"]["ids"]["uniqueItems"]
    for name, _, text, headers in replies:
        assert headers[UNENFORCED_HEADER].split(", ") == UNENFORCED, name
        try:
            jsonschema.validate(json.loads(text), enforced_part)
        except (ValueError, jsonschema.ValidationError) as error:
            raise AssertionError(f"{name}: {text!r}: {error}") from None


def test_a_streamed_response_names_unenforced_keywords_too(model_server, openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=model_server.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": WITH_UNENFORCED_KEYWORDS},
        },
    )
    assert raw.headers[UNENFORCED_HEADER].split(", ") == UNENFORCED
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert json.loads(text)["ids"]
