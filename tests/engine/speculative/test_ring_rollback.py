"""Speculation on DeepSeek-V4.1's ring layout: rejected draft rows leave the window rings,
compressor tails, compressed entries, index keys and Engram history as if they had never
run, so greedy output with n-gram drafts equals output without speculation."""

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from ..tiny_llama import run_to_completion


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def _core(checkpoint, k: int, method: str = "ngram") -> EngineCore:
    return EngineCore(
        EngineArgs(
            model=str(checkpoint),
            dtype="float32",
            quantize_kv_cache=False,
            max_model_len=512,
            block_size=16,
            memory_gib=0.5,
            num_speculative_tokens=k,
            speculative_method=method,
        )
    )


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-gram lookup drafts from the start."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for index in range(count):
        phrase = torch.randint(3, 250, (3 + index % 4,), generator=generator).tolist()
        prompts.append(phrase * (2 + index % 3) + phrase[:2])
    return prompts


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int, **params):
    for index, prompt in enumerate(prompts):
        params = {"temperature": 0} | params
        core.add_request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, **params))
    tokens = run_to_completion(core)
    return [tokens[f"r{index}"] for index in range(len(prompts))]


def test_ngram_greedy_output_equals_no_speculation_on_v41(checkpoint):
    prompts = _prompts(6)
    off = generate(_core(checkpoint, 0), prompts, 48)
    core = _core(checkpoint, 5)
    on = generate(core, prompts, 48)
    assert on == off
    stats = core.speculator.stats()
    # Both branches of rollback ran: drafts accepted and drafts rejected.
    assert 0 < stats.accepted_tokens < stats.verified_tokens
    pool = core.kv.block_pool
    assert pool.num_free == pool.num_blocks
    assert core.kv.slot_pool.num_free == core.kv.slot_pool.num_slots
