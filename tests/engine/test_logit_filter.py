"""The engine-wide logit limits (DeepInfer's SAMPLER_FORCE_TOPK and DECODE_TOKEN_BLACKLIST):
what they keep, what they refuse, and that a banned token is never generated."""

import pytest
import torch

from deepwell.engine import SamplingParams
from deepwell.engine.logit_filter import LogitFilter

from .tiny_llama import run_to_completion


def test_banned_ids_and_all_but_the_top_k_become_impossible():
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0, 1.0], [2.0, 0.0, 9.0, 2.0, 0.5]])
    out = LogitFilter(force_top_k=2, banned_token_ids=(1,)).apply(logits.clone())
    kept = [row.isfinite().nonzero().flatten().tolist() for row in out]
    assert kept == [[2, 3], [0, 2, 3]]  # ties with the k-th stay


def test_settings_that_ask_nothing_give_no_filter_and_bad_ids_are_refused():
    assert LogitFilter.of(0, (), 320) is None
    assert LogitFilter.of(0, (3, 3, 1), 320) == LogitFilter(0, (1, 3))
    with pytest.raises(ValueError, match="outside the vocabulary of 320: \\[320\\]"):
        LogitFilter.of(0, (5, 320), 320)
    with pytest.raises(ValueError, match="bans every token"):
        LogitFilter.of(0, tuple(range(4)), 4)


def _greedy(make_core, **settings) -> dict[str, list[int]]:
    core = make_core(attention_backend="torch", **settings)
    for index, prompt in enumerate([[5, 6, 7, 8], [9, 10, 11]]):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        core.add_request(f"r{index}", prompt, params)
    return run_to_completion(core)


def test_a_blacklisted_token_is_never_generated(make_core):
    before = _greedy(make_core)
    banned = tuple(sorted({t for tokens in before.values() for t in tokens[:3]}))
    after = _greedy(make_core, decode_token_blacklist=banned)
    assert not {t for tokens in after.values() for t in tokens} & set(banned)
    assert after != before


def test_forced_top_1_sampling_is_greedy(make_core):
    core = make_core(attention_backend="torch", sampler_force_topk=1)
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True)
    core.add_request("sampled", [5, 6, 7, 8], params)
    assert run_to_completion(core)["sampled"] == _greedy(make_core)["r0"]
