"""In batch-invariant mode a row's bits depend on its own values only, so a prefill split
across ranks leaves bit-for-bit the caches, logprobs and tokens of one process: the first
chunk of a prompt and a later one, which reads what precedes it from rank 0."""

import pytest
import torch

from deepwell.engine import SamplingParams

from .v41_cores import CHUNKED, make_core, prompt, sequence_state


@pytest.fixture(scope="module")
def one_rank(checkpoint):
    core = make_core(checkpoint, batch_invariant=True)
    yield core
    core.close()


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2-ranks", "4-ranks"]
)
def parallel(checkpoint, request):
    core = make_core(checkpoint, batch_invariant=True, context_parallel_size=request.param)
    yield core
    core.close()


def test_a_parallel_prefill_is_bitwise_the_one_rank_prefill(one_rank, parallel):
    # A prompt neither core has seen: a prefix hit would restore only the rows it needs.
    ids = prompt(CHUNKED, seed=7 + parallel.context_parallel.group.size)
    # No EOS: the request must outlive its prefill for its state to be read.
    params = SamplingParams(
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    results = []
    for core in (one_rank, parallel):
        core.add_request("p", ids, params)
        first = []
        while core.requests["p"].num_computed_tokens < CHUNKED:
            first += core.step()  # two chunks: from 0, then from 256
        state = sequence_state(core, "p")
        outputs = first
        while core.has_unfinished():
            outputs += core.step()
        tokens = [t for o in outputs for t in o.new_token_ids]
        logprobs = [(lp.logprob, lp.top) for o in outputs for lp in o.new_logprobs]
        results.append((state, tokens, logprobs))
    (expected, tokens, logprobs), (got, parallel_tokens, parallel_logprobs) = results
    assert parallel.context_parallel.group.num_prefills >= 2
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert parallel_tokens == tokens
    assert parallel_logprobs == logprobs
