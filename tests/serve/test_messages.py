import pytest

from deepwell.serve.messages import (
    AbortRequest,
    GenerateRequest,
    Shutdown,
    StepOutputs,
    TokenOutput,
    WorkerStats,
    decode_message,
    encode_message,
)


def test_messages_round_trip_with_nesting():
    messages = [
        GenerateRequest("r1", [1, 2, 3], 16, 0.7, 1.0, 42, [2], None),
        AbortRequest(["r1", "r2"]),
        Shutdown(),
        StepOutputs(
            0,
            [TokenOutput("r1", [5], None, 3, 0, [[-0.5, [[5, -0.5], [6, -1.0]]]])],
            [],
            WorkerStats(1, 0, 2, 100),
        ),
    ]
    for message in messages:
        assert decode_message(encode_message(message)) == message


def test_unknown_objects_are_refused():
    with pytest.raises(TypeError, match="cannot send set"):
        encode_message({"a", "set"})
