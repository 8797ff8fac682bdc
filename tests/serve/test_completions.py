"""`/v1/completions`, `/tokenize`, `/detokenize`, `/v1/models/{id}` and `/version` against a
real server on the embedded model, through the openai SDK where it has the call."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tests.serve.test_parallel_samples import BLOCK_SIZE, HITS, metric

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(model_server):
    return openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused", max_retries=0)


def tokenize(model_server, text: str) -> list[int]:
    return httpx.post(f"{model_server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]


def detokenize(model_server, tokens: list[int]) -> str:
    return httpx.post(f"{model_server.base_url}/detokenize", json={"tokens": tokens}).json()[
        "prompt"
    ]


def test_a_completion_continues_the_raw_prompt(client, model_server):
    completion = client.completions.create(
        model=model_server.model, prompt=PROMPT, max_tokens=6, temperature=0
    )
    (choice,) = completion.choices
    assert "Paris" in choice.text
    assert completion.object == "text_completion"
    assert completion.usage.prompt_tokens == len(tokenize(model_server, PROMPT))
    assert completion.usage.completion_tokens == 6 and choice.finish_reason == "length"


def test_streamed_text_equals_the_whole_completion_for_each_prompt(client, model_server):
    prompts = [PROMPT, "One, two, three,"]
    whole = client.completions.create(
        model=model_server.model, prompt=prompts, max_tokens=8, temperature=0
    )
    stream = client.completions.create(
        model=model_server.model,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = ["", ""], [None, None], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunk.usage or usage
    by_index = sorted(whole.choices, key=lambda c: c.index)
    assert texts == [c.text for c in by_index]
    assert finishes == [c.finish_reason for c in by_index]
    assert usage.completion_tokens == whole.usage.completion_tokens == 16


def test_token_id_prompts_echo_and_stop_strings(client, model_server):
    ids = tokenize(model_server, PROMPT)
    by_ids = client.completions.create(
        model=model_server.model, prompt=ids, max_tokens=6, temperature=0
    )
    by_text = client.completions.create(
        model=model_server.model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text
    word = by_ids.choices[0].text.split()[1]
    stopped = client.completions.create(
        model=model_server.model, prompt=ids, max_tokens=6, temperature=0, stop=[word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == by_ids.choices[0].text.split(word)[0]


def test_a_streamed_stop_string_ends_the_text_as_the_whole_completion_does(client, model_server):
    whole = client.completions.create(
        model=model_server.model, prompt=PROMPT, max_tokens=8, temperature=0
    )
    word = whole.choices[0].text.split()[2]
    request = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": [word]}
    stopped = client.completions.create(model=model_server.model, **request)
    stream = client.completions.create(model=model_server.model, stream=True, **request)
    chunks = [choice for chunk in stream for choice in chunk.choices]
    assert "".join(c.text for c in chunks) == stopped.choices[0].text
    assert stopped.choices[0].text == whole.choices[0].text.split(word)[0]
    assert chunks[-1].finish_reason == stopped.choices[0].finish_reason == "stop"


def test_a_stop_token_is_counted_but_not_shown(client, model_server):
    whole = client.completions.create(
        model=model_server.model, prompt=PROMPT, max_tokens=6, temperature=0
    )
    ids = tokenize(model_server, whole.choices[0].text)
    stopped = client.completions.create(
        model=model_server.model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [ids[2]]},
    )
    (choice,) = stopped.choices
    assert choice.finish_reason == "stop"
    assert whole.choices[0].text.startswith(choice.text) and len(choice.text) < len(
        whole.choices[0].text
    )
    # The stop id is sampled output: usage counts it, the text leaves it out.
    assert stopped.usage.completion_tokens == len(tokenize(model_server, choice.text)) + 1


def test_logprobs_name_each_token_with_its_alternatives(client, model_server):
    completion = client.completions.create(
        model=model_server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        # Greedy: the chosen token is the most likely of its alternatives.
        assert len(top) == 3 and max(top, key=top.get) == token
    assert logprobs.text_offset[0] == 0


def test_prompt_logprobs_score_every_prompt_token_after_the_first(client, model_server):
    prompt_ids = tokenize(model_server, PROMPT)
    for stream in (False, True):
        response = client.completions.create(
            model=model_server.model,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            stream=stream,
            extra_body={"prompt_logprobs": 2, "golden_token_ids": prompt_ids[:2]},
        )
        chunks = list(response) if stream else [response]
        found = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks]
        (scored,) = [f for f in found if f is not None]
        assert scored[0] is None and len(scored) == len(prompt_ids)
        for token, entry in zip(prompt_ids[1:], scored[1:], strict=True):
            # The prompt token itself and its two best alternatives (which may include it).
            assert str(token) in entry and 2 <= len(entry) <= 3
            assert all(value["logprob"] <= 0 for value in entry.values())
        # Teacher forcing: the first output tokens are the golden ones.
        text = "".join(c.choices[0].text for c in chunks)
        assert text.startswith(detokenize(model_server, prompt_ids[:2]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "!"),
        ("n", 0),
        ("n", 129),
        ("best_of", 0),
        ("echo", True),
        ("prompt", []),
        ("stop", ""),
    ],
)
def test_unsupported_or_bad_fields_get_a_400_naming_them(client, model_server, field, value):
    fields = {"prompt": PROMPT, "max_tokens": 2, field: value}
    if field == "echo":
        fields["logprobs"] = 1
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model_server.model, **fields)
    assert field in error.value.body["message"] and error.value.body["param"] == field


SAMPLED = {"max_tokens": 12, "temperature": 1.0, "seed": 11}


def test_n_samples_per_prompt_are_indexed_seeded_and_count_each_prompt_once(client, model_server):
    prompts = [PROMPT, "One, two, three,"]
    first = client.completions.create(model=model_server.model, prompt=prompts, n=3, **SAMPLED)
    again = client.completions.create(model=model_server.model, prompt=prompts, n=3, **SAMPLED)
    assert [c.index for c in first.choices] == list(range(6))
    texts = [c.text for c in first.choices]
    # Seeded samples repeat; each sample its own seed, so they differ from each other.
    assert texts == [c.text for c in again.choices]
    assert len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1
    prompt_tokens = sum(len(tokenize(model_server, p)) for p in prompts)
    assert first.usage.prompt_tokens == prompt_tokens
    assert 6 <= first.usage.completion_tokens <= 6 * SAMPLED["max_tokens"]

    stream = client.completions.create(
        model=model_server.model,
        prompt=prompts,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    streamed, usage = [""] * 6, None
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
        usage = chunk.usage or usage
    assert streamed == texts
    assert usage.prompt_tokens == prompt_tokens


def test_samples_of_a_prompt_share_its_kv_blocks(client, model_server):
    # A prompt no earlier test sent, long enough for full KV blocks.
    prompt = f"A short fact about the number {uuid.uuid4().int % 10**12}. " * 40
    hits_before = metric(model_server.base_url, HITS)
    completion = client.completions.create(
        model=model_server.model, prompt=prompt, n=3, max_tokens=2, seed=3
    )
    # Samples 1 and 2 read the prompt's full blocks from the cache (counted as they arrive
    # with the workers' heartbeats).
    full_blocks = completion.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.monotonic() + 10
    gained = 0.0
    while gained < 2 * full_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
        gained = metric(model_server.base_url, HITS) - hits_before
    assert gained == 2 * full_blocks > 0


def test_an_unknown_model_is_a_404_in_openai_shape(client, model_server):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt=PROMPT)
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_models_say_their_context_length(client, model_server):
    model = client.models.retrieve(model_server.model)
    assert model.id == model_server.model
    assert model.max_model_len == client.models.list().data[0].max_model_len > 0


def test_tokenize_and_detokenize_round_trip(model_server):
    text = "Hello, world! Ça va? 你好"
    base = model_server.base_url
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert len(tokens["token_strs"]) == tokens["count"]
    back = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(
        f"{base}/tokenize", json={"messages": [{"role": "user", "content": text}]}
    ).json()
    assert chat["count"] > tokens["count"]  # the chat encoding wraps the message
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
def test_a_lone_surrogate_escape_is_a_400_not_an_unencodable_answer(model_server, path):
    # The error for an unknown model quotes it: a lone surrogate there once made a 500.
    body = b'{"model": "\\ud800x", "prompt": "Hi", "tokens": [1], "max_tokens": 1}'
    response = httpx.post(f"{model_server.base_url}{path}", content=body)
    assert response.status_code == 400, response.text
    assert "hex escape" in response.json()["error"]["message"]


def test_version(model_server):
    import deepwell

    assert httpx.get(f"{model_server.base_url}/version").json() == {"version": deepwell.__version__}


def test_the_mock_server_refuses_what_needs_a_model(mock_server):
    base = mock_server.base_url
    body = {"model": mock_server.model, "prompt": PROMPT}
    response = httpx.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 400 and "needs a model" in response.json()["error"]["message"]
    response = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT})
    assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
