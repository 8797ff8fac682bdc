"""What a model holds in memory, from its config alone: weights by kind and encoding, KV.

The planner (memory.py) sets these against a memory budget; each model family builds its
own (deepseek_v41.py, dense.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightShare:
    """One row of the weights table: a kind of tensor (or an encoding) and its size."""

    name: str
    # Stored tensors, each quantised weight's `.scale` counted as one more.
    tensors: int
    # Logical (dequantised) elements; scales are not parameters.
    params: int
    bytes: int


@dataclass(frozen=True)
class Weights:
    """The weights as they sit in memory, split two ways that each add up to the total."""

    by_kind: tuple[WeightShare, ...]
    by_encoding: tuple[WeightShare, ...]

    @property
    def tensors(self) -> int:
        return sum(share.tensors for share in self.by_kind)

    @property
    def params(self) -> int:
        return sum(share.params for share in self.by_kind)

    @property
    def bytes(self) -> int:
        return sum(share.bytes for share in self.by_kind)


@dataclass(frozen=True)
class StatePart:
    """A fixed per-sequence state (a window ring, a compressor tail) and its bytes."""

    name: str
    bytes: int


@dataclass(frozen=True)
class KVFootprint:
    """KV that grows with the sequence (paged blocks) and state that does not (per slot)."""

    block_size: int
    bytes_per_block: int
    state_parts: tuple[StatePart, ...]
    # How the paged entries are stored, for the table: e.g. "fp8 window, nvfp4 compressed".
    encoding: str

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(part.bytes for part in self.state_parts)


@dataclass(frozen=True)
class ModelFootprint:
    """Everything the planner needs to know about one model."""

    architecture: str
    weights: Weights
    kv: KVFootprint
    # The longest context the model takes (max_position_embeddings).
    max_context: int
