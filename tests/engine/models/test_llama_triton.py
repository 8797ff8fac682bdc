"""`--kernels triton` on the Llama path: the Triton attention and glue run (under the
interpreter here) and the greedy tokens are the default kernel set's on its torch path (the
C++ kernels, shared with other checks, are compared with that path in test_cpp_paged.py)."""

import logging

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.layers.triton.paged_attention import TritonPagedAttention
from deepwell.engine.layers.triton.rms_norm import TritonGlue

from ..tiny_llama import run_to_completion

# A prompt of the embedded model's chat smoke prompts (tests/engine/layers/test_cpp_paged.py).
FRANCE = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _tokens(make_core, **kwargs) -> dict[str, list[int]]:
    # Few KV blocks: the interpreter copies each tensor argument's whole storage per launch.
    core = make_core(num_kv_blocks=16, max_model_len=256, **kwargs)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # Repeating prompts: the n-gram drafter proposes drafts, verified a row per query.
    for i in range(3):
        core.add_request(f"r{i}", [5 + i, 9, 13, 5 + i, 9, 13, 5 + i, 9] * (1 + i), params)
    return run_to_completion(core)


def test_tiny_llama_decodes_and_verifies_through_the_triton_kernels(make_core, caplog):
    with caplog.at_level(logging.INFO):
        triton_tokens = _tokens(make_core, kernels="triton", num_speculative_tokens=3)
    assert "kernel set: triton" in caplog.text
    assert triton_tokens == _tokens(make_core, attention_backend="torch", num_speculative_tokens=3)
    assert triton_tokens == _tokens(make_core, kernels="triton", num_speculative_tokens=0)


def test_embedded_model_float32_gives_the_default_paths_greedy_tokens():
    """SmolLM2-135M (9 heads over 3 KV heads, 30 layers) through the Triton set, in the
    default suite as issue 29 asks: 4 tokens (the prefill and three decode steps, ~2 s a step
    in the interpreter) keep it to seconds beside the two model loads."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = {}
    for kernels in ("auto", "triton"):
        llm = LLM(
            dtype="float32",
            kernels=kernels,
            attention_backend="torch",
            num_kv_blocks=2,
            max_model_len=256,
            num_speculative_tokens=0,
            decode_sequence=False,
        )
        if kernels == "triton":
            layer = llm.core.runner.model.layers[0]
            assert type(layer.self_attn.backend) is TritonPagedAttention
            assert layer.glue is TritonGlue
        tokens[kernels] = [c.token_ids for c in llm.generate([FRANCE], greedy, use_tqdm=False)]
        del llm
    assert tokens["triton"] == tokens["auto"]
