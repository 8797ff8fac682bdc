"""Model registry: HF architecture name → the model class the engine runs and its checkpoint
loader.

A model class implements the contract (contract.py: `CausalLM`): it builds itself from a
checkpoint (`from_checkpoint(checkpoint, options)`), declares `kv_layout()`, loads the
checkpoint's tensors with `load_weights` and offers its optional parts through `hooks()`.
How an architecture is detected, planned and prompted is torch-free, in architectures.py.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.attention import AttentionBackend
from deepwell.engine.layers.forced_routing import ForcedRouting
from deepwell.engine.layers.sink_attention import SinkAttentionBackend, TorchSinkAttention
from deepwell.engine.models.architectures import (
    Architecture,
    architecture_named,
    architecture_of,
)
from deepwell.engine.models.contract import CausalLM, ImageEncoder
from deepwell.engine.models.deepseek_v41.checkpoint import load_v41_checkpoint
from deepwell.engine.models.deepseek_v41.dummy import dummy_checkpoint as v41_dummy_checkpoint
from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepwell.engine.models.deepseek_v41.schema import DRAFT_STAGE_PREFIX
from deepwell.engine.models.deepseek_v41.vision import load_image_encoder as load_v41_encoder
from deepwell.engine.models.llama import LlamaForCausalLM
from deepwell.engine.models.loader import Checkpoint, _read_config, read_safetensors_dir
from deepwell.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from deepwell.engine.parallel.expert import ExpertSharding

# Reads a checkpoint directory (path, and with expert parallelism which routed experts to read).
DirectoryLoader = Callable[[Path, "Callable[[int], bool] | None"], Checkpoint]


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
    # DeepSeek-V4.1: a test override of its MoE routing (DEEPWELL_FORCE_LOAD_BALANCE,
    # DEEPWELL_FORCE_IMBALANCE_RATIO); None routes by the router's scores.
    forced_routing: ForcedRouting | None = None


@dataclass(frozen=True)
class ModelEntry:
    """An architecture the engine runs: its model class and how its checkpoints are read."""

    name: str
    model_class: type[CausalLM]
    load_checkpoint: DirectoryLoader = read_safetensors_dir
    # Where its draft stages sit among the checkpoint's tensors (DSpark); None: it has none.
    draft_stage_prefix: str | None = None
    # Its vision tower alone from a checkpoint directory (an encoder worker's model); None:
    # the architecture takes no images.
    load_image_encoder: Callable[[Path, torch.dtype], ImageEncoder] | None = None

    @property
    def architecture(self) -> Architecture:
        """How it is detected, planned and prompted (architectures.py)."""
        return architecture_named(self.name)

    def has_draft_stages(self, checkpoint: Checkpoint) -> bool:
        prefix = self.draft_stage_prefix
        return prefix is not None and any(name.startswith(prefix) for name in checkpoint.tensors)


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry("LlamaForCausalLM", LlamaForCausalLM),
        ModelEntry("Qwen2ForCausalLM", Qwen2ForCausalLM),
        ModelEntry("Qwen3ForCausalLM", Qwen3ForCausalLM),
        ModelEntry(
            "DeepseekV41ForCausalLM",
            DeepseekV41ForCausalLM,
            load_v41_checkpoint,
            draft_stage_prefix=DRAFT_STAGE_PREFIX,
            load_image_encoder=load_v41_encoder,
        ),
    )
}


def dummy_checkpoint(path: str, seed: int) -> Checkpoint:
    """`load_format="dummy"`: random weights in a checkpoint's shapes and stored encodings,
    from its config.json alone; DeepSeek-V4.1's only (DeepInfer's one model), any other
    config is refused by name."""
    return v41_dummy_checkpoint(path, seed)


def model_entry(architecture: str) -> ModelEntry:
    """The registry's entry for `architecture`; ModelLoadError when the engine cannot run it."""
    entry = MODELS.get(architecture)
    if entry is not None:
        return entry
    if not architecture_named(architecture).engine_runs:
        raise ModelLoadError(
            f"architecture {architecture!r} is known for its prompt encoding only (serve --mock, "
            f"tokenize); the engine does not run it. Supported: {sorted(MODELS)}"
        )
    raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}")


def build_image_encoder(path: str, dtype: torch.dtype) -> ImageEncoder:
    """The vision tower of the checkpoint directory at `path`, without its language model;
    ModelLoadError when its architecture or the checkpoint has none."""
    config = _read_config(Path(path))
    architecture = architecture_of(config)
    if architecture is None:
        raise ModelLoadError(f"{str(Path(path) / 'config.json')!r} names no architecture")
    load = model_entry(architecture.name).load_image_encoder
    if load is None:
        raise ModelLoadError(
            f"{architecture.name} has no vision tower: an encoder worker cannot serve {path!r}"
        )
    return load(Path(path), dtype)


def build_model(checkpoint: Checkpoint, options: ModelOptions) -> CausalLM:
    return model_entry(checkpoint.architecture).model_class.from_checkpoint(checkpoint, options)
