"""The architectures deepwell knows, torch-free: how each is detected, planned and prompted.

The HTTP process (serve/model.py), the command line and the memory planner read this table
without loading torch; the engine's registry (registry.py) adds the model class and its
checkpoint loader to the architectures the engine runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepwell.engine.models.deepseek_v41.schema import (
    ARCHITECTURE as DEEPSEEK_V41,
)
from deepwell.engine.models.deepseek_v41.schema import (
    is_deepseek_v41_config,
    routed_experts_per_layer,
)
from deepwell.engine.plan.deepseek_v41 import v41_footprint
from deepwell.engine.plan.dense import dense_footprint
from deepwell.engine.plan.footprint import ModelFootprint

# (config.json, architecture name, block size, compute dtype or None) → what the model holds.
Footprint = Callable[[Mapping[str, Any], str, int, "str | None"], ModelFootprint]

# The prompt encodings that are not the model's own chat template (recipe/encoding/).
DEEPSEEK_V4_ENCODING = "deepseek_v4"
DEEPSEEK_V41_ENCODING = "deepseek_v41"


@dataclass(frozen=True)
class Architecture:
    """One HF architecture name (config.json's `architectures`) and what deepwell does with it."""

    name: str
    # What `deepwell plan` and the engine's pre-load check compute; None: not planned.
    footprint: Footprint | None = None
    # The encoding that renders its prompts (DEEPSEEK_*_ENCODING); None: its chat template.
    prompt_encoding: str | None = None
    # The API model version its encoding speaks (a recipe ModelVersion value).
    model_version: str | None = None
    # Recognises its config.json whatever `architectures` lists first (e.g. by model_type).
    detect: Callable[[Mapping[str, Any]], bool] | None = None
    # Routed experts per MoE layer, from config.json (expert parallelism); None: no MoE.
    routed_experts: Callable[[Mapping[str, Any]], int] | None = None
    # False: known for its prompt encoding only (--mock, tokenize); the engine refuses it.
    engine_runs: bool = True


def _v41_footprint(
    config: Mapping[str, Any], architecture: str, block_size: int, compute_dtype: str | None
) -> ModelFootprint:
    # Weights and caches stay in their released encodings whatever the compute dtype.
    return v41_footprint(config, block_size)


ARCHITECTURES: dict[str, Architecture] = {
    entry.name: entry
    for entry in (
        Architecture("LlamaForCausalLM", dense_footprint),
        Architecture("Qwen2ForCausalLM", dense_footprint),
        Architecture("Qwen3ForCausalLM", dense_footprint),
        Architecture(
            DEEPSEEK_V41,
            _v41_footprint,
            DEEPSEEK_V41_ENCODING,
            "DeepSeek-V4.1-Flash",
            detect=is_deepseek_v41_config,
            routed_experts=routed_experts_per_layer,
        ),
        # V4-Pro's prompts render (its encoding is the recipe's), its weights do not load.
        Architecture(
            "DeepseekV4ForCausalLM",
            prompt_encoding=DEEPSEEK_V4_ENCODING,
            model_version="DeepSeek-V4-Pro",
            engine_runs=False,
        ),
    )
}


def architecture_named(name: str) -> Architecture:
    """The table's entry for `name`; an unlisted name runs with no plan and its chat template."""
    return ARCHITECTURES.get(name) or Architecture(name)


def architecture_of(config: Mapping[str, Any]) -> Architecture | None:
    """The architecture a config.json describes: one that recognises it, else the first name in
    `architectures`; None when it names none."""
    for entry in ARCHITECTURES.values():
        if entry.detect is not None and entry.detect(config):
            return entry
    names = config.get("architectures") or []
    return architecture_named(names[0]) if names else None
