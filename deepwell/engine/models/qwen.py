"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm): Llama layers with switches.

Only the config reading differs; layers and weight loading are llama.py's.
"""

import dataclasses
from typing import Any

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.llama import LlamaConfig, LlamaForCausalLM


def _check_full_attention(hf: dict[str, Any], family: str) -> None:
    # Sliding-window layers would need an SWA cache spec; released Qwen checkpoints keep it off.
    if hf.get("use_sliding_window"):
        raise ModelLoadError(f"{family} with use_sliding_window is not supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        _check_full_attention(hf, "Qwen2")
        # HF's Qwen2Attention always has q/k/v biases (there is no config switch).
        return LlamaConfig.from_hf(hf | {"attention_bias": True})


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        _check_full_attention(hf, "Qwen3")
        return dataclasses.replace(LlamaConfig.from_hf(hf), qk_norm=True)
