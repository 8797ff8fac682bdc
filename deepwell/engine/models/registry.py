"""Model registry: HF architecture name → model class.

A model class builds itself from a checkpoint (`from_checkpoint(checkpoint, options)`),
declares `kv_layout()`, and loads the checkpoint's tensors with `load_weights`.
"""

from dataclasses import dataclass

import torch
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.attention import AttentionBackend
from deepwell.engine.layers.sink_attention import SinkAttentionBackend, TorchSinkAttention
from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepwell.engine.models.llama import LlamaForCausalLM
from deepwell.engine.models.loader import Checkpoint
from deepwell.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from deepwell.engine.parallel.expert import ExpertSharding


@dataclass(frozen=True)
class ModelOptions:
    dtype: torch.dtype
    # Attention backends per cache role: paged full attention (Llama), window plus
    # selected compressed entries with a sink (DeepSeek-V4.1).
    backend_class: type[AttentionBackend]
    sink_backend_class: type[SinkAttentionBackend] = TorchSinkAttention
    # DeepSeek-V4.1: quantise-dequantise caches in the formats it was trained with.
    quantize_kv_cache: bool = True
    # DeepSeek-V4.1: weights dequantised to `dtype` at load instead of kept as released.
    expand_weights: bool = False
    # DeepSeek-V4.1: build the DSpark draft stages and fill their context rings.
    dspark: bool = False
    # Models whose own layers read rings (DeepSeek-V4.1) take their batch-invariant paths.
    batch_invariant: bool = False
    # DeepSeek-V4.1: its routed experts sharded over expert-parallel ranks (parallel/).
    experts: ExpertSharding | None = None
    # The kernel set ("auto" or "triton", settings/engine.py KERNEL_SETS).
    kernels: str = "auto"


MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV41ForCausalLM": DeepseekV41ForCausalLM,
}


def build_model(checkpoint: Checkpoint, options: ModelOptions) -> nn.Module:
    model_class = MODELS.get(checkpoint.architecture)
    if model_class is None:
        raise ModelLoadError(
            f"unsupported architecture {checkpoint.architecture!r}; supported: {sorted(MODELS)}"
        )
    return model_class.from_checkpoint(checkpoint, options)
