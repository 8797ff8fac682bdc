"""A tiny V4.1 checkpoint through the Triton kernel set (Triton's interpreter on the CPU):
its attention, indexer, packed linears and experts run the Triton kernels and give the
default path's greedy tokens in float32."""

import os

import pytest

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.build import load_model
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from ...near_ties import first_near_tie

# Triton reads the switch when a kernel is decorated, which is when the kernel set first
# imports the kernels (models/deepseek_v41/kernel_set.py): before any test here runs.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def args(checkpoint, **kwargs) -> EngineArgs:
    defaults = dict(
        model=str(checkpoint), dtype="float32", max_model_len=128, block_size=16, memory_gib=0.5
    )
    return EngineArgs(**(defaults | kwargs))


def test_the_triton_set_runs_attention_indexer_linears_and_experts(checkpoint) -> None:
    from deepwell.engine.layers.triton.fp8_block_gemm import fp8_block_gemm
    from deepwell.engine.layers.triton.indexer_topk import top_k_ids
    from deepwell.engine.layers.triton.mxfp4_experts import mxfp4_expert_gemm
    from deepwell.engine.layers.triton.sink_attention import TritonSinkAttention

    model = load_model(args(checkpoint, kernels="triton")).model
    layer = model.layers[0]
    assert isinstance(layer.attn.backend, TritonSinkAttention)
    assert layer.attn.wq_a.product is fp8_block_gemm
    assert layer.ffn.packed_product is mxfp4_expert_gemm
    indexers = [block.attn.indexer for block in model.layers if block.attn.indexer is not None]
    assert indexers and all(indexer.top_ids is top_k_ids for indexer in indexers)


def test_the_triton_set_gives_the_default_greedy_tokens(checkpoint) -> None:
    # 14 tokens: more entries than the indexer's top-4 at both compress ratios, and four
    # candidate blocks of 4 for the pool's top-3 (the tiny config's).
    prompt = [5, 9, 40, 41, 42, 7, 7, 3, 11, 12, 60, 61, 62, 63]
    greedy = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    completions = {}
    for kernels in ("auto", "triton"):
        llm = LLM(**vars(args(checkpoint, kernels=kernels)), decode_sequence=False)
        (completions[kernels],) = llm.generate(
            prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False
        )
    # float32 either way, but the kernels sum in another order, which could flip a near-tie
    # (random tiny weights give near-flat logits, hence test_binding's 1e-3 nats). This
    # seeded checkpoint and prompt have none on either path in six steps, so the greedy
    # tokens must be identical outright; the logprobs agree to summation order (and the
    # rare KV cache value rounded to its neighbouring fp8 / fp4 code).
    triton, default = completions["triton"], completions["auto"]
    assert first_near_tie(triton, gap=1e-3) == first_near_tie(default, gap=1e-3) == 6
    assert triton.token_ids == default.token_ids
    for ours, theirs in zip(triton.logprobs, default.logprobs, strict=True):
        assert abs(ours.logprob - theirs.logprob) < 1e-3


def test_triton_beside_batch_invariant_mode_is_refused(checkpoint) -> None:
    with pytest.raises(ModelLoadError, match="--kernels triton"):
        load_model(args(checkpoint, kernels="triton", batch_invariant=True))
