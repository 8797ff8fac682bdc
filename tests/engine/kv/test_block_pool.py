"""BlockPool ref counting, and the pool staying whole under any mix of request fates."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepwell.engine import SamplingParams
from deepwell.engine.kv.block_pool import BlockPool

from ..tiny_llama import run_to_completion


def test_allocate_and_free_return_blocks_to_the_pool():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 1
    pool.free(ids)
    assert pool.num_free == 4 and pool.ref_counts == [0] * 4


def test_over_allocation_and_double_free_are_errors():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3"):
        pool.allocate(3)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(ids)


@pytest.fixture(scope="module")
def small_pool_core(tiny_llama):
    from deepwell.engine import EngineArgs, EngineCore

    # 10 blocks of 16 tokens: a handful of requests exhaust it, forcing preemption.
    args = EngineArgs(
        model=str(tiny_llama),
        dtype="float32",
        block_size=16,
        num_kv_blocks=10,
        max_model_len=160,
        max_num_seqs=6,
        max_num_batched_tokens=48,
    )
    return EngineCore(args)


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 80),  # prompt length
            st.integers(1, 60),  # max_tokens
            st.booleans(),  # greedy?
        ),
        st.tuples(st.just("step"), st.integers(1, 8)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(script=events, seed=st.integers(0, 2**16))
def test_pool_is_whole_after_finished_aborted_and_preempted_requests(small_pool_core, script, seed):
    core = small_pool_core
    added: dict[str, int] = {}
    aborted: set[str] = set()
    produced: dict[str, int] = {}

    def record(outputs):
        for output in outputs:
            produced[output.request_id] = produced.get(output.request_id, 0) + len(
                output.new_token_ids
            )

    for n, event in enumerate(script):
        if event[0] == "add":
            _, prompt_len, max_tokens, greedy = event
            request_id = f"{seed}-{n}"
            prompt = [(seed + 7 * i) % 300 + 3 for i in range(prompt_len)]
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0 if greedy else 1.0, ignore_eos=True, seed=seed
            )
            core.add_request(request_id, prompt, params)
            added[request_id] = max_tokens
        elif event[0] == "step":
            for _ in range(event[1]):
                record(core.step())
        elif added:
            request_id = sorted(added)[event[1] % len(added)]
            if core.abort(request_id):
                aborted.add(request_id)
    while core.has_unfinished():
        record(core.step())

    pool = core.kv.block_pool
    assert pool.num_free == pool.num_blocks
    assert pool.ref_counts == [0] * pool.num_blocks
    assert not core.scheduler.running and not core.scheduler.waiting and not core.requests
    for request_id, max_tokens in added.items():
        if request_id not in aborted:
            assert produced[request_id] == max_tokens


def test_preempted_requests_recompute_to_the_same_greedy_tokens(make_core):
    prompts = [[(13 * r + 5 * i) % 300 + 3 for i in range(30 + 9 * r)] for r in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def generate(core):
        for r, prompt in enumerate(prompts):
            core.add_request(str(r), prompt, params)
        return run_to_completion(core)

    roomy = generate(make_core(num_kv_blocks=200))
    cramped_core = make_core(num_kv_blocks=14, max_model_len=160, max_num_batched_tokens=64)
    cramped = generate(cramped_core)
    assert cramped_core.num_preemptions > 0
    assert cramped == roomy
