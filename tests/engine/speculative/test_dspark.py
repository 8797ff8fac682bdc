"""DSpark drafting on the tiny DeepSeek-V4.1: greedy output equals output without
speculation, sampled output follows the target's distribution, the draft stages' context
rings survive rollbacks, and the method is picked from the checkpoint."""

from collections import Counter

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.speculative.dspark import DSparkDrafter
from deepwell.engine.speculative.ngram import NgramDrafter

from ..tiny_llama import run_to_completion

# Chi-square critical value at p = 0.001 by degrees of freedom.
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def make_core(checkpoint, **kwargs) -> EngineCore:
    defaults = dict(
        model=str(checkpoint),
        dtype="float32",
        quantize_kv_cache=False,
        max_model_len=512,
        block_size=16,
        memory_gib=0.5,
    )
    return EngineCore(EngineArgs(**(defaults | kwargs)))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]


def generate(core: EngineCore, batch: list[list[int]], max_tokens: int, **params):
    for index, prompt in enumerate(batch):
        sampling = SamplingParams(max_tokens=max_tokens, **({"temperature": 0} | params))
        core.add_request(f"r{index}", prompt, sampling)
    tokens = run_to_completion(core)
    return [tokens[f"r{index}"] for index in range(len(batch))]


def check_greedy_identity(checkpoint, count: int, max_tokens: int) -> None:
    batch = prompts(count)
    off = generate(make_core(checkpoint, num_speculative_tokens=0), batch, max_tokens)
    core = make_core(checkpoint)
    assert isinstance(core.speculator.drafter, DSparkDrafter)
    assert generate(core, batch, max_tokens) == off
    stats = core.speculator.stats()
    assert stats.verified_tokens > stats.accepted_tokens > 0
    assert core.kv.block_pool.num_free == core.kv.block_pool.num_blocks
    assert core.kv.slot_pool.num_free == core.kv.slot_pool.num_slots


def test_dspark_greedy_output_equals_no_speculation(checkpoint):
    check_greedy_identity(checkpoint, count=8, max_tokens=48)


@pytest.mark.slow
def test_dspark_greedy_output_equals_no_speculation_32_requests_128_tokens(checkpoint):
    check_greedy_identity(checkpoint, count=32, max_tokens=128)


def test_dspark_sampled_tokens_follow_the_target_distribution(checkpoint):
    """Many seeds of one prompt: the token verified after the first (DSpark drafted it with
    its own top-k distribution) follows the target's top-k softmax given the first."""
    prompt = prompts(1, seed=5)[0][:6]
    params = dict(temperature=1.0, top_k=4)
    core = make_core(checkpoint, max_num_seqs=64, max_num_batched_tokens=4096)
    seeds = range(800)
    for seed in seeds:
        core.add_request(f"s{seed}", prompt, SamplingParams(max_tokens=3, seed=seed, **params))
    tokens = run_to_completion(core)
    assert core.speculator.stats().verified_tokens > len(seeds) // 2
    by_first: dict[int, Counter] = {}
    for seed in seeds:
        first, second = tokens[f"s{seed}"][:2]
        by_first.setdefault(first, Counter())[second] += 1
    reference = make_core(checkpoint, num_speculative_tokens=0)
    checked = 0
    for first, counts in by_first.items():
        total = sum(counts.values())
        if total < 150:
            continue
        reference.add_request(
            "ref", prompt + [first], SamplingParams(max_tokens=1, logprobs=True, top_logprobs=4)
        )
        (top,) = [o.new_logprobs[0].top for o in _drain(reference) if o.new_logprobs]
        ids = [token for token, _ in top]
        probs = torch.tensor([lp for _, lp in top]).softmax(0)
        assert set(counts) <= set(ids)
        observed = torch.tensor([counts[token] for token in ids], dtype=torch.float64)
        expected = probs.double() * total
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_P001[len(ids) - 1], (first, counts, probs)
        checked += 1
    assert checked


def _drain(core: EngineCore):
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    return outputs


def test_context_rings_after_rollbacks_give_the_drafts_of_a_fresh_prefill(checkpoint):
    """After many verify steps with rejected rows, the draft of a request equals the draft
    of the same tokens prefilled from scratch: the stages' rings hold no stale rows."""
    core = make_core(checkpoint, async_scheduling=False)
    prompt = prompts(1, seed=9)[0]
    core.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0))
    while core.requests["a"].num_output_tokens < 30:
        core.step()
    assert core.speculator.stats().verified_tokens > core.speculator.stats().accepted_tokens
    request = core.requests["a"]
    # Right after a step: every token but the last is computed.
    assert request.num_computed_tokens == request.num_tokens - 1
    token_ids = list(request.token_ids)
    (after,) = core.speculator.drafter.propose([request], [4])
    fresh = make_core(checkpoint, async_scheduling=False)
    fresh.add_request("b", token_ids[:-1], SamplingParams(max_tokens=5, temperature=0))
    while fresh.requests["b"].num_output_tokens == 0:
        fresh.step()
    again = fresh.requests["b"]
    again.token_ids[-1] = token_ids[-1]  # the same anchor as the long-running request
    (before,) = fresh.speculator.drafter.propose([again], [4])
    assert after.tokens == before.tokens
    torch.testing.assert_close(after.survival, before.survival, atol=1e-5, rtol=0)


def test_dspark_is_the_default_drafter_of_a_checkpoint_with_draft_stages(checkpoint):
    core = make_core(checkpoint, num_speculative_tokens=3)
    assert isinstance(core.speculator.drafter, DSparkDrafter)
    assert core.speculator.num_speculative_tokens == 3
    ring = next(r for r in core.runner.layout.rings if r.name == DSPARK_RING)
    # One ring per stage, counted by memory planning like the target's windows (with
    # prefix caching, a block of extra rows for snapshots, as theirs).
    window = next(r for r in core.runner.layout.rings if r.name == "window")
    assert ring.num_layers == 3 and ring.rows == window.rows
    assert ring.rows == ring.window + ring.max_backtrack + ring.extra_rows
    ngram = make_core(checkpoint, speculative_method="ngram")
    assert isinstance(ngram.speculator.drafter, NgramDrafter)
    assert all(r.name != DSPARK_RING for r in ngram.runner.layout.rings)
    # The tiny model drafts blocks of 4; the rings' slack caps any draft at 5.
    assert make_core(checkpoint, num_speculative_tokens=9).speculator.num_speculative_tokens == 4


def test_dspark_on_a_model_without_draft_stages_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="draft stages"):
        EngineCore(EngineArgs(model=str(tiny_llama), speculative_method="dspark"))
