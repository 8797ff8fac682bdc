"""A small random Llama checkpoint built on the fly (seeded), and a step-until-idle driver."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepwell.engine import EngineCore

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random Llama checkpoint directory (config.json + model.safetensors)."""
    c = TINY_CONFIG
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.5

    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    tensors = {
        "model.embed_tokens.weight": randn(c["vocab_size"], hidden),
        "model.norm.weight": 1 + 0.1 * randn(hidden),
        "lm_head.weight": randn(c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + 0.1 * randn(hidden),
            p + "post_attention_layernorm.weight": 1 + 0.1 * randn(hidden),
            p + "self_attn.q_proj.weight": randn(hidden, hidden) / 4,
            p + "self_attn.k_proj.weight": randn(kv, hidden) / 4,
            p + "self_attn.v_proj.weight": randn(kv, hidden) / 4,
            p + "self_attn.o_proj.weight": randn(hidden, hidden) / 4,
            p + "mlp.gate_proj.weight": randn(inter, hidden) / 4,
            p + "mlp.up_proj.weight": randn(inter, hidden) / 4,
            p + "mlp.down_proj.weight": randn(hidden, inter) / 4,
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def run_to_completion(core: EngineCore) -> dict[str, list[int]]:
    """Step until idle; request id → generated tokens."""
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens
