from dataclasses import fields

import msgpack
import numpy as np
import pytest

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.multimodal import ImageInput
from deepwell.engine.outputs import FinishReason, RequestOutput, TokenLogprobs
from deepwell.engine.sampling_params import SamplingParams
from deepwell.engine.stats import EngineStats, SpecStats
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.serve.messages import (
    MESSAGE_TYPES,
    AbortRequest,
    GenerateRequest,
    Shutdown,
    StepOutputs,
    WorkerConfig,
    decode_message,
    encode_message,
)
from deepwell.settings.engine import EngineArgs
from deepwell.settings.parallel import ParallelConfig


def test_the_worker_config_carries_every_engine_setting():
    engine = EngineArgs(
        model="m.gguf",
        max_model_len=512,
        dspark_confidence_temperature=(0.5, 1.0),
        kv_store_path="/kv",
        expand_weights=True,
        parallel=ParallelConfig(data_parallel_size=2, expert_parallel=True, rank=1),
        speculative_method="ngram",
    )
    config = WorkerConfig(3, 42, "ipc://in", "ipc://out", engine)
    assert decode_message(encode_message(config)) == config


def test_messages_round_trip_with_nesting():
    messages = [
        GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=16, temperature=0.7, seed=42)),
        GenerateRequest(
            "r2",
            [1],
            SamplingParams(
                max_tokens=8,
                temperature=0.0,
                top_k=5,
                min_p=0.1,
                repetition_penalty=1.2,
                presence_penalty=-1.0,
                frequency_penalty=0.5,
                stop_token_ids=[2, 9],
                logit_bias={7: -100.0, 9: 2.5},
                min_tokens=2,
                ignore_eos=True,
                logprobs=True,
                top_logprobs=3,
                structured_output=StructuredOutput("json_schema", '{"type":"object"}', (5,), 6),
            ),
            "agent",
        ),
        AbortRequest(["r1", "r2"]),
        Shutdown(),
        StepOutputs(
            0,
            [
                RequestOutput(
                    "r1", [5], [TokenLogprobs(5, -0.5, [[5, -0.5], [6, -1.0]])], None, 3, 1
                ),
                RequestOutput(
                    "r2", [8, 2], [], FinishReason.STOP, 4, 2, 1, seed=7, stop_token_id=2
                ),
            ],
            [],
            EngineStats(1, 0, 2, 100, spec=SpecStats(3, 2, 4, 3, (1.0, 0.5), 0.1)),
        ),
    ]
    for message in messages:
        assert decode_message(encode_message(message)) == message
    decoded = decode_message(encode_message(messages[1]))
    assert decoded.sampling.logit_bias == {7: -100.0, 9: 2.5}
    assert decoded.sampling.structured_output.trigger_token_ids == (5,)


def test_unknown_objects_are_refused():
    with pytest.raises(TypeError, match="cannot send set"):
        encode_message({"a", "set"})


def _frame(message_type: type, payload: list) -> bytes:
    code = MESSAGE_TYPES.index(message_type)
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))


def test_malformed_messages_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown message code 99"):
        decode_message(msgpack.packb(msgpack.ExtType(99, msgpack.packb([]))))
    with pytest.raises(ValueError, match="malformed AbortRequest: expected 1 fields, got 2"):
        decode_message(_frame(AbortRequest, [["r1"], "extra"]))
    with pytest.raises(ValueError, match="malformed Shutdown: expected 1 fields, got int"):
        decode_message(_frame(Shutdown, 7))
    # A sampling field out of range is refused as SamplingParams refuses it.
    bad = [-1] + [None] * (len(fields(SamplingParams)) - 1)
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer in"):
        decode_message(_frame(SamplingParams, bad))


def test_a_continued_request_keeps_its_sampling_and_counts_its_output():
    sampling = SamplingParams(max_tokens=10, min_tokens=6, seed=3, temperature=0.5)
    request = GenerateRequest("r", [1, 2], sampling, "agent")
    moved = request.continuation([7, 8, 9], 7)
    assert moved.prompt_token_ids == [1, 2, 7, 8, 9] and moved.cache_class == "agent"
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (7, 3)
    assert (moved.sampling.seed, moved.sampling.temperature) == (3, 0.5)
    prefill = request.continuation([], 1)
    assert (prefill.sampling.max_tokens, prefill.sampling.min_tokens) == (1, 1)
    assert request.sampling.max_tokens == 10


def test_a_continued_request_counts_its_output_against_deepinfers_fields():
    sampling = SamplingParams(
        max_tokens=10,
        first_n_token_no_eos=3,
        golden_token_ids=[4, 5, 6],
        prompt_logprobs=True,
        seq_seed=2**64 - 1,
    )
    moved = GenerateRequest("r", [1, 2], sampling).continuation([4, 5], 8).sampling
    assert (moved.first_n_token_no_eos, moved.golden_token_ids) == (1, [6])
    assert not moved.wants_prompt_logprobs and moved.seq_seed == 2**64 - 1
    prefill = GenerateRequest("r", [1, 2], sampling).continuation([], 1).sampling
    assert prefill.wants_prompt_logprobs and prefill.golden_token_ids == [4, 5, 6]


def test_an_engine_output_keeps_its_finish_reason_and_stop_id_on_the_wire():
    output = RequestOutput("r", [9, 2], [], FinishReason.STOP, 4, 2, stop_token_id=2)
    received = decode_message(encode_message(StepOutputs(0, [output], [], EngineStats(0, 0, 0, 1))))
    (decoded,) = received.outputs
    assert decoded.finish_reason is FinishReason.STOP and decoded.finished
    assert decoded.text_token_ids == [9]


def test_a_steps_cached_and_evicted_prefix_keys_travel_with_its_outputs():
    cached, evicted = [bytes(range(16))], [b"\xff" * 16, b"\x00" * 16]
    stats = EngineStats(0, 0, 0, 1)
    received = decode_message(encode_message(StepOutputs(0, [], [], stats, cached, evicted)))
    assert (received.cached_keys, received.evicted_keys) == (cached, evicted)
    plain = decode_message(encode_message(StepOutputs(0, [], [], stats)))
    assert (plain.cached_keys, plain.evicted_keys) == ([], [])


def test_a_request_with_images_carries_their_pixels_exactly():
    pixels = np.random.default_rng(0).standard_normal((6, 3, 4, 4)).astype(np.float32)
    image = ImageInput("ab12", (2, 3), pixels, offset=5)
    request = GenerateRequest("r1", [1] * 20, SamplingParams(), images=(image,))
    decoded = decode_message(encode_message(request))
    (got,) = decoded.images
    assert (got.content_hash, got.grid, got.offset) == ("ab12", (2, 3), 5)
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.writeable
    np.testing.assert_array_equal(got.pixel_values, pixels)
    # A prefill-to-decode hand-off resumes the request with its images.
    assert decoded.continuation([7], 4).images == decoded.images
