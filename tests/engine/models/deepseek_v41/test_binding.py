"""Binding a mapped tiny checkpoint: packed modules over the file's bytes by default, the
bf16/float expanded reference with expand_weights, and the same tokens from both."""

import pytest
import torch
from torch import nn

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.build import load_model
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.packed_modules import (
    Bf16Linear,
    Fp8BlockLinear,
    Fp8RowEmbedding,
)
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from ...near_ties import first_near_tie


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def args(checkpoint, **kwargs) -> EngineArgs:
    defaults = dict(
        model=str(checkpoint), dtype="bfloat16", max_model_len=256, block_size=16, memory_gib=0.5
    )
    return EngineArgs(**(defaults | kwargs))


def test_packed_weights_stay_in_their_released_encodings(checkpoint) -> None:
    model = load_model(args(checkpoint)).model
    assert not any(p.is_meta for p in model.parameters())
    attn = model.layers[0].attn
    assert isinstance(attn.wq_a, Fp8BlockLinear) and isinstance(attn.wo_a, Fp8BlockLinear)
    assert attn.wq_a.parts[0][0].dtype == torch.float8_e4m3fn
    moe = model.layers[0].ffn
    assert isinstance(moe, MoE) and moe.experts is None
    assert moe.packed_experts.num_experts == 8
    assert moe.packed_experts.w1[0].dtype == torch.int8
    assert isinstance(moe.shared_expert.w13, Fp8BlockLinear)
    assert isinstance(model.layers[0].engram.embed, Fp8RowEmbedding)
    # The bf16 embedding is the mapped file itself, not a copy.
    embed = model.embed.weight
    assert embed.dtype == torch.bfloat16
    assert embed.untyped_storage().nbytes() > embed.numel() * embed.element_size()


def test_expanded_weights_are_plain_modules_in_the_compute_dtype(checkpoint) -> None:
    model = load_model(args(checkpoint, expand_weights=True)).model
    attn = model.layers[0].attn
    assert type(attn.wq_a) is not Fp8BlockLinear and attn.wq_a.weight.dtype == torch.bfloat16
    moe = model.layers[0].ffn
    assert moe.packed_experts is None and len(moe.experts) == 8
    assert isinstance(model.layers[0].engram.embed, nn.Embedding)
    assert not any(isinstance(m, Fp8BlockLinear | Bf16Linear) for m in model.modules())


def test_packed_and_expanded_give_the_same_tokens_in_float32(checkpoint) -> None:
    prompts = [[5, 9, 40, 41, 42, 7, 7, 3], list(range(10, 40))]
    greedy = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    completions = {}
    for expand in (False, True):
        llm = LLM(
            **vars(args(checkpoint, dtype="float32", expand_weights=expand)), decode_sequence=False
        )
        completions[expand] = llm.generate(
            prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False
        )
    # The kernels sum in another float32 order than the expanded matmuls: the tokens agree
    # up to the first near-tie either path sees (which one depends on the CPU), and the
    # logprobs there differ by summation order only. Random tiny weights give near-flat
    # logits, so a near-tie here is 1e-3 nats, well above float32's reordering and well
    # below the 0.05 that quantised paths need.
    for packed, expanded in zip(completions[False], completions[True], strict=True):
        tie = min(first_near_tie(packed, gap=1e-3), first_near_tie(expanded, gap=1e-3))
        assert tie >= 8
        assert packed.token_ids[:tie] == expanded.token_ids[:tie]
        for ours, theirs in zip(packed.logprobs[:tie], expanded.logprobs[:tie], strict=True):
            assert abs(ours.logprob - theirs.logprob) < 1e-3
