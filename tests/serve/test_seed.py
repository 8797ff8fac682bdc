"""Sampling seeds through the API: Chat's `seed`, the x-deepwell-seed request header for the
other dialects, the seed reported back in the x-deepwell-seed response header, and replay."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from servers import MODEL_ARGS, start_server
from test_api import CHAT_NO_THINKING, MESSAGES_BODY, RESPONSES_BODY, call

from deepwell.recipe import InferenceChunk, InferenceFinishReason
from deepwell.serve.api import create_app

SEED = "x-deepwell-seed"


def recording_app():
    """An app whose inference source records the seed each request reached it with."""
    seen: list[int] = []

    async def infer(request):
        seen.append(request.sampling.seed)
        yield InferenceChunk.ready()
        yield InferenceChunk.text("ok", 1)
        yield InferenceChunk.finish(InferenceFinishReason.Stop)

    return create_app(infer=infer), seen


def test_chat_seed_is_the_requests_seed_and_is_reported_back():
    app, seen = recording_app()
    for stream in (False, True):
        body = {**CHAT_NO_THINKING, "seed": 2**63 - 1, "stream": stream}
        response = call(app, "POST", "/v1/chat/completions", json=body)
        assert response.status_code == 200
        assert response.headers[SEED] == str(2**63 - 1)
    assert seen == [2**63 - 1] * 2


def test_chat_seed_wins_over_the_header():
    app, seen = recording_app()
    body = {**CHAT_NO_THINKING, "seed": 5}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers={SEED: "9"})
    assert response.headers[SEED] == "5" and seen == [5]


def test_without_a_seed_a_random_one_is_drawn_and_reported():
    app, seen = recording_app()
    headers = [
        call(app, "POST", "/v1/chat/completions", json=CHAT_NO_THINKING).headers[SEED]
        for _ in range(3)
    ]
    assert [int(h) for h in headers] == seen
    assert len(set(seen)) == 3 and all(0 <= s < 2**63 for s in seen)


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/responses", RESPONSES_BODY), ("/v1/messages", MESSAGES_BODY)]
)
def test_dialects_without_a_seed_field_take_the_header(path, body):
    app, seen = recording_app()
    response = call(app, "POST", path, json=body, headers={SEED: "123"})
    assert response.status_code == 200, response.text
    assert response.headers[SEED] == "123" and seen == [123]
    drawn = call(app, "POST", path, json=body)
    assert int(drawn.headers[SEED]) == seen[1]


@pytest.mark.parametrize("value", ["-1", "abc", str(2**63), "1.5"])
def test_a_bad_seed_header_is_a_400(value):
    app, seen = recording_app()
    response = call(
        app, "POST", "/v1/chat/completions", json=CHAT_NO_THINKING, headers={SEED: value}
    )
    assert response.status_code == 400 and SEED in response.json()["error"]["message"]
    assert seen == []


@pytest.fixture(scope="module")
def invariant_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("seed"), *MODEL_ARGS, "--batch-invariant")
    yield server
    assert server.stop() == 0


def sample(server, **extra) -> httpx.Response:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12,
        "temperature": 1.0,
        **extra,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response


def test_a_sampled_reply_replays_from_its_seed_on_a_real_model(invariant_server):
    first = sample(invariant_server, seed=42)
    assert first.headers[SEED] == "42"
    again = sample(invariant_server, seed=42)
    assert again.json()["choices"] == first.json()["choices"]
    drawn = sample(invariant_server)
    replay = sample(invariant_server, seed=int(drawn.headers[SEED]))
    assert replay.json()["choices"] == drawn.json()["choices"]


def test_deepinfers_seq_seed_replays_a_constrained_reply(invariant_server):
    so_args = {"schema_type": "regex", "schema": "[a-z]{3,6}"}
    first = sample(invariant_server, seq_seed=2**64 - 3, so_args=so_args)
    again = sample(invariant_server, seq_seed=2**64 - 3, so_args=so_args)
    assert again.json()["choices"] == first.json()["choices"]
    text = first.json()["choices"][0]["message"]["content"]
    assert 3 <= len(text) <= 6 and text.isalpha() and text.islower()


def test_seeded_parallel_samples_repeat_streamed_or_not(invariant_server):
    # Cached first, so that every sample below reads the prompt from the prefix cache.
    prompt = "Name a colour, then say why you like it. " * 30
    sample(invariant_server, seed=1, messages=[{"role": "user", "content": prompt}])
    extra = {"seed": 42, "n": 3, "messages": [{"role": "user", "content": prompt}]}
    first = sample(invariant_server, **extra).json()
    again = sample(invariant_server, **extra).json()
    texts = [choice["message"]["content"] for choice in first["choices"]]
    assert [choice["index"] for choice in first["choices"]] == [0, 1, 2]
    assert [choice["message"]["content"] for choice in again["choices"]] == texts
    assert len(set(texts)) > 1  # each sample draws with its own seed

    streamed = {index: "" for index in range(3)}
    body = {"model": invariant_server.model, "max_tokens": 12, "temperature": 1.0, **extra}
    with httpx.stream(
        "POST",
        f"{invariant_server.base_url}/v1/chat/completions",
        json={**body, "stream": True},
        timeout=300,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert [streamed[index] for index in range(3)] == texts


def test_best_of_keeps_the_n_candidates_with_the_highest_cumulative_logprob(invariant_server):
    """best_of's candidates are the seeded samples `n` gives; comparing the two requests needs
    a batch-invariant server, where a candidate's tokens do not depend on how its steps were
    batched (the two requests' prefills and decodes may land in different steps)."""
    client = openai.OpenAI(base_url=f"{invariant_server.base_url}/v1", api_key="none")
    model = invariant_server.model
    fields = {"max_tokens": 12, "temperature": 1.0, "seed": 11}
    fields |= {"prompt": "The capital of France is", "logprobs": 0}
    candidates = client.completions.create(model=model, n=4, **fields)
    best = client.completions.create(model=model, n=2, best_of=4, **fields)
    scored = sorted(
        ((sum(c.logprobs.token_logprobs), c.text) for c in candidates.choices), reverse=True
    )
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [text for _, text in scored[:2]]
    # Every candidate was generated: their tokens are the usage, the prompt once.
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
    assert best.usage.prompt_tokens == candidates.usage.prompt_tokens
    # Without logprobs asked, the choice is the same and no logprobs are shown.
    quiet_fields = {key: value for key, value in fields.items() if key != "logprobs"}
    quiet = client.completions.create(model=model, n=2, best_of=4, **quiet_fields)
    assert [c.text for c in quiet.choices] == [c.text for c in best.choices]
    assert all(c.logprobs is None for c in quiet.choices)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, n=1, best_of=2, stream=True, **fields)
    assert refused.value.body["param"] == "best_of"
