"""Prefix caching in memory: LRU reuse of freed blocks, identical outputs."""

from deepwell.engine import SamplingParams
from deepwell.engine.kv.block_pool import BlockPool

from ..tiny_llama import run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PREFIX = [(11 * i) % 290 + 5 for i in range(70)]


def test_freed_cached_blocks_stay_findable_until_reused_in_lru_order():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, b"ka")
    pool.register(b, b"kb")
    pool.free([a])
    pool.free([b])
    pool.free([c])
    # c holds nothing, so it goes out first; then a, the least recently freed.
    assert pool.allocate(1) == [c] and pool.lookup(b"ka") == a
    assert pool.allocate(1) == [a] and pool.lookup(b"ka") is None
    assert pool.lookup(b"kb") == b
    pool.share([b])
    assert pool.num_free == 0 and pool.ref_counts[b] == 1


def generate(core, prompts, params=GREEDY):
    """Run prompts one after another; returns (tokens, cached prompt tokens) per prompt."""
    results = []
    for n, prompt in enumerate(prompts):
        core.add_request(str(n), prompt, params)
        cached = 0
        tokens: list[int] = []
        while core.has_unfinished():
            for output in core.step():
                tokens += output.new_token_ids
                cached = output.num_cached_tokens
        results.append((tokens, cached))
    return results


def test_a_shared_prefix_is_reused_and_outputs_match_no_cache(make_core):
    first = PREFIX + [7, 8, 9]
    second = PREFIX + [20, 21, 22, 23, 24]
    # Small steps: both prefills are chunked, the hit lands mid-way through the prompt.
    cached = generate(make_core(max_num_batched_tokens=24), [first, second])
    fresh = generate(make_core(enable_prefix_caching=False), [second])
    assert cached[0][1] == 0
    assert cached[1][1] == 64  # 4 full blocks of 16 tokens of the 70-token prefix
    assert cached[1][0] == fresh[0][0]


def test_a_repeated_prompt_still_computes_its_last_token(make_core):
    prompt = PREFIX[:64]
    core = make_core()
    (first, _), (again, cached) = generate(core, [prompt, prompt])
    assert cached == 48 and again == first
    stats = core.stats()
    assert stats.prefix_queried_tokens == 128 and stats.prefix_hit_tokens == 48


def test_a_multi_turn_conversation_hits_the_previous_answer(make_core):
    core = make_core()
    ((answer, _),) = generate(core, [PREFIX])
    follow_up = PREFIX + answer + [30, 31, 32]
    ((tokens, cached),) = generate(core, [follow_up])
    assert cached == (len(PREFIX) + len(answer) - 1) // 16 * 16
    assert tokens == generate(make_core(enable_prefix_caching=False), [follow_up])[0][0]


def test_an_aborted_request_leaves_its_computed_blocks_reusable(make_core):
    core = make_core(max_num_batched_tokens=32)
    core.add_request("gone", PREFIX + [1, 2, 3], GREEDY)
    core.step()  # 32 tokens computed: two full blocks
    assert core.abort("gone")
    run_to_completion(core)
    ((tokens, cached),) = generate(core, [PREFIX + [4, 5]])
    assert cached == 32
    assert tokens == generate(make_core(enable_prefix_caching=False), [PREFIX + [4, 5]])[0][0]
    pool = core.kv.block_pool
    assert pool.num_free == pool.num_blocks
