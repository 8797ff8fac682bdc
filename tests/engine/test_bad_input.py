"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

import pytest

from deepwell.engine import (
    EngineArgs,
    EngineCore,
    InvalidRequestError,
    MemoryBudgetError,
    ModelLoadError,
    SamplingParams,
)

from .tiny_llama import run_to_completion


@pytest.fixture(scope="module")
def core(tiny_llama):
    return EngineCore(
        EngineArgs(model=str(tiny_llama), dtype="float32", block_size=16, memory_gib=0.25)
    )


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([5] * 600, SamplingParams(), "does not fit the context of 512"),
        ([5] * 500, SamplingParams(max_tokens=20), "exceeds the context of 512"),
        ([5, 320, 7], SamplingParams(), "outside the vocabulary"),
        ([5, -1], SamplingParams(), "outside the vocabulary"),
        ([5, "x"], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_prompt_is_rejected_and_others_still_run(core, prompt, params, message):
    core.add_request("good", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(InvalidRequestError, match=message):
        core.add_request("bad", prompt, params)
    assert len(run_to_completion(core)["good"]) == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 2**31}, r"max_tokens must be an integer in \[0, 2\^31\)"),
        ({"max_tokens": -3}, r"max_tokens must be an integer in \[0, 2\^31\)"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"min_p": 2}, "min_p must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 3}, "presence_penalty must be in"),
        ({"top_logprobs": -1}, "top_logprobs must be in"),
        ({"logprobs": True, "top_logprobs": 1001}, "top_logprobs must be in"),
    ],
)
def test_bad_sampling_parameters_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(core):
    core.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    assert len(run_to_completion(core)["dup"]) == 2


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="does not exist"):
        EngineCore(EngineArgs(model=str(missing)))


def test_corrupt_gguf_is_named(tmp_path):
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        EngineCore(EngineArgs(model=str(corrupt)))


def test_corrupt_safetensors_is_named(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        EngineCore(EngineArgs(model=str(broken)))


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        EngineCore(EngineArgs(model=str(tmp_path)))


def test_budget_too_small_for_weights_and_one_sequence(tiny_llama):
    with pytest.raises(MemoryBudgetError, match="memory budget 0.00 GiB is too small"):
        EngineCore(EngineArgs(model=str(tiny_llama), memory_gib=0.0001))
