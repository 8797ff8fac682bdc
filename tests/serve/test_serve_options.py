"""`deepwell serve` as vLLM users type it: positional model, several served names, the API
key from the environment, a default seed, --dtype and the prefix-caching switches."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from servers import MODEL_ARGS, start_server

from deepwell.cli import build_parser
from deepwell.cpu_dtype import select_dtype
from deepwell.serve.settings import api_keys, image_settings, model_path

KEY = "sk-from-the-environment"


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_model_is_positional_or_an_option_but_not_two_different_ones():
    assert model_path(parse("m.gguf")) == "m.gguf"
    assert model_path(parse("--model", "m.gguf")) == "m.gguf"
    assert model_path(parse("m.gguf", "--model", "m.gguf")) == "m.gguf"
    assert model_path(parse()) is None
    with pytest.raises(ValueError, match="two models"):
        model_path(parse("a.gguf", "--model", "b.gguf"))


def test_prefix_caching_takes_vllm_spelling_and_the_old_flag():
    assert parse().enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--no-prefix-caching").enable_prefix_caching is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True


def test_api_keys_come_from_flags_and_the_environment():
    assert api_keys(["a"], {"DEEPWELL_API_KEY": "b"}) == ("a", "b")
    assert api_keys([], {}) == ()
    assert api_keys(["a"], {"DEEPWELL_API_KEY": "a"}) == ("a",)


def test_serve_help_is_grouped_and_names_every_new_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for heading in ("model:", "engine:", "KV cache:", "HTTP server:"):
        assert heading in text
    for option in (
        "--served-model-name",
        "--dtype",
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        "--seed",
        "DEEPWELL_API_KEY",
    ):
        assert option in text


@pytest.fixture(scope="module")
def named_server(tmp_path_factory):
    # Imported here: the engine's loader brings torch.
    from deepwell.engine.models.loader import embedded_model_path

    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEPWELL_API_KEY", KEY)
        server = start_server(
            tmp_path_factory.mktemp("named"),
            str(embedded_model_path()),
            *MODEL_ARGS,
            "--served-model-name",
            "alpha",
            "beta",
            "--seed",
            "7",
            "--dtype",
            "float32",
            "--no-enable-prefix-caching",
        )
    yield server
    assert server.stop() == 0


def test_every_served_name_answers_with_the_environment_key(named_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    listed = httpx.get(f"{named_server.base_url}/v1/models", headers=headers).json()
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    client = openai.OpenAI(base_url=f"{named_server.base_url}/v1", api_key=KEY, max_retries=0)
    for name in ("alpha", "beta"):
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.model == name
    stranger = openai.OpenAI(base_url=f"{named_server.base_url}/v1", api_key="bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_the_server_seed_samples_requests_without_one(named_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "alpha", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    url = f"{named_server.base_url}/v1/chat/completions"
    first, second = (httpx.post(url, json=body, headers=headers, timeout=120) for _ in range(2))
    assert first.headers["x-deepwell-seed"] == second.headers["x-deepwell-seed"] == "7"
    assert first.json()["choices"] == second.json()["choices"]
    seeded = httpx.post(url, json={**body, "seed": 8}, headers=headers, timeout=120)
    assert seeded.headers["x-deepwell-seed"] == "8"


def test_metrics_and_log_say_the_compute_dtype(named_server, model_server):
    metrics = httpx.get(f"{named_server.base_url}/metrics").text
    assert re.search(
        r'deepwell_compute_dtype_info\{dtype="float32",requested="float32"\} 1', metrics
    )
    assert "computing in float32 (--dtype float32" in named_server.output()
    # The shared server runs the default, auto: what this CPU's flags select.
    expected = select_dtype("auto").dtype
    metrics = httpx.get(f"{model_server.base_url}/metrics").text
    assert f'deepwell_compute_dtype_info{{dtype="{expected}",requested="auto"}} 1' in metrics


def test_image_limits_take_vllm_spellings(tmp_path):
    assert parse("--limit-mm-per-prompt", "image=3").limit_mm_per_prompt == 3
    assert parse("--limit-mm-per-prompt", '{"image": 0}').limit_mm_per_prompt == 0
    for bad in ("video=2", '{"image": -1}', "image=many", "{oops"):
        with pytest.raises(SystemExit):
            parse("--limit-mm-per-prompt", bad)
    settings = image_settings(
        parse(
            "--allowed-media-domains",
            "a.example",
            "b.example",
            "--allowed-local-media-path",
            str(tmp_path),
        )
    )
    assert settings.allowed_media_domains == ("a.example", "b.example")
    assert settings.allowed_local_media_path == tmp_path
    with pytest.raises(ValueError, match="not a directory"):
        image_settings(parse("--allowed-local-media-path", str(tmp_path / "missing")))
