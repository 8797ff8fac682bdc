"""Mirror context parallelism on the tiny DeepSeek-V4.1 (float32, gloo, 2 and 4 processes):
a long prefill split across ranks leaves rank 0 with the caches a one-process prefill
leaves, and the tokens and logprobs that follow are the one-process ones."""

import pytest
import torch

from deepwell.engine import EngineCore, SamplingParams
from deepwell.engine.parallel.context_group import ContextGroup

from .v41_cores import CHUNKED, LONG, make_core, prompt, sequence_state


@pytest.fixture(scope="module")
def one_rank(checkpoint):
    core = make_core(checkpoint)
    yield core
    core.close()


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def parallel(checkpoint, request):
    core = make_core(checkpoint, context_parallel_size=request.param)
    yield core
    core.close()


def generate(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=3)
    for request_id, ids in prompts.items():
        core.add_request(request_id, ids, params)
    out: dict[str, tuple[list[int], list]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens, logprobs = out.setdefault(output.request_id, ([], []))
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
    return out


@pytest.mark.parametrize("length", [*LONG, CHUNKED])
def test_cache_state_after_a_parallel_prefill_is_the_one_rank_state(one_rank, parallel, length):
    group = parallel.context_parallel.group
    # A prompt neither core has seen: a prefix hit would restore only the rows it needs.
    ids = prompt(length, seed=length * 10 + group.size)
    prefills = group.num_prefills
    states = []
    for core in (one_rank, parallel):
        core.add_request("state", ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while core.requests["state"].num_computed_tokens < length:
            core.step()  # the prefill's chunks, the last of which samples
        states.append(sequence_state(core, "state"))
        core.abort("state")
        core.step()
    assert group.num_prefills == prefills + -(-length // 256)
    expected, got = states
    assert expected.keys() == got.keys()
    assert {"window[0]", "compressor_tail_r2[0]", "compressed_r1[0]"} <= expected.keys()
    assert any(name.startswith("dspark") for name in expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_tokens_and_logprobs_after_parallel_prefills_are_the_one_rank_ones(one_rank, parallel):
    # Two long prompts and a short one in one step: the long ones run across the ranks,
    # the short one on rank 0 beside them; all then decode on rank 0.
    prompts = {"long-a": prompt(LONG[0], 1), "long-b": prompt(LONG[1], 2), "short": prompt(5, 3)}
    group = parallel.context_parallel.group
    prefills = group.num_prefills
    expected = generate(one_rank, prompts)
    got = generate(parallel, prompts)
    assert group.num_prefills == prefills + 2
    for request_id in prompts:
        tokens, logprobs = got[request_id]
        assert tokens == expected[request_id][0], request_id
        for lp, ref in zip(logprobs, expected[request_id][1], strict=True):
            assert lp.token_id == ref.token_id
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t for t, _ in lp.top] == [t for t, _ in ref.top]


def test_a_prompt_below_the_threshold_runs_on_rank_0(parallel):
    group = parallel.context_parallel.group
    prefills = group.num_prefills
    # Twice the window by default.
    generate(parallel, {"short": prompt(15, 4)}, max_tokens=2)
    assert group.num_prefills == prefills
    generate(parallel, {"long": prompt(16, 4)}, max_tokens=2)
    assert group.num_prefills == prefills + 1


def test_later_chunks_and_prefix_hits_run_across_ranks_from_rank_0s_caches(
    one_rank, parallel, monkeypatch
):
    # A 300-token prompt is two chunks (budget 256): the second starts at 256 and reads
    # the first's rings, tail and entries from rank 0. Then a prompt sharing its first 256
    # tokens hits them (a ring snapshot sits at 256) and prefills the rest from there.
    starts = []
    announce = ContextGroup.announce

    def recording(group, token_ids, start):
        starts.append(start)
        announce(group, token_ids, start)

    monkeypatch.setattr(ContextGroup, "announce", recording)
    seed = 100 + parallel.context_parallel.group.size
    first = prompt(300, seed)
    second = first[:256] + prompt(40, seed + 1)
    for ids in (first, second):
        hits = parallel.stats().prefix_hit_tokens
        expected = generate(one_rank, {"p": ids}, max_tokens=4)["p"]
        got = generate(parallel, {"p": ids}, max_tokens=4)["p"]
        assert got[0] == expected[0]
        for lp, ref in zip(got[1], expected[1], strict=True):
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
    assert parallel.stats().prefix_hit_tokens - hits == 256
    assert starts == [0, 256, 256]
