"""DeepSeek-V4.1's configuration and layer schedule, read from a released config.json.

The schedule (spec/deepseek_v41.md §3.1) is derived once here: which layers own compressed
KV (Full), which reindex inside the candidate pool (Reindex), which reuse the latest
selection (Reuse), and where Engram reads memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from deepwell.engine.errors import ModelLoadError

# Rows a sequence may roll back (DeepInfer's DEEPINFER_MAX_BACKTRACKING_TOKENS, 6 with 5
# draft tokens): the rings keep them beyond the window (spec/deepinfer.md).
MAX_BACKTRACK = 6


class Selection(Enum):
    """How a compressed layer picks the entries it attends to (spec §3.3)."""

    NONE = "none"  # window only (ratio 0)
    FULL = "full"  # own compressed KV and own indexer over every visible entry
    REINDEX = "reindex"  # own indexer over the source's keys (inside the pool, if any)
    REUSE = "reuse"  # the latest index source's selection


@dataclass(frozen=True)
class LayerPlan:
    index: int
    compress_ratio: int
    selection: Selection
    # Index of the KV source this layer reads (itself when FULL); -1 without one.
    kv_source: int
    # This layer builds the candidate pool / restricts its top-k to the latest pool.
    builds_pool: bool
    uses_pool: bool
    # Position among the Engram layers, or -1.
    engram_slot: int


# The keys a released config must carry: the model has no defaults for them.
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "num_experts_per_tok",
    "sliding_window",
    "compress_ratios",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
)


def _check_text_config(text: dict[str, Any], tied: bool) -> None:
    """Refuse a config the model cannot follow, naming what is wrong."""
    if text.get("tie_word_embeddings") or tied:
        raise ModelLoadError("DeepSeek-V4.1 has an untied head; tie_word_embeddings is set")
    missing = [key for key in _REQUIRED_KEYS if key not in text]
    if missing:
        raise ModelLoadError(f"text_config lacks {', '.join(map(repr, missing))}")
    if text.get("num_key_value_heads", 1) != 1:
        raise ModelLoadError("DeepSeek-V4.1 shares one latent KV head; num_key_value_heads != 1")
    if text.get("n_shared_experts", 1) != 1:
        raise ModelLoadError("DeepSeek-V4.1 has exactly one shared expert")
    if text.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ModelLoadError(f"unsupported MoE scoring_func {text['scoring_func']!r}")


@dataclass(frozen=True)
class DeepseekV41Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict[str, Any] | None
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    # DSpark (spec §3.6): the draft block width, its noise token, the target layers whose
    # attention inputs feed it, the Markov head's rank and the stages' experts.
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    eos_token_ids: tuple[int, ...]
    # Quantise-dequantise the caches in the released formats (fp8 window, fp4 compressed
    # KV and index keys/queries, spec §3.7), as the model was trained and DeepInfer stores
    # them. Off only for exact wiring checks against a reference run without it.
    cache_qdq: bool = True
    # With cache_qdq: keep the caches in their released bytes (spec §4, cache_storage.py).
    # False keeps the rounded values in the compute dtype, which a step reads identically:
    # the reference the packed caches are tested against.
    cache_packed: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV41Config:
        """Read a released config.json (text config nested under `text_config`, or flat)."""
        text = dict(hf.get("text_config") or hf)
        _check_text_config(text, tied=bool(hf.get("tie_word_embeddings")))
        eos = text.get("eos_token_id", hf.get("eos_token_id", 1))
        config = cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            moe_intermediate_size=text["moe_intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            head_dim=text["head_dim"],
            qk_rope_head_dim=text["qk_rope_head_dim"],
            q_lora_rank=text["q_lora_rank"],
            o_lora_rank=text["o_lora_rank"],
            o_groups=text["o_groups"],
            swiglu_limit=float(text.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-20)),
            max_position_embeddings=text.get("max_position_embeddings", 1_048_576),
            rope_theta=float(text.get("rope_theta", 10000.0)),
            compress_rope_theta=float(text.get("compress_rope_theta", 160000.0)),
            rope_scaling=text.get("rope_scaling"),
            n_routed_experts=text["n_routed_experts"],
            num_experts_per_tok=text["num_experts_per_tok"],
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.5)),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            sliding_window=text["sliding_window"],
            compress_ratios=tuple(text["compress_ratios"]),
            kv_source_layer_ids=tuple(text.get("kv_source_layer_ids", ())),
            index_source_layer_ids=tuple(text.get("index_source_layer_ids", ())),
            index_n_heads=text["index_n_heads"],
            index_head_dim=text["index_head_dim"],
            index_topk=text["index_topk"],
            candidate_source_layer_id=text.get("candidate_source_layer_id", -1),
            candidate_topk_blocks=text.get("candidate_topk_blocks", 0),
            candidate_block_size=text.get("candidate_block_size", 1),
            hc_mult=text["hc_mult"],
            hc_sinkhorn_iters=text.get("hc_sinkhorn_iters", 20),
            hc_eps=float(text.get("hc_eps", 1e-6)),
            engram_layer_ids=tuple(text.get("engram_layer_ids", ())),
            engram_num_embeddings=tuple(text.get("engram_num_embeddings", ())),
            engram_max_ngram_size=text.get("engram_max_ngram_size", 4),
            engram_n_heads=text.get("engram_n_heads", 8),
            engram_head_dim=text.get("engram_head_dim", 256),
            engram_pad_token_id=text.get("engram_pad_token_id", 2),
            engram_compressed_vocab_size=text.get("engram_compressed_vocab_size", 0),
            num_nextn_predict_layers=text.get("num_nextn_predict_layers", 0),
            # The release's values (spec §3): what a config that omits them means.
            dspark_block_size=text.get("dspark_block_size", 5),
            dspark_noise_token_id=text.get("dspark_noise_token_id", 128799),
            dspark_target_layer_ids=tuple(text.get("dspark_target_layer_ids", (37, 38, 39))),
            dspark_markov_rank=text.get("dspark_markov_rank", 256),
            dspark_n_routed_experts=text.get("dspark_n_routed_experts", 128),
            dspark_num_experts_per_tok=text.get("dspark_num_experts_per_tok", 3),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
        )
        config.layer_plans()  # a bad schedule fails at load, not at the first forward
        return config

    def layer_plans(self) -> tuple[LayerPlan, ...]:
        """The backbone's layers with their compressed-attention roles (spec §3.1)."""
        ratios = self.compress_ratios
        if len(ratios) < self.num_hidden_layers:
            raise ModelLoadError(
                f"compress_ratios has {len(ratios)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted({r for r in ratios[: self.num_hidden_layers]} - {0, 1, 2})
        if unknown:
            raise ModelLoadError(
                f"compress_ratios holds unknown layer kinds {unknown}: DeepSeek-V4.1 layers "
                "are window-only (0) or compressed at ratio 2 or 1"
            )
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ModelLoadError("engram_num_embeddings needs one entry per engram_layer_ids entry")
        plans = []
        source = -1
        pool_source = -1
        for index, ratio in enumerate(ratios[: self.num_hidden_layers]):
            owns = index in self.kv_source_layer_ids
            indexes = index in self.index_source_layer_ids
            if ratio == 0:
                if owns or indexes:
                    raise ModelLoadError(f"layer {index} is window-only but listed as a source")
                selection, kv_source = Selection.NONE, -1
            elif owns:
                if not indexes:
                    raise ModelLoadError(f"KV source layer {index} must also be an index source")
                selection, kv_source = Selection.FULL, index
                source = index
                pool_source = -1
            else:
                if source < 0 or ratios[source] != ratio:
                    raise ModelLoadError(
                        f"layer {index} (ratio {ratio}) follows no KV source of the same ratio"
                    )
                selection = Selection.REINDEX if indexes else Selection.REUSE
                kv_source = source
            builds_pool = index == self.candidate_source_layer_id
            if builds_pool and selection is not Selection.FULL:
                raise ModelLoadError(f"candidate source layer {index} must be a KV source")
            plans.append(
                LayerPlan(
                    index=index,
                    compress_ratio=ratio,
                    selection=selection,
                    kv_source=kv_source,
                    builds_pool=builds_pool,
                    uses_pool=selection is Selection.REINDEX and 0 <= pool_source < index,
                    engram_slot=(
                        self.engram_layer_ids.index(index) if index in self.engram_layer_ids else -1
                    ),
                )
            )
            if builds_pool:
                pool_source = index
        return tuple(plans)

    @property
    def kv_sources(self) -> dict[int, tuple[int, ...]]:
        """Compress ratio → its KV source layers, in order."""
        sources: dict[int, list[int]] = {}
        for plan in self.layer_plans():
            if plan.selection is Selection.FULL:
                sources.setdefault(plan.compress_ratio, []).append(plan.index)
        return {ratio: tuple(layers) for ratio, layers in sources.items()}
