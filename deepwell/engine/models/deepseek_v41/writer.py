"""Write tiny random DeepSeek-V4.1 checkpoints in exactly the released layout.

Seeded weights, quantised as released (spec §3.8), sharded with an index (a weight and its
scale may land in different shards), config.json and a tokenizer: enough to run the
DeepSeek path on a laptop and to test the loader without the real 475 GiB.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from deepwell.engine.models.deepseek_v41.checkpoint import INDEX_FILE
from deepwell.engine.models.deepseek_v41.engram_hash import EngramHashConfig, engram_sizes
from deepwell.engine.models.deepseek_v41.schema import (
    ARCHITECTURE,
    MODEL_TYPE,
    TensorSpec,
    tensor_schema,
    vision_schema,
)
from deepwell.engine.models.deepseek_v41.weight_formats import (
    WeightFormat,
    dequantize,
    e8m0_from_exponent,
    quantize,
)

# spec §1.3: the released 40-layer schedule in miniature (8 backbone layers + 3 draft
# stages). The tokenizer-dependent fields are filled in by the writer.
TINY_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=16,
    o_groups=2,
    swiglu_limit=10.0,
    rms_norm_eps=1e-20,
    max_position_embeddings=1048576,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    sliding_window=8,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    kv_source_layer_ids=[1, 3, 4],
    index_source_layer_ids=[1, 3, 4, 6],
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    candidate_source_layer_id=4,
    candidate_topk_blocks=3,
    candidate_block_size=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    engram_layer_ids=[0, 3],
    engram_num_embeddings=[408, 480],
    engram_max_ngram_size=3,
    engram_vocab_size=97,
    engram_n_heads=2,
    engram_head_dim=16,
    engram_pad_token_id=2,
    engram_compressed_vocab_size=128,
    num_nextn_predict_layers=3,
    dspark_block_size=4,
    dspark_noise_token_id=255,
    dspark_target_layer_ids=[5, 6, 7],
    dspark_markov_rank=16,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    pad_token_id=2,
    bos_token_id=0,
    eos_token_id=1,
)

# The tiny schedule at widths 4x larger, with 4-grams as released: slower, more realistic.
SMALL_TEXT_CONFIG: dict[str, Any] = TINY_TEXT_CONFIG | dict(
    hidden_size=256,
    moe_intermediate_size=128,
    num_attention_heads=8,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    sliding_window=32,
    index_head_dim=64,
    index_topk=16,
    candidate_topk_blocks=4,
    candidate_block_size=8,
    engram_max_ngram_size=4,
    engram_vocab_size=1009,
    engram_n_heads=4,
    engram_head_dim=32,
    dspark_block_size=5,
    dspark_markov_rank=32,
    dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=3,
)

# The tiny schedule at a size where loading and memory matter (~1.1 GiB on disk): wide
# enough that every product is a real matrix, and enough routed experts that their MXFP4
# bytes are most of the checkpoint, as in the release (spec §3.8).
MEDIUM_TEXT_CONFIG: dict[str, Any] = SMALL_TEXT_CONFIG | dict(
    hidden_size=1024,
    moe_intermediate_size=512,
    num_attention_heads=16,
    head_dim=128,
    qk_rope_head_dim=64,
    q_lora_rank=512,
    o_lora_rank=256,
    o_groups=4,
    n_routed_experts=160,
    num_experts_per_tok=4,
    sliding_window=64,
    index_head_dim=64,
    dspark_n_routed_experts=32,
    dspark_markov_rank=64,
    # A 64K context: one full-length sequence's KV (~45 MiB) stays small beside the weights.
    max_position_embeddings=65536,
)

# The released layer schedule and cache widths (spec §3, §3.1) over the tiny sizes: the KV
# layout depends on nothing else, so its bytes are the real model's (tests, benchmarks).
RELEASED_CACHE_SHAPE: dict[str, Any] = TINY_TEXT_CONFIG | dict(
    num_hidden_layers=40,
    head_dim=512,
    qk_rope_head_dim=64,
    index_head_dim=128,
    sliding_window=128,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer_id=20,
    engram_layer_ids=[1, 14],
    num_nextn_predict_layers=3,
    dspark_target_layer_ids=[37, 38, 39],
)

# A vision tower small enough for tests: 2 ViT layers 32 wide, 4-pixel patches, the
# released 2D RoPE theta and 3x3 downsampling. The sizing fields are the released ones.
TINY_VISION_CONFIG: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=48,
    patch_size=4,
    rope_theta=10000.0,
    downsample_ratio=3,
    max_image_tokens=1024,
    min_pixels=295936,
    max_wh_ratio=None,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY_TEXT_CONFIG,
    "small": SMALL_TEXT_CONFIG,
    "medium": MEDIUM_TEXT_CONFIG,
}
# Presets whose MXFP4 experts are drawn as random codes (draw_stored): rounding ~2G random
# floats into MXFP4 would take minutes.
DRAWN_STORED_PRESETS = ("medium",)
# Drawn MXFP4 codes are uniform over E2M1 (RMS 2.93); this scale brings them to ~0.02.
_DRAWN_MXFP4_EXPONENT = -7

# config.json's quantization_config as released (DeepInfer accepts exactly this).
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# The control tokens of the V4/V4.1 chat encoding: deepwell.recipe's SpecialToken spellings
# (spec/recipe.md §3). The engine never imports recipe; a test keeps the two lists equal.
CHAT_TOKENS = (
    "<think>",
    "</think>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
)
SYSTEM = "<｜System｜>"
IMAGE = "<｜image｜>"
GROUNDING_TOKENS = (
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
)
# The released drafter's noise token (128799) is this placeholder of DeepSeek's vocabulary.
DSPARK_NOISE = "<｜place▁holder▁no▁799｜>"
# Without a shard size, the tensors are spread over about this many shards.
DEFAULT_SHARDS = 6


@dataclass
class WrittenCheckpoint:
    """What `write_tiny_checkpoint` wrote: the config and each tensor before storage rounding
    (empty when the writer was asked not to keep them)."""

    path: Path
    config: dict[str, Any]
    weights: dict[str, torch.Tensor]  # released name → float32 [logical shape]
    shards: list[str]
    tensors: int  # released tensors, scales not counted
    parameters: int  # their logical parameters


def write_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    text_config: Mapping[str, Any] | None = None,
    tokenizer_json: str | Path | None = None,
    shard_bytes: int | None = None,
    keep_weights: bool = True,
    draw_stored: bool = False,
    vision_config: Mapping[str, Any] | None = None,
) -> WrittenCheckpoint:
    """Write a random V4.1 checkpoint into the directory `path` (created if needed).

    text_config defaults to the spec §1.3 tiny config. The tokenizer is a byte-level one
    with DeepSeek's control tokens, or a copy of `tokenizer_json`; either way the fields
    that depend on it (vocab_size, the special ids, the Engram sizes, the DSpark noise
    token) are set from it. A shard closes after shard_bytes (default: total /
    DEFAULT_SHARDS) at the next quantised weight, whose scale then opens the next shard.
    Shards are drawn and written one at a time, so only one shard is ever in memory, plus
    the float32 weights when `keep_weights` (for tests comparing against them). With
    `draw_stored` the MXFP4 tensors are drawn as random codes under one scale (their float
    weights are what those decode to), not rounded from random floats: much faster. With
    `vision_config` (e.g. TINY_VISION_CONFIG) the vision tower is written too.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        tokenizer = byte_level_tokenizer()
        tokenizer.save(str(path / "tokenizer.json"))
    else:
        tokenizer = _v41_tokenizer(Path(tokenizer_json))
        tokenizer.save(str(path / "tokenizer.json"))
    text = _fit_to_tokenizer(
        dict(TINY_TEXT_CONFIG if text_config is None else text_config), tokenizer
    )
    config = _model_config(text, tokenizer, vision_config)
    (path / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _write_tokenizer_config(path, text)

    schema = tensor_schema(text) | vision_schema(config["vision_config"], text["hidden_size"])
    groups = _shard_plan(schema, shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    stored: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0
    specs = iter(schema.values())
    for file, names in zip(files, groups, strict=True):
        shard: dict[str, torch.Tensor] = {}
        while len(shard) < len(names):
            if names[len(shard)] not in stored:  # the shard opens on a scale drawn before
                spec = next(specs)
                if draw_stored and spec.format is WeightFormat.MXFP4:
                    data, scale = random_mxfp4(spec, generator)
                    value = dequantize(spec.format, data, scale) if keep_weights else None
                else:
                    value = random_weight(spec, generator)
                    data, scale = quantize(spec.format, value)
                if value is not None and keep_weights:
                    weights[spec.name] = value
                stored[spec.name] = data
                if spec.scale_name is not None:
                    stored[spec.scale_name] = scale
            name = names[len(shard)]
            shard[name] = stored.pop(name)
        save_file(shard, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    parameters = sum(math.prod(spec.shape) for spec in schema.values())
    return WrittenCheckpoint(path, config, weights, files, len(schema), parameters)


def byte_level_tokenizer() -> Tokenizer:
    """DeepSeek's first three ids (BOS, EOS, pad), one token per byte, then the control
    tokens the V4/V4.1 chat encoding needs and the DSpark noise placeholder."""
    vocab = {BOS: 0, EOS: 1, PAD: 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # As in DeepSeek's tokenizer.json: the sentence, image and grounding tokens are special
    # (skipped when decoding with skip_special_tokens), the chat tokens are not.
    special = {BOS, EOS, PAD, IMAGE, *GROUNDING_TOKENS, DSPARK_NOISE}
    spellings = [BOS, EOS, PAD, *CHAT_TOKENS, IMAGE, *GROUNDING_TOKENS, DSPARK_NOISE]
    tokenizer.add_tokens(
        [AddedToken(text, special=text in special, normalized=False) for text in spellings]
    )
    return tokenizer


def _v41_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer file as V4.1 needs it. DeepSeek's V4 file has no `<｜System｜>`: V4.1
    spells its placeholder 799 that way (spec/recipe.md §3), so a V4 file gets that one
    token renamed; the ids stay."""
    try:
        text = path.read_text()
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"cannot read tokenizer {str(path)!r}: {error}") from error
    if tokenizer.token_to_id(SYSTEM) is None and tokenizer.token_to_id(DSPARK_NOISE) is not None:
        tokenizer = Tokenizer.from_str(text.replace(DSPARK_NOISE, SYSTEM))
    return tokenizer


def _fit_to_tokenizer(text: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """The text config with its tokenizer-dependent fields set from `tokenizer`."""
    ids = {spelling: tokenizer.token_to_id(spelling) for spelling in (BOS, EOS, PAD)}
    missing = [spelling for spelling, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"the tokenizer lacks DeepSeek's {', '.join(missing)}")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    # The released drafter's noise id (128799) is V4.1's `<｜System｜>` in a renamed V4 file.
    noise = tokenizer.token_to_id(DSPARK_NOISE)
    if noise is None:
        noise = tokenizer.token_to_id(SYSTEM)
    text |= dict(
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        engram_pad_token_id=ids[PAD],
        # A tokenizer without the placeholder gives its last id to the noise token.
        dspark_noise_token_id=vocab_size - 1 if noise is None else noise,
    )
    sizes = engram_sizes(tokenizer, EngramHashConfig.from_text_config(text))
    text["engram_compressed_vocab_size"] = sizes.compressed_vocab_size
    text["engram_num_embeddings"] = list(sizes.num_embeddings)
    return text


def _model_config(
    text: dict[str, Any], tokenizer: Tokenizer, vision: Mapping[str, Any] | None
) -> dict[str, Any]:
    """config.json as released: the text config nested under the model config."""
    image = tokenizer.token_to_id(IMAGE)
    ids = {key: text[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "dtype": "bfloat16",
        "image_token_id": text["vocab_size"] - 1 if image is None else image,
        **ids,
        "tie_word_embeddings": False,
        "quantization_config": QUANTIZATION_CONFIG,
        "text_config": {"model_type": f"{MODEL_TYPE}_text", **text, "dtype": "bfloat16"},
        "vision_config": {
            "model_type": f"{MODEL_TYPE}_vision",
            **({"num_hidden_layers": 0} if vision is None else vision),
        },
    }


def _write_tokenizer_config(path: Path, text: dict[str, Any]) -> None:
    # No chat_template: DeepSeek renders V4.1 prompts with its own encoder (deepwell.recipe).
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": text["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    )


def random_weight(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """Random values of a sensible size for each kind of tensor, float32.

    The constants nemo initialises (norms at 1, mHC base 0 and scale 1, zero sinks and
    biases, Engram q/k at 1) are randomised too, so a test exercises them (spec §1.3).
    """
    name = spec.name

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(spec.shape, generator=generator)

    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", ".q_weight", ".k_weight")):
        return normal(0.1, mean=1.0)
    if name.startswith(("vision.", "aligner.")):
        # Unit-variance activations: attention scores of order one, so the 2D RoPE and
        # every patch matter to the image's embeddings.
        return normal(spec.shape[-1] ** -0.5 if len(spec.shape) == 2 else 0.1)
    if name.startswith("image_"):
        return normal(0.1)
    if name.endswith("_base"):
        return normal(0.5)
    if name.endswith("_scale"):
        return 0.5 + torch.rand(spec.shape, generator=generator)
    if name.endswith(".attn_sink"):
        return normal(1.0)
    if name.endswith((".gate.bias", ".gate.bias_vl")):
        return normal(0.1)
    return normal(0.02)


def random_mxfp4(spec: TensorSpec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random E2M1 code pairs and one power-of-two scale for all groups."""
    codes = torch.randint(
        0, 256, spec.format.stored_shape(spec.shape), generator=generator, dtype=torch.uint8
    )
    scale_shape = spec.format.scale_shape(spec.shape)
    exponent = torch.full(scale_shape, _DRAWN_MXFP4_EXPONENT, dtype=torch.int32)
    return codes.view(torch.int8), e8m0_from_exponent(exponent)


def _shard_plan(schema: Mapping[str, TensorSpec], shard_bytes: int | None) -> list[list[str]]:
    """The stored names of each shard, in schema order (each scale right after its weight).

    A shard closes once it holds shard_bytes, right after a quantised weight: its scale
    opens the next shard, so every boundary splits a pair, as the release's index may.
    """
    sizes: dict[str, int] = {}
    for spec in schema.values():
        sizes[spec.name] = math.prod(spec.format.stored_shape(spec.shape)) * (
            spec.format.stored_dtype.itemsize
        )
        scale_shape = spec.format.scale_shape(spec.shape)
        if spec.scale_name is not None and scale_shape is not None:
            sizes[spec.scale_name] = math.prod(scale_shape)
    if shard_bytes is None:
        shard_bytes = -(-sum(sizes.values()) // DEFAULT_SHARDS)
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        groups[-1].append(name)
        size += nbytes
        has_scale = name.endswith(".weight") and name.removesuffix(".weight") + ".scale" in sizes
        if size >= shard_bytes and has_scale:
            groups.append([])
            size = 0
    if not groups[-1]:
        groups.pop()
    return groups
