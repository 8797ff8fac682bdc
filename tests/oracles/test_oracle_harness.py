"""The nemo DeepSeek-V4.1 oracle harness: causal, loads what it exports, names as released."""

from __future__ import annotations

import pytest
import torch

from .deepseek_v41_nemo import (
    build_oracle,
    greedy_recompute,
    nemo_attention,
    oracle_logits,
    random_released_weights,
    released_state_dict,
    tiny_text_config,
    tiny_tokenizer,
)

CONFIG = tiny_text_config()
TOKENIZER = tiny_tokenizer()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_released_weights(CONFIG, TOKENIZER, seed=0)


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))


def test_every_prefix_gives_the_full_sequence_logits_with_cache_quantization_off(
    weights, input_ids
) -> None:
    model = build_oracle(CONFIG, TOKENIZER, weights, quantize_cache=False)
    full = oracle_logits(model, input_ids)
    assert full.shape == (2, 32, CONFIG["vocab_size"]) and full.dtype == torch.float32
    for length in range(1, input_ids.shape[1]):
        prefix = oracle_logits(model, input_ids[:, :length])
        torch.testing.assert_close(prefix, full[:, :length], rtol=0, atol=1e-5)


def test_exported_weights_load_back_to_identical_logits(weights, input_ids) -> None:
    model = build_oracle(CONFIG, TOKENIZER, weights, quantize_cache=True)
    exported = released_state_dict(model)
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
    reloaded = build_oracle(CONFIG, TOKENIZER, exported, quantize_cache=True, seed=5)
    assert torch.equal(oracle_logits(reloaded, input_ids), oracle_logits(model, input_ids))


def test_weights_use_the_released_checkpoint_names(weights) -> None:
    for name in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "layers.3.attn.compressor.wgate.weight",
        "layers.3.attn.indexer.wq_b.weight",
        "layers.3.attn.attn_sink",
        "layers.3.hc_attn_fn",
        "layers.3.ffn.gate.bias",
        "layers.3.ffn.experts.0.w1.weight",
        "layers.3.ffn.shared_experts.w2.weight",
        "layers.3.engram.embed.weight",
    ):
        assert name in weights
    assert not any(name.startswith(("model.", "mtp.")) for name in weights)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in weights.values())
    # Released layout is [out, in]: w1 maps hidden to the expert width.
    assert weights["layers.3.ffn.experts.0.w1.weight"].shape == (32, 64)
    # The Engram table has exactly the config's rows.
    assert weights["layers.3.engram.embed.weight"].shape == (480, 16)


def test_random_weights_leave_no_initializer_constant_and_follow_the_seed(weights) -> None:
    randomised = ("norm.weight", "hc_attn_base", "hc_ffn_scale", "attn_sink", "gate.bias")
    randomised += ("engram.q_weight", "engram.k_weight")
    checked = [n for n in weights if n.endswith(randomised)]
    assert len(checked) > 60
    assert all(weights[n].unique().numel() > 1 for n in checked)
    again = random_released_weights(CONFIG, TOKENIZER, seed=0)
    other = random_released_weights(CONFIG, TOKENIZER, seed=1)
    assert all(torch.equal(again[n], weights[n]) for n in weights)
    assert not torch.equal(other["layers.0.attn.attn_sink"], weights["layers.0.attn.attn_sink"])


def test_cache_quantization_off_changes_only_that_models_forwards(weights, input_ids) -> None:
    quantized = build_oracle(CONFIG, TOKENIZER, weights, quantize_cache=True)
    before = oracle_logits(quantized, input_ids)
    exact = build_oracle(CONFIG, TOKENIZER, weights, quantize_cache=False)
    original = nemo_attention.quantize_cache
    unquantized = oracle_logits(exact, input_ids)
    assert nemo_attention.quantize_cache is original
    assert not torch.equal(unquantized, before)
    assert torch.equal(oracle_logits(quantized, input_ids), before)


def test_a_missing_released_tensor_is_refused(weights) -> None:
    incomplete = {n: t for n, t in weights.items() if n != "layers.4.attn.indexer.wk.weight"}
    with pytest.raises(RuntimeError, match="indexer.wk"):
        build_oracle(CONFIG, TOKENIZER, incomplete, quantize_cache=False)


def test_greedy_recompute_takes_the_argmax_after_each_prefix(weights, input_ids) -> None:
    model = build_oracle(CONFIG, TOKENIZER, weights, quantize_cache=False)
    prompt = input_ids[:, :12]
    generated = greedy_recompute(model, prompt, 4)
    assert generated.shape == (2, 4)
    logits = oracle_logits(model, torch.cat([prompt, generated], dim=1))
    torch.testing.assert_close(logits[:, 11:15].argmax(-1), generated, rtol=0, atol=0)
