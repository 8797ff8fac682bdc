import pytest

from deepwell.engine.outputs import FinishReason, RequestOutput, TokenLogprobs
from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    Shutdown,
    StepOutputs,
    WorkerConfig,
    WorkerStats,
    combine_stats,
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
        GenerateRequest("r1", [1, 2, 3], 16, 0.7, 1.0, 42, [2], None),
        GenerateRequest(
            "r2",
            [1],
            8,
            0.0,
            1.0,
            None,
            [],
            3,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.2,
            presence_penalty=-1.0,
            frequency_penalty=0.5,
            logit_bias=[[7, -100.0], [9, 2.5]],
            min_tokens=2,
            ignore_eos=True,
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
            WorkerStats(1, 0, 2, 100),
        ),
    ]
    for message in messages:
        assert decode_message(encode_message(message)) == message


def test_unknown_objects_are_refused():
    with pytest.raises(TypeError, match="cannot send set"):
        encode_message({"a", "set"})


def test_pool_stats_sum_counters_and_weight_speculative_rates_by_steps():
    busy = WorkerStats(
        running=2,
        waiting=1,
        kv_blocks_used=5,
        kv_blocks_total=10,
        spec_decode_steps=3,
        spec_position_accept_rates=[1.0, 0.5],
        spec_confidence_error=0.2,
    )
    idle = WorkerStats(
        running=0,
        waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=10,
        spec_decode_steps=1,
        spec_position_accept_rates=[0.0],
        spec_confidence_error=0.6,
    )
    pool = combine_stats([busy, idle])
    assert (pool.running, pool.kv_blocks_used, pool.kv_blocks_total) == (2, 5, 20)
    assert pool.spec_decode_steps == 4
    assert pool.spec_position_accept_rates == [0.75, 0.375]
    assert abs(pool.spec_confidence_error - 0.3) < 1e-12
    assert combine_stats([]) == WorkerStats(0, 0, 0, 0)


def test_an_engine_output_keeps_its_finish_reason_and_stop_id_on_the_wire():
    output = RequestOutput("r", [9, 2], [], FinishReason.STOP, 4, 2, stop_token_id=2)
    received = decode_message(encode_message(StepOutputs(0, [output], [], WorkerStats(0, 0, 0, 1))))
    (decoded,) = received.outputs
    assert decoded.finish_reason is FinishReason.STOP and decoded.finished
    assert decoded.text_token_ids == [9]
