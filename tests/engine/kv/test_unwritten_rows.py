"""No KV row a request has not written reaches its output: with every byte that earlier
requests may have left (the blocks handed out before, every slot) set to 0xFF (NaN in bf16,
fp32 and FP8 E4M3 alike), greedy tokens are those of a fresh pool. A masked read of an
unwritten row would not be: NaN * 0 is NaN. (Blocks never handed out are zero as allocated
on the CPU: tests/engine/kv/test_cache.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from ..tiny_llama import run_to_completion

# Lengths that end mid-block, on a block boundary and past several blocks of 16.
PROMPTS = {"short": list(range(3, 8)), "block": list(range(3, 19)), "long": list(range(3, 60))}


def _poison(core: EngineCore) -> None:
    cache = core.runner.kv_cache
    used = [block for block, held in enumerate(cache.holds_rows) if held]
    index = torch.tensor(used, dtype=torch.long)
    for tensor in cache.block_tensors():
        tensor.view(torch.uint8).index_fill_(0, index, 0xFF)
    for tensors in (*cache.rings.values(), *cache.states.values()):
        for tensor in tensors:
            tensor.view(torch.uint8).fill_(0xFF)


def _greedy(core: EngineCore, round_name: str) -> dict[str, list[int]]:
    for request_id, prompt in PROMPTS.items():
        core.add_request(
            f"{round_name}-{request_id}", prompt, SamplingParams(max_tokens=12, temperature=0)
        )
    tokens = run_to_completion(core)
    return {request_id.split("-", 1)[1]: out for request_id, out in tokens.items()}


def _tokens_of(args: EngineArgs, poisoned: bool) -> dict[str, list[int]]:
    # No prefix cache: the second round must compute its rows, not find the first's.
    core = EngineCore(dataclasses.replace(args, enable_prefix_caching=False))
    if poisoned:
        # The same requests again take the blocks the first round freed.
        _greedy(core, "first")
        _poison(core)
    return _greedy(core, "second")


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_a_nan_filled_pool_gives_the_tokens_of_a_zeroed_one_llama(tiny_llama, backend):
    args = EngineArgs(
        model=str(tiny_llama),
        dtype="float32",
        block_size=16,
        memory_gib=0.25,
        attention_backend=backend,
    )
    assert _tokens_of(args, poisoned=True) == _tokens_of(args, poisoned=False)


def test_a_nan_filled_pool_gives_the_tokens_of_a_zeroed_one_deepseek_v41(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "v41", seed=0).path
    args = EngineArgs(
        model=str(checkpoint), dtype="float32", max_model_len=512, block_size=16, memory_gib=0.5
    )
    assert _tokens_of(args, poisoned=True) == _tokens_of(args, poisoned=False)
