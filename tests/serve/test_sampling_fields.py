"""Every sampling field through the official SDKs against a real server on the embedded
model: its effect on a greedy continuation, or a 400 that names it."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.recipe import InferenceOptions
from deepwell.serve.errors import ApiError
from deepwell.serve.sampling_fields import read_sampling_params

# SmolLM2 answers this greedily with "Cat, cat, cat, ..." to the end of its budget.
REPEATS = "Write the word 'cat' ten times."


@pytest.fixture(scope="module")
def client(model_server):
    return openai.OpenAI(base_url=f"{model_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(model_server):
    return anthropic.Anthropic(base_url=model_server.base_url, api_key="unused", max_retries=0)


def chat(client, model_server, max_tokens=24, **fields):
    completion = client.chat.completions.create(
        model=model_server.model,
        messages=[{"role": "user", "content": REPEATS}],
        temperature=0,
        max_tokens=max_tokens,
        **fields,
    )
    return completion.choices[0], completion.usage


def token_id(model_server, text: str) -> int:
    response = httpx.post(f"{model_server.base_url}/tokenize", json={"prompt": text})
    (token,) = response.json()["tokens"]
    return token


def test_penalties_change_a_greedy_continuation_that_repeats(client, model_server):
    plain, _ = chat(client, model_server)
    words = plain.message.content.lower().split()
    assert len(words) > 4 and len(set(words)) <= 2, plain.message.content
    for fields in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.5}},
    ):
        penalised, _ = chat(client, model_server, **fields)
        assert penalised.message.content != plain.message.content, fields


def test_logit_bias_forces_a_token(client, model_server):
    dog = token_id(model_server, " dog")
    choice, usage = chat(client, model_server, max_tokens=6, logit_bias={str(dog): 100})
    assert choice.message.content == " dog" * 6
    assert usage.completion_tokens == 6


def test_stop_token_ids_stop_and_are_not_shown(client, model_server):
    plain, _ = chat(client, model_server)
    comma = token_id(model_server, ",")
    assert "," in plain.message.content
    stopped, _ = chat(client, model_server, extra_body={"stop_token_ids": [comma]})
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == plain.message.content.split(",")[0]


def test_max_completion_tokens_bounds_the_output_and_wins_over_max_tokens(client, model_server):
    choice, usage = chat(client, model_server, max_tokens=40, max_completion_tokens=3)
    assert usage.completion_tokens == 3 and choice.finish_reason == "length"


def test_min_tokens_and_ignore_eos_outlast_the_end_of_turn(client, model_server):
    # One word asked: a clear first token on every CPU (the bare question is a near-tie).
    question = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    short = client.chat.completions.create(
        model=model_server.model, messages=question, temperature=0, max_tokens=40
    )
    assert short.choices[0].finish_reason == "stop"
    natural = short.usage.completion_tokens
    for extra in ({"min_tokens": natural + 5}, {"ignore_eos": True}):
        longer = client.chat.completions.create(
            model=model_server.model,
            messages=question,
            temperature=0,
            max_tokens=natural + 10,
            extra_body=extra,
        )
        assert longer.usage.completion_tokens >= natural + 5, extra
        assert longer.choices[0].message.content.startswith(short.choices[0].message.content)


def test_top_k_one_and_min_p_one_sample_the_greedy_answer(client, model_server):
    greedy, _ = chat(client, model_server, max_tokens=8)

    def sampled(**extra):
        return client.chat.completions.create(
            model=model_server.model,
            messages=[{"role": "user", "content": REPEATS}],
            temperature=1.5,
            max_tokens=8,
            seed=3,
            logprobs=True,
            top_logprobs=2,
            extra_body=extra,
        ).choices[0]

    # Top-k 1 ranks tied logits as greedy does (the first): the same answer.
    assert sampled(top_k=1).message.content == greedy.message.content
    # Min-p 1 keeps every token at the maximum: each one drawn is a maximum (bf16 logits
    # tie often, and a draw between tied maxima need not take greedy's).
    for position in sampled(min_p=1.0).logprobs.content:
        assert position.logprob == position.top_logprobs[0].logprob


def test_messages_top_k_and_extra_fields_reach_the_engine(claude, model_server):
    def reply(**fields) -> str:
        # This anthropic SDK has no sampling arguments; the API fields still exist.
        message = claude.messages.create(
            model=model_server.model,
            max_tokens=12,
            messages=[{"role": "user", "content": REPEATS}],
            extra_body=fields,
        )
        return message.content[0].text

    greedy = reply(temperature=0)
    assert reply(temperature=1.5, top_k=1, seed=5) == greedy
    assert reply(temperature=0, frequency_penalty=2.0) != greedy


def test_responses_takes_the_extra_fields(client, model_server):
    dog = token_id(model_server, " dog")
    response = client.responses.create(
        model=model_server.model,
        input=REPEATS,
        max_output_tokens=4,
        temperature=0,
        extra_body={"logit_bias": {str(dog): 100}},
    )
    assert response.output_text == " dog" * 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"dog": 1}),
        ("stop_token_ids", [-1]),
        ("min_tokens", 100),
        ("ignore_eos", "yes"),
        ("max_completion_tokens", 0),
    ],
)
def test_bad_fields_get_a_400_naming_them(client, model_server, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, model_server, max_tokens=10, extra_body={field: value})
    assert field in error.value.body["message"]
    assert error.value.body["param"].startswith(field)


def test_n_and_foreign_fields_are_refused_by_name(client, claude, model_server):
    # Chat takes n (parallel samples, test_parallel_samples.py), within OpenAI's bound.
    with pytest.raises(openai.BadRequestError, match="'n'"):
        chat(client, model_server, n=129)
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.responses.create(
            model=model_server.model, input="Hi", extra_body={"max_completion_tokens": 5}
        )
    for field in ("logprobs", "n"):
        with pytest.raises(anthropic.BadRequestError, match=f"'{field}'"):
            claude.messages.create(
                model=model_server.model,
                max_tokens=5,
                messages=[{"role": "user", "content": "Hi"}],
                extra_body={field: 2},
            )


def test_the_array_form_body_has_no_extra_fields():
    sampling = read_sampling_params(
        "chat",
        ["messages", "model"],
        InferenceOptions(temperature=0.5),
        max_tokens=4,
        fallback_seed=9,
        model_stop_token_ids=[2],
    )
    assert sampling == SamplingParams(max_tokens=4, temperature=0.5, seed=9, stop_token_ids=[2])


def test_the_body_fields_and_the_recipes_make_one_sampling_params():
    body = {"top_k": 3, "stop_token_ids": [7, 2], "logit_bias": {"5": -1}, "seed": 11}
    options = InferenceOptions(top_p=0.5, logprobs=True, top_logprobs=2)
    sampling = read_sampling_params(
        "messages", body, options, max_tokens=8, fallback_seed=9, model_stop_token_ids=[2, 0]
    )
    assert (sampling.top_k, sampling.top_p, sampling.seed) == (3, 0.5, 11)
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 2)
    assert sampling.stop_token_ids == [0, 2, 7] and sampling.logit_bias == {5: -1.0}
    # ignore_eos drops the model's stop ids (its end of turn), not the body's.
    body["ignore_eos"] = True
    sampling = read_sampling_params(
        "messages", body, options, max_tokens=8, fallback_seed=9, model_stop_token_ids=[2, 0]
    )
    assert sampling.stop_token_ids == [2, 7]


def test_deepinfer_fields_come_through_extra_body():
    body = {
        "seq_seed": 2**64 - 1,
        "first_n_token_no_eos": 1,
        "eos_id": 2,
        "golden_token_ids": [5, 6],
        "so_args": {"schema_type": "ebnf", "schema": 'root ::= "a" | "b"'},
    }
    sampling = read_sampling_params(
        "chat", body, InferenceOptions(), max_tokens=8, fallback_seed=9, model_stop_token_ids=[2]
    )
    # seq_seed is the seed: the server's fallback does not compete with it.
    assert sampling.seed == sampling.seq_seed == 2**64 - 1
    assert (sampling.first_n_token_no_eos, sampling.eos_id) == (1, 2)
    assert sampling.golden_token_ids == [5, 6]
    assert sampling.structured_output.kind == "ebnf"
    assert sampling.structured_output.spec.startswith("%llguidance")


@pytest.mark.parametrize(
    ("dialect", "body", "param"),
    [
        ("chat", {"prompt_logprobs": True}, "prompt_logprobs"),
        ("chat", {"seq_seed": -1}, "seq_seed"),
        ("messages", {"seq_seed": 5, "seed": 6}, "seq_seed"),
        ("messages", {"golden_token_ids": ["a"]}, "golden_token_ids"),
        ("chat", {"so_args": {"schema_type": "ebnf", "schema": 'root ::= "a" (= "b")'}}, "so_args"),
        ("completions", {"so_args": {"schema_type": "json", "schema": "{}", "x": 1}}, "so_args"),
    ],
)
def test_bad_deepinfer_fields_are_refused_naming_them(dialect, body, param):
    with pytest.raises(ApiError) as error:
        read_sampling_params(
            dialect,
            body,
            InferenceOptions(),
            max_tokens=8,
            fallback_seed=9,
            model_stop_token_ids=[],
        )
    assert error.value.param == param


def test_so_args_and_response_format_are_one_constraint_too_many():
    with pytest.raises(ApiError) as error:
        read_sampling_params(
            "chat",
            {"so_args": {"schema_type": "regex", "schema": "a+"}},
            InferenceOptions(),
            max_tokens=8,
            fallback_seed=9,
            model_stop_token_ids=[],
            structured_output=StructuredOutput("json_object"),
        )
    assert error.value.param == "so_args"
