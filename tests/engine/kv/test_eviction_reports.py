"""The keys of cached and evicted prefix blocks, kept for a serve worker's reports once it
asks."""

from deepwell.engine import SamplingParams
from deepwell.engine.kv.prefix_hash import prompt_block_keys

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def run(core, request_id, prompt):
    core.add_request(request_id, prompt, ONE_TOKEN)
    while core.has_unfinished():
        core.step()


def prompt(first):
    return list(range(first, first + 48))  # three full blocks of 16


def test_blocks_cached_then_pushed_out_by_later_prompts_are_reported_once(make_core):
    # 8 blocks: each prompt holds 4 while it runs (48 tokens and its one output).
    core = make_core(num_kv_blocks=8, max_model_len=128)
    core.kv.watch_keys()
    first_keys = prompt_block_keys(core.kv.root_key, prompt(10), 16)
    run(core, "a", prompt(10))
    assert core.kv.take_key_changes() == (first_keys, [])
    for n, first in enumerate((70, 130, 190)):
        run(core, str(n), prompt(first))
    cached, evicted = core.kv.take_key_changes()
    assert set(first_keys) <= set(evicted) and not set(cached) & set(evicted)
    assert core.kv.take_key_changes() == ([], [])
    # Computed again from scratch, the first prompt's blocks are cached again.
    run(core, "again", prompt(10))
    assert core.stats().prefix_hit_tokens == 0
    cached, evicted = core.kv.take_key_changes()
    assert set(first_keys) <= set(cached) and not set(first_keys) & set(evicted)


def test_an_engine_nobody_watches_keeps_no_keys(make_core):
    core = make_core(num_kv_blocks=8, max_model_len=128)
    for n, first in enumerate((10, 70, 130, 190)):
        run(core, str(n), prompt(first))
    assert core.kv.take_key_changes() == ([], [])
