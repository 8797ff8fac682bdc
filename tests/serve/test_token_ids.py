"""vLLM's `return_token_ids` through the official OpenAI SDK on the embedded model: the
prompt's ids beside the choices and each choice's generated ids, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Name a colour."}]
ASK = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(model_server):
    return openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="-", max_retries=0)


def tokenized(server, **body) -> list[int]:
    reply = httpx.post(f"{server.base_url}/tokenize", json={"model": server.model, **body})
    return reply.json()["tokens"]


def detokenized(server, ids: list[int]) -> str:
    reply = httpx.post(f"{server.base_url}/detokenize", json={"model": server.model, "tokens": ids})
    return reply.json()["prompt"]


def test_chat_returns_the_prompt_and_output_ids(model_server, client):
    completion = client.chat.completions.create(
        model=model_server.model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=ASK
    )
    prompt_ids = completion.model_extra["prompt_token_ids"]
    assert prompt_ids == tokenized(model_server, messages=MESSAGES)
    assert len(prompt_ids) == completion.usage.prompt_tokens
    ids = completion.choices[0].model_extra["token_ids"]
    assert len(ids) == completion.usage.completion_tokens
    assert detokenized(model_server, ids) == completion.choices[0].message.content


def test_streamed_chat_returns_the_ids_chunk_by_chunk(model_server, client):
    chunks = list(
        client.chat.completions.create(
            model=model_server.model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body=ASK,
        )
    )
    assert chunks[0].model_extra["prompt_token_ids"] == tokenized(model_server, messages=MESSAGES)
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in chunks[1:])
    ids = [i for chunk in chunks for c in chunk.choices for i in c.model_extra["token_ids"]]
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert ids and detokenized(model_server, ids) == text


def test_chat_without_the_field_returns_no_ids(model_server, client):
    completion = client.chat.completions.create(
        model=model_server.model, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert "prompt_token_ids" not in (completion.model_extra or {})
    assert "token_ids" not in (completion.choices[0].model_extra or {})


def test_a_non_boolean_is_refused(model_server, client):
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        client.chat.completions.create(
            model=model_server.model,
            messages=MESSAGES,
            max_tokens=2,
            extra_body={"return_token_ids": 1},
        )


@pytest.mark.parametrize("stream", [False, True])
def test_completions_return_each_choices_ids(model_server, client, stream):
    prompts = ["The sky is", "Grass is"]
    reply = client.completions.create(
        model=model_server.model,
        prompt=prompts,
        max_tokens=6,
        temperature=0,
        stream=stream,
        extra_body=ASK,
    )
    chunks = list(reply) if stream else [reply]
    for index, prompt in enumerate(prompts):
        mine = [c for chunk in chunks for c in chunk.choices if c.index == index]
        firsts = [
            c.model_extra["prompt_token_ids"] for c in mine if "prompt_token_ids" in c.model_extra
        ]
        assert firsts == [tokenized(model_server, prompt=prompt)]
        ids = [i for c in mine for i in c.model_extra["token_ids"]]
        text = "".join(c.text for c in mine)
        # The ids include a stop id when the choice stopped on one (the text leaves it out).
        assert detokenized(model_server, ids).startswith(text) and len(ids) <= 6
