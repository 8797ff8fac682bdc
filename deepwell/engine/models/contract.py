"""The contract between the engine and a model: what every causal LM the registry builds
offers, and the optional parts (hooks) generic code asks for instead of naming a model.

Generic code (build.py, core.py, runner.py, parallel/, plan/) reaches a model only through
`CausalLM` and its `hooks()`: a capability a model lacks is None there, and the engine
either skips it or refuses the setting that needs it, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout
from deepwell.engine.layers.step_metadata import StepMetadata
from deepwell.engine.multimodal import ImageInput

if TYPE_CHECKING:
    from deepwell.engine.models.loader import Checkpoint
    from deepwell.engine.models.registry import ModelOptions
    from deepwell.engine.parallel.context_group import ContextGroup


class ModelConfig(Protocol):
    """What generic code reads of a model's config (each model class has its own)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


class StepModel(Protocol):
    """What the runner calls each step: the forward over the step's rows, then the logits of
    the rows that sample. A model is one; so is a context-parallel leader standing in for it."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor: ...

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits of `hidden`'s rows `rows` (every row when None), float32."""
        ...


class ContextParallelLeader(StepModel, Protocol):
    """Rank 0's stand-in for the model: long prefill chunks run across the group."""

    group: ContextGroup

    def close(self) -> None: ...


class ContextParallelForward(Protocol):
    """A model's forward split over a context-parallel group (parallel/context.py)."""

    def leader(self, group: ContextGroup, min_tokens: int | None) -> ContextParallelLeader:
        """Rank 0's stand-in; `min_tokens`: the shortest chunk run across the group (None:
        the model's default)."""
        ...

    def follower(self, group: ContextGroup) -> Callable[[torch.Tensor, int], object]:
        """Ranks 1..N−1: the call that runs one announced prefill (token ids, start)."""
        ...


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture-of-experts model's routed experts, for expert parallelism and EPLB."""

    # Each MoE layer's module, in layer order (parallel/lockstep.py, parallel/eplb.py).
    layers: Sequence[nn.Module]
    # Whether a checkpoint tensor is a routed expert's (ranks hold different ones).
    is_expert_tensor: Callable[[str], bool]


class ImageEncoder(Protocol):
    """A model's vision tower: one image → the embeddings of its prompt span, which replace
    the span's rows at prefill (multimodal.py has the span layout)."""

    image_token_id: int
    downsample_ratio: int
    patch_size: int

    def __call__(self, image: ImageInput) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelHooks:
    """A model's optional capabilities; None (False) where it has none."""

    # The linear that makes the logits: int4 quantisation keeps it at 8 bits.
    output_head: nn.Module | None = None
    routed_experts: RoutedExperts | None = None
    # The draft stages speculative decoding runs (DSpark); built only when asked for.
    draft_stages: nn.Module | None = None
    # Its rings and state slots are read by its own layers, which have batch-invariant paths.
    invariant_rings: bool = False
    context_parallel: ContextParallelForward | None = None
    # Compute each MLP's activation inside its gate_up linear where its kernel can (after the
    # linears are packed; the batch-invariant mode keeps its own linears).
    fuse_mlp_activation: Callable[[], None] | None = None
    # Decode small all-decode steps natively where the setting ("auto" / "off") and the
    # model allow it (EngineArgs.native_decode).
    native_decode: Callable[[str], None] | None = None
    # Its vision tower, for a checkpoint that has one: images become span embeddings.
    image_encoder: ImageEncoder | None = None
    # Its layers read a decode-graph step's ring and compressed plans in their fixed-size
    # form (layers/step_metadata.py, FixedDecodePlans), so its graphs key on batch size alone.
    fixed_decode_plans: bool = False
    # Why a CUDA graph cannot capture its decode step as it is now built (a layer reads
    # device values on the host mid-step), or None when one can.
    graph_blocker: str | None = None


@runtime_checkable
class CausalLM(StepModel, Protocol):
    """A model the engine runs: an `nn.Module` built by its registry entry from a checkpoint,
    loaded with its tensors, stepping over the engine's metadata and KV cache."""

    config: ModelConfig

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, options: ModelOptions) -> CausalLM:
        """The model (weights not yet in) for a checkpoint's config, as `options` ask."""
        ...

    def kv_layout(self) -> KVLayout:
        """Every cache it keeps: paged per token, rings and state per sequence (kv/layout.py)."""
        ...

    def load_weights(self, tensors: Mapping[str, Any]) -> None:
        """Take the checkpoint's tensors; raises ModelLoadError on a missing or extra one."""
        ...

    def hooks(self) -> ModelHooks: ...
