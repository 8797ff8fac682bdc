"""The footprint of a dense Llama-family config.json (Llama, Qwen2, Qwen3): weights in the
config's dtype, and K and V of every layer for every token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.plan.footprint import KVFootprint, ModelFootprint, Weights, WeightShare

# HF's dtype names → bytes; a config without one holds float32 (transformers' default).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dense_footprint(
    config: Mapping[str, Any],
    architecture: str,
    block_size: int,
    compute_dtype: str | None = None,
) -> ModelFootprint:
    """Weights and KV in the config's dtype, or in `compute_dtype`, which the engine converts
    both to when it loads the model."""
    try:
        vocab, hidden = config["vocab_size"], config["hidden_size"]
        layers, inter = config["num_hidden_layers"], config["intermediate_size"]
        heads = config["num_attention_heads"]
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error.args[0]!r}") from error
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    dtype = compute_dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
    if dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"config.json's dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    itemsize = DTYPE_BYTES[dtype]

    # q, k, v, o, gate, up, down and the two norms of every layer
    layer_tensors = 9
    layer_params = (
        hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    ) + 2 * hidden
    # Qwen2 always biases q, k and v; the others when attention_bias is set.
    if architecture == "Qwen2ForCausalLM" or config.get("attention_bias"):
        layer_tensors += 3
        layer_params += (heads + 2 * kv_heads) * head_dim
    if architecture == "Qwen3ForCausalLM":  # per-head q and k norms
        layer_tensors += 2
        layer_params += 2 * head_dim
    tied = bool(config.get("tie_word_embeddings", False))
    counts = [  # (name, tensors, params)
        (
            "embedding" if tied else "embedding and head",
            1 + (not tied),
            vocab * hidden * (1 + (not tied)),
        ),
        ("layers", layers * layer_tensors, layers * layer_params),
        ("final norm", 1, hidden),
    ]
    shares = tuple(WeightShare(name, n, params, params * itemsize) for name, n, params in counts)
    params = sum(share.params for share in shares)
    tensors = sum(share.tensors for share in shares)
    kv_per_token = layers * kv_heads * head_dim * 2 * itemsize  # K and V
    return ModelFootprint(
        architecture=architecture,
        weights=Weights(
            by_kind=shares,
            by_encoding=(WeightShare(dtype, tensors, params, params * itemsize),),
        ),
        kv=KVFootprint(
            block_size=block_size,
            bytes_per_block=kv_per_token * block_size,
            state_parts=(),
            encoding=f"K and V in {dtype}",
        ),
        max_context=config.get("max_position_embeddings", 4096),
    )
