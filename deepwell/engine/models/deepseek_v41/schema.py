"""Every tensor a released DeepSeek-V4.1 checkpoint holds, derived from its text config.

Names, logical shapes and storage formats follow spec §3.8 and nemo-automodel 0.7.0's
state-dict adapter (no `model.` prefix; draft stages under `mtp.K`). Where the two disagree
on an unquantised dtype, the release's byte total decides (docs/engine.md, "Weights, KV and
the plan"): the head, the compressor and the confidence head are BF16, as is the vision tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepwell.engine.models.deepseek_v41.weight_layout import WeightFormat

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
# Where the draft stages sit in a released checkpoint: `mtp.0.`, `mtp.1.`, ...
DRAFT_STAGE_PREFIX = "mtp."


@dataclass(frozen=True)
class TensorSpec:
    """One released tensor: its name, its logical (dequantised) shape, how it is stored."""

    name: str
    shape: tuple[int, ...]
    format: WeightFormat

    @property
    def scale_name(self) -> str | None:
        """The name of its `.scale` companion, for quantised formats."""
        if not self.format.quantized:
            return None
        return self.name.removesuffix(".weight") + ".scale"


def is_deepseek_v41_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json describes a DeepSeek-V4.1 checkpoint."""
    return config.get("model_type") == MODEL_TYPE or ARCHITECTURE in (
        config.get("architectures") or []
    )


def routed_experts_per_layer(config: Mapping[str, Any]) -> int:
    """The routed experts of each MoE layer, from a config.json (text config nested or not)."""
    text = config.get("text_config") or config
    return int(text["n_routed_experts"])


def is_draft_stage(name: str) -> bool:
    """Whether a released tensor belongs to a DSpark draft stage (`mtp.K`)."""
    return name.startswith(DRAFT_STAGE_PREFIX)


def is_routed_expert(name: str) -> bool:
    """Whether a released tensor belongs to a routed expert of a MoE layer."""
    return ".ffn.experts." in name


def tensor_schema(text_config: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Name → spec for every tensor of the checkpoint, backbone then draft stages.

    Raises KeyError naming a config key the schema needs and does not find, ValueError
    for inconsistent Engram lists.
    """
    c = text_config
    hidden = c["hidden_size"]
    specs = [
        TensorSpec("embed.weight", (c["vocab_size"], hidden), WeightFormat.BF16),
        TensorSpec("norm.weight", (hidden,), WeightFormat.BF16),
        # nemo computes the head in fp32 (spec §1.3) but the release stores it in BF16
        # (spec §3.8); the loader accepts either for every unquantised tensor.
        TensorSpec("head.weight", (c["vocab_size"], hidden), WeightFormat.BF16),
    ]
    if len(c["engram_layer_ids"]) != len(c["engram_num_embeddings"]):
        raise ValueError("engram_num_embeddings needs one row count per engram_layer_ids entry")
    engram_rows = dict(zip(c["engram_layer_ids"], c["engram_num_embeddings"], strict=True))
    for layer in range(c["num_hidden_layers"]):
        prefix = f"layers.{layer}"
        specs += _block(c, prefix, experts=c["n_routed_experts"])
        specs += _compressed_attention(c, prefix, layer)
        if layer in engram_rows:
            specs += _engram(c, prefix, engram_rows[layer])
    stages = c["num_nextn_predict_layers"]
    for stage in range(stages):
        prefix = f"mtp.{stage}"
        specs += _block(c, prefix, experts=c["dspark_n_routed_experts"])
        if stage == 0:
            targets = len(c["dspark_target_layer_ids"])
            specs += [
                TensorSpec(f"{prefix}.main_proj.weight", (hidden, targets * hidden), _FP8),
                TensorSpec(f"{prefix}.main_norm.weight", (hidden,), WeightFormat.BF16),
            ]
        if stage == stages - 1:
            rank = c["dspark_markov_rank"]
            specs += [
                TensorSpec(f"{prefix}.norm.weight", (hidden,), WeightFormat.BF16),
                TensorSpec(
                    f"{prefix}.markov_head.embed.weight", (c["vocab_size"], rank), WeightFormat.BF16
                ),
                TensorSpec(
                    f"{prefix}.markov_head.head.weight", (c["vocab_size"], rank), WeightFormat.BF16
                ),
                TensorSpec(
                    f"{prefix}.confidence_head.proj.weight", (1, hidden + rank), WeightFormat.BF16
                ),
            ]
    return {spec.name: spec for spec in specs}


_FP8 = WeightFormat.FP8_BLOCKS


def _block(c: Mapping[str, Any], prefix: str, *, experts: int) -> list[TensorSpec]:
    """What every backbone layer and draft stage has: window attention, MoE, mHC, norms."""
    hidden, heads, head_dim = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    q_rank, groups, o_rank = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    inter, hc = c["moe_intermediate_size"], c["hc_mult"]
    mixes = (2 + hc) * hc  # pre [hc] + post [hc] + comb [hc, hc]  (spec §3.2)
    attn, ffn = f"{prefix}.attn", f"{prefix}.ffn"
    specs = [
        TensorSpec(f"{prefix}.attn_norm.weight", (hidden,), WeightFormat.BF16),
        TensorSpec(f"{prefix}.ffn_norm.weight", (hidden,), WeightFormat.BF16),
        TensorSpec(f"{attn}.wq_a.weight", (q_rank, hidden), _FP8),
        TensorSpec(f"{attn}.q_norm.weight", (q_rank,), WeightFormat.BF16),
        TensorSpec(f"{attn}.wq_b.weight", (heads * head_dim, q_rank), _FP8),
        TensorSpec(f"{attn}.wkv.weight", (head_dim, hidden), _FP8),
        TensorSpec(f"{attn}.kv_norm.weight", (head_dim,), WeightFormat.BF16),
        TensorSpec(f"{attn}.wo_a.weight", (groups * o_rank, heads * head_dim // groups), _FP8),
        TensorSpec(f"{attn}.wo_b.weight", (hidden, groups * o_rank), _FP8),
        TensorSpec(f"{attn}.attn_sink", (heads,), WeightFormat.F32),
        TensorSpec(f"{ffn}.gate.weight", (experts, hidden), WeightFormat.BF16),
        TensorSpec(f"{ffn}.gate.bias", (experts,), WeightFormat.F32),
        TensorSpec(f"{ffn}.gate.bias_vl", (experts,), WeightFormat.F32),
        TensorSpec(f"{ffn}.shared_experts.w1.weight", (inter, hidden), _FP8),
        TensorSpec(f"{ffn}.shared_experts.w3.weight", (inter, hidden), _FP8),
        TensorSpec(f"{ffn}.shared_experts.w2.weight", (hidden, inter), _FP8),
    ]
    for expert in range(experts):
        name = f"{ffn}.experts.{expert}"
        specs += [
            TensorSpec(f"{name}.w1.weight", (inter, hidden), WeightFormat.MXFP4),
            TensorSpec(f"{name}.w3.weight", (inter, hidden), WeightFormat.MXFP4),
            TensorSpec(f"{name}.w2.weight", (hidden, inter), WeightFormat.MXFP4),
        ]
    for sublayer in ("attn", "ffn"):
        specs += [
            TensorSpec(f"{prefix}.hc_{sublayer}_fn", (mixes, hc * hidden), WeightFormat.F32),
            TensorSpec(f"{prefix}.hc_{sublayer}_base", (mixes,), WeightFormat.F32),
            TensorSpec(f"{prefix}.hc_{sublayer}_scale", (3,), WeightFormat.F32),
        ]
    return specs


def _compressed_attention(c: Mapping[str, Any], prefix: str, layer: int) -> list[TensorSpec]:
    """A KV source's compressor and index keys; an index source's own index queries."""
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    index_heads, index_dim = c["index_n_heads"], c["index_head_dim"]
    attn = f"{prefix}.attn"
    specs = []
    if layer in c["kv_source_layer_ids"]:
        specs += [
            TensorSpec(f"{attn}.compressor.wkv.weight", (head_dim, hidden), WeightFormat.BF16),
            TensorSpec(f"{attn}.compressor.norm.weight", (head_dim,), WeightFormat.BF16),
            TensorSpec(f"{attn}.indexer.wk.weight", (index_dim, head_dim), WeightFormat.BF16),
            TensorSpec(f"{attn}.indexer.k_norm.weight", (index_dim,), WeightFormat.BF16),
        ]
        # Ratio 2 pools token pairs with a learned softmax gate; ratio 1 projects each token.
        if c["compress_ratios"][layer] > 1:
            specs.append(
                TensorSpec(f"{attn}.compressor.wgate.weight", (head_dim, hidden), WeightFormat.BF16)
            )
    if layer in c["index_source_layer_ids"]:
        specs += [
            TensorSpec(
                f"{attn}.indexer.wq_b.weight", (index_heads * index_dim, c["q_lora_rank"]), _FP8
            ),
            TensorSpec(
                f"{attn}.indexer.weights_proj.weight", (index_heads, hidden), WeightFormat.BF16
            ),
        ]
    return specs


def _engram(c: Mapping[str, Any], prefix: str, rows: int) -> list[TensorSpec]:
    """The n-gram table and its read (spec §3.5)."""
    hidden, hc = c["hidden_size"], c["hc_mult"]
    width = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"] * c["engram_head_dim"]
    engram = f"{prefix}.engram"
    return [
        TensorSpec(f"{engram}.embed.weight", (rows, c["engram_head_dim"]), WeightFormat.FP8_ROWS),
        # key for each of the hc streams, then one value
        TensorSpec(f"{engram}.wkv.weight", ((hc + 1) * hidden, width), _FP8),
        TensorSpec(f"{engram}.q_weight", (hc, hidden), WeightFormat.BF16),
        TensorSpec(f"{engram}.k_weight", (hc, hidden), WeightFormat.BF16),
    ]


# The vision tower's tensors besides the blocks: the aligner merges downsample² patches into
# one text-width embedding, and three learned embeddings mark an image span.
IMAGE_MARKERS = ("image_start", "image_end", "image_newline")


def vision_schema(vision_config: Mapping[str, Any], hidden_size: int) -> dict[str, TensorSpec]:
    """Name → spec for every tensor of the released vision tower, all BF16.

    nemo 0.7.0 builds it (deepseek_v4/vision.py) only with vision `num_hidden_layers` > 0:
    a ViT over RGB patches (2D RoPE, SwiGLU), then the aligner into the text width
    `hidden_size`. nemo keeps the ViT's norms in fp32; the release stores them in BF16.
    """
    v = vision_config
    layers = v.get("num_hidden_layers", 32)
    if not layers:
        return {}
    width, inter = v.get("hidden_size", 1024), v.get("intermediate_size", 2816)
    patch_inputs = 3 * v.get("patch_size", 14) ** 2
    merged = width * v.get("downsample_ratio", 3) ** 2
    bf16 = WeightFormat.BF16
    specs = [
        TensorSpec("vision.patch_embed.proj.weight", (width, patch_inputs), bf16),
        TensorSpec("vision.patch_embed.proj.bias", (width,), bf16),
    ]
    for block in range(layers):
        prefix = f"vision.blocks.{block}"
        specs += [
            TensorSpec(f"{prefix}.norm1.weight", (width,), bf16),
            TensorSpec(f"{prefix}.attn.wqkv.weight", (3 * width, width), bf16),
            TensorSpec(f"{prefix}.attn.wqkv.bias", (3 * width,), bf16),
            TensorSpec(f"{prefix}.attn.wo.weight", (width, width), bf16),
            TensorSpec(f"{prefix}.attn.wo.bias", (width,), bf16),
            TensorSpec(f"{prefix}.norm2.weight", (width,), bf16),
            # gate and up stacked: [2 * inter, width]
            TensorSpec(f"{prefix}.mlp.w1.weight", (2 * inter, width), bf16),
            TensorSpec(f"{prefix}.mlp.w2.weight", (width, inter), bf16),
        ]
    specs += [
        TensorSpec("vision.norm.weight", (width,), bf16),
        TensorSpec("aligner.w1.weight", (hidden_size, merged), bf16),
        TensorSpec("aligner.w1.bias", (hidden_size,), bf16),
        TensorSpec("aligner.w2.weight", (hidden_size, hidden_size), bf16),
        TensorSpec("aligner.w2.bias", (hidden_size,), bf16),
    ]
    specs += [TensorSpec(name, (hidden_size,), bf16) for name in IMAGE_MARKERS]
    return {spec.name: spec for spec in specs}
