"""How a stream ends when the engine ends its request: a watchdog kill is a 503, not the
client's fault."""

import asyncio

import pytest

from deepwell.engine.outputs import FinishReason, RequestOutput
from deepwell.engine.sampling_params import SamplingParams
from deepwell.serve.cluster.inference_errors import RequestRejected, RequestStalled
from deepwell.serve.cluster.metrics import RoleLatency
from deepwell.serve.cluster.stream_table import StreamTable
from deepwell.serve.messages import GenerateRequest


def _ended(reason: FinishReason, error: str) -> Exception:
    async def main() -> Exception:
        table = StreamTable(RoleLatency())
        stream = table.open(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=4)))
        table.deliver(stream, RequestOutput("r", [], [], reason, 2, 0, error=error))
        with pytest.raises(Exception) as raised:
            async for _ in table.outputs(stream):
                pass
        return raised.value

    return asyncio.run(main())


def test_a_request_the_watchdog_ended_fails_with_503():
    error = _ended(FinishReason.STUCK, "the engine stopped making progress on this request")
    assert isinstance(error, RequestStalled)
    assert error.status_code == 503
    assert "stopped making progress" in str(error)


def test_a_request_that_failed_on_its_own_is_still_a_400():
    error = _ended(FinishReason.ERROR, "invalid regex constraint")
    assert isinstance(error, RequestRejected)
    assert error.status_code == 400
