"""DeepSeek-V4.1's footprint: its released tensors in their released encodings, and its
caches in theirs (spec §3.7, §3.8, §4).

Weights come from the checkpoint schema (models/deepseek_v41/schema.py), so the plan counts
exactly the tensors the loader reads; the KV follows the model's kv_layout().
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.cache_rows import (
    fp8_row_bytes,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
)
from deepwell.engine.models.deepseek_v41.config import MAX_BACKTRACK, DeepseekV41Config
from deepwell.engine.models.deepseek_v41.schema import (
    ARCHITECTURE,
    TensorSpec,
    is_draft_stage,
    is_routed_expert,
    tensor_schema,
    vision_schema,
)
from deepwell.engine.models.deepseek_v41.weight_layout import WeightFormat
from deepwell.engine.plan.footprint import (
    KVFootprint,
    ModelFootprint,
    StatePart,
    Weights,
    WeightShare,
)

# A token id as the engine carries it (int64), for the Engram n-gram history.
TOKEN_ID_BYTES = 8

KINDS = ("routed experts", "Engram tables", "DSpark stages", "vision tower", "rest")
ENCODINGS = {
    WeightFormat.MXFP4: "MXFP4 (E2M1, E8M0 per 32)",
    WeightFormat.FP8_ROWS: "FP8 E4M3, E8M0 per row and 32",
    WeightFormat.FP8_BLOCKS: "FP8 E4M3, E8M0 per 32x32",
    WeightFormat.BF16: "BF16",
    WeightFormat.F32: "F32",
}


def v41_footprint(hf_config: Mapping[str, Any], block_size: int) -> ModelFootprint:
    """The footprint of a V4.1 config.json (text config nested under `text_config`)."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("a DeepSeek-V4.1 config.json needs a text_config object")
    config = DeepseekV41Config.from_hf(dict(hf_config))
    try:
        text_specs = tensor_schema(text)
    except KeyError as error:
        raise ModelLoadError(f"text_config lacks {error.args[0]!r}") from error
    vision = vision_schema(hf_config.get("vision_config") or {}, config.hidden_size)
    return ModelFootprint(
        architecture=ARCHITECTURE,
        weights=_weights([*text_specs.values(), *vision.values()], set(vision)),
        kv=_kv(config, block_size),
        max_context=config.max_position_embeddings,
    )


def _weights(specs: list[TensorSpec], vision_names: set[str]) -> Weights:
    by_kind = {kind: [0, 0, 0] for kind in KINDS}
    by_encoding = {encoding: [0, 0, 0] for encoding in ENCODINGS.values()}
    for spec in specs:
        row = (
            1 + spec.format.quantized,
            math.prod(spec.shape),
            spec.format.stored_bytes(spec.shape),
        )
        for totals in (
            by_kind[_kind(spec.name, vision_names)],
            by_encoding[ENCODINGS[spec.format]],
        ):
            for i, value in enumerate(row):
                totals[i] += value
    return Weights(
        by_kind=tuple(WeightShare(name, *totals) for name, totals in by_kind.items() if totals[0]),
        by_encoding=tuple(
            WeightShare(name, *totals) for name, totals in by_encoding.items() if totals[0]
        ),
    )


def _kind(name: str, vision_names: set[str]) -> str:
    if name in vision_names:
        return "vision tower"
    if is_draft_stage(name):
        return "DSpark stages"
    if is_routed_expert(name):
        return "routed experts"
    if name.endswith(".engram.embed.weight"):
        return "Engram tables"
    return "rest"


def _kv(config: DeepseekV41Config, block_size: int) -> KVFootprint:
    """Paged compressed KV and index keys of the KV sources; rings and tails per sequence."""
    per_block = 0
    for ratio, sources in config.kv_sources.items():
        if block_size % ratio:
            raise ValueError(f"block size {block_size} is not a multiple of compress ratio {ratio}")
        entry = nvfp4_row_bytes(config.head_dim) + mxfp4_row_bytes(config.index_head_dim)
        per_block += len(sources) * (block_size // ratio) * entry
    ring_rows = config.sliding_window + MAX_BACKTRACK
    window_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    parts = [
        StatePart(
            f"window rings: {config.num_hidden_layers} layers + "
            f"{config.num_nextn_predict_layers} DSpark x {ring_rows} rows x "
            f"{fp8_row_bytes(config.head_dim)} B",
            window_layers * ring_rows * fp8_row_bytes(config.head_dim),
        )
    ]
    for ratio, sources in config.kv_sources.items():
        if ratio > 1:
            rows = ratio - 1 + MAX_BACKTRACK
            # the pending (kv, gate) projections, in float32 (spec §4)
            parts.append(
                StatePart(
                    f"ratio-{ratio} compressor tails: {len(sources)} layers x {rows} rows x "
                    f"2 x {config.head_dim} x 4 B",
                    len(sources) * rows * 2 * config.head_dim * 4,
                )
            )
    if config.engram_layer_ids:
        history = config.engram_max_ngram_size - 1
        parts.append(StatePart(f"Engram history: {history} token ids", history * TOKEN_ID_BYTES))
    return KVFootprint(
        block_size=block_size,
        bytes_per_block=per_block,
        state_parts=tuple(parts),
        encoding="compressed KV nvfp4, index keys mxfp4; window rows fp8",
    )
