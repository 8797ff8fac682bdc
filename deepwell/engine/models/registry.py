"""Model registry: HF architecture name → model class.

A model class takes (config, attention backend class, dtype), declares `kv_layout()`, and loads
HF-named tensors with `load_weights`.
"""

from typing import Any

import torch
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.attention import AttentionBackend
from deepwell.engine.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def build_model(
    architecture: str,
    hf_config: dict[str, Any],
    backend_class: type[AttentionBackend],
    dtype: torch.dtype,
) -> nn.Module:
    model_class = MODELS.get(architecture)
    if model_class is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}"
        )
    config = model_class.config_class.from_hf(hf_config)
    return model_class(config, backend_class, dtype)
