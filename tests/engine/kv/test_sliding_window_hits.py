"""Hit rules that know the KV layout: a sliding-window ring is rebuilt by replay."""

import pytest

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.kv.layout import KVLayout, PagedSpec, RingSpec
from deepwell.engine.models import registry

from ..sliding_window import ARCHITECTURE, SlidingWindowLlama, write_sliding_window_llama
from .test_prefix_cache import PREFIX

WITH_LOGPROBS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)

PAGED = (PagedSpec("key", 1, (1, 4), entry_axis=1),)


def test_full_attention_reuses_the_whole_block_hit():
    assert KVLayout(paged=PAGED).reusable_prefix(96, 16) == 96


def test_a_ring_shrinks_the_hit_to_the_block_before_its_replay():
    ring = RingSpec("window", 1, (4,), window=8, max_backtrack=2)
    layout = KVLayout(paged=PAGED, rings=(ring,))
    assert layout.reusable_prefix(96, 16) == 80  # replay 10 tokens from 86: block 80
    assert layout.reusable_prefix(80, 16) == 64
    assert layout.reusable_prefix(16, 16) == 0


@pytest.fixture
def make_swa_core(tmp_path_factory, monkeypatch):
    monkeypatch.setitem(
        registry.MODELS, ARCHITECTURE, registry.ModelEntry(ARCHITECTURE, SlidingWindowLlama)
    )
    path = write_sliding_window_llama(tmp_path_factory.mktemp("swa"))

    def make(**kwargs) -> EngineCore:
        kwargs = {"dtype": "float32", "block_size": 16, "memory_gib": 0.25} | kwargs
        return EngineCore(EngineArgs(model=str(path), **kwargs))

    return make


def generate(core: EngineCore, prompts: list[list[int]]):
    """Run prompts one after another: (cached prompt tokens, tokens, their logprobs) each."""
    results = []
    for n, prompt in enumerate(prompts):
        core.add_request(str(n), prompt, WITH_LOGPROBS)
        cached, logprobs = 0, []
        while core.has_unfinished():
            for output in core.step():
                logprobs += output.new_logprobs
                cached = output.num_cached_tokens
        results.append((cached, [lp.token_id for lp in logprobs], [lp.logprob for lp in logprobs]))
    return results


def test_a_sliding_window_model_replays_its_window_and_matches_no_cache(make_swa_core):
    second = PREFIX + [20]  # 7 tokens past the block hit: fewer than the window
    cached = generate(make_swa_core(max_num_batched_tokens=24), [PREFIX + [7, 8, 9], second])
    ((_, tokens, logprobs),) = generate(make_swa_core(enable_prefix_caching=False), [second])
    # 4 blocks cached; replaying the 10-token ring from token 54 gives back the 4th block.
    assert cached[1][0] == 48
    assert cached[1][1] == tokens
    assert cached[1][2] == pytest.approx(logprobs, abs=1e-5)


def test_reusing_the_whole_block_hit_would_lose_the_window(make_swa_core, monkeypatch):
    """The control: ignore the ring's replay and the outputs change."""
    second = PREFIX + [20]  # 7 tokens past the block hit: fewer than the window
    ((_, _, logprobs),) = generate(make_swa_core(enable_prefix_caching=False), [second])
    monkeypatch.setattr(KVLayout, "reusable_prefix", lambda self, hit, block_size: hit)
    naive = generate(make_swa_core(), [PREFIX + [7, 8, 9], second])
    assert naive[1][0] == 64
    assert naive[1][2][0] != pytest.approx(logprobs[0], abs=1e-3)
