"""A request's step output: the engine decides once which stop id ended it."""

import torch

from deepwell.engine.outputs import FinishReason, TokenLogprobs
from deepwell.engine.request import Request
from deepwell.engine.sampling_params import SamplingParams

EOS = 2


def request(max_tokens: int = 8) -> Request:
    return Request(
        "r",
        [5, 6, 7],
        SamplingParams(max_tokens=max_tokens, logprobs=True),
        stop_token_ids=frozenset({EOS}),
        generator=torch.Generator(),
    )


def step(req: Request, tokens: list[int]):
    logprobs = [TokenLogprobs(t, -0.5) for t in tokens]
    for token in tokens:
        req.append_token(token)
    return req.step_output(tokens, logprobs)


def test_a_stop_id_is_counted_but_is_not_text() -> None:
    req = request()
    output = step(req, [11, EOS])
    assert output.finished and output.finish_reason is FinishReason.STOP
    assert output.stop_token_id == EOS
    assert output.new_token_ids == [11, EOS] and output.num_output_tokens == 2
    assert output.text_token_ids == [11]
    assert [lp.token_id for lp in output.text_logprobs] == [11]


def test_outputs_not_ended_by_a_stop_id_are_all_text() -> None:
    req = request(max_tokens=2)
    first = step(req, [EOS + 1])
    last = step(req, [EOS + 2])
    assert not first.finished and first.stop_token_id is None
    assert last.finish_reason is FinishReason.LENGTH and last.stop_token_id is None
    assert last.text_token_ids == last.new_token_ids == [EOS + 2]
