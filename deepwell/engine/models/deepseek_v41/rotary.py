"""V4.1's rotary embedding: adjacent-pair rotation of the trailing rotary dims.

Window-only layers use `rope_theta`; compressed layers use `compress_rope_theta` with the
frequency-only YaRN ramp (no attention scaling) for every rotation in the layer
(spec/deepseek_v41.md §3.1). On the CPU a rotation is one native call (layers/v41_rotary.cpp,
the same bits as the torch ops here, which other devices and a missing kernel run).
"""

import functools
import logging
import math
from typing import Any

import torch

from deepwell.engine.layers.batch_invariant import lanewise
from deepwell.engine.layers.decode_kernel import load_rotary_kernel

logger = logging.getLogger(__name__)

# The dtypes the native rotation takes.
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def native_rotation() -> bool:
    """Whether torch.ops.deepwell_v41_rotary is registered (the kernel built); logs once if not."""
    loaded = load_rotary_kernel()
    if loaded.module is None:
        logger.warning("V4.1 rotary runs as torch ops (slower): %s", loaded.reason)
    return loaded.module is not None


class PairRotary:
    """Angles per position, and the rotation (or its inverse) of a tensor's last dims."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.rotary_dim = rotary_dim
        freqs = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        original = int(scaling.get("original_max_position_embeddings", 0)) if scaling else 0
        if original > 0:
            factor = float(scaling.get("factor", 1.0))
            beta_fast = float(scaling.get("beta_fast", 32))
            beta_slow = float(scaling.get("beta_slow", 1))

            def dim_for(beta: float) -> float:
                return (
                    rotary_dim * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(theta))
                )

            low = max(math.floor(dim_for(beta_fast)), 0)
            high = min(math.ceil(dim_for(beta_slow)), rotary_dim - 1)
            pairs = torch.arange(rotary_dim // 2, dtype=torch.float32)
            ramp = ((pairs - low) / max(high - low, 1e-3)).clamp(0, 1)
            freqs = freqs / factor * ramp + freqs * (1 - ramp)
        self.freqs = freqs

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """Unit complex rotations [*positions.shape, rotary_dim // 2]."""
        angles = positions.float().unsqueeze(-1) * self.freqs
        return torch.polar(torch.ones_like(angles), angles)

    def invariant_rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """`rotation`, each angle's cosine and sine the same bits whatever the position count
        (batch-invariant mode)."""
        angles = positions.float().unsqueeze(-1) * self.freqs
        return lanewise(lambda a: torch.polar(torch.ones_like(a), a), angles)

    def is_native(self, values: torch.Tensor) -> bool:
        """Whether `apply` rotates `values` in v41_rotary.cpp: element by element, so a row's
        bits depend on its own values only."""
        native = values.is_cpu and values.dtype in _NATIVE_DTYPES and values.dim() >= 2
        return native and native_rotation()

    def apply(self, values: torch.Tensor, rotation: torch.Tensor, inverse: bool = False):
        """Rotate the last `rotary_dim` channels of values [rows, ..., dim]; `rotation` is
        [rows, pairs] and broadcasts over the middle axes."""
        if self.is_native(values):
            return torch.ops.deepwell_v41_rotary.rotate(values, rotation, self.rotary_dim, inverse)
        return self.apply_torch(values, rotation, inverse)

    def apply_torch(self, values: torch.Tensor, rotation: torch.Tensor, inverse: bool = False):
        """`apply` as torch ops (any device and float dtype)."""
        dim = self.rotary_dim
        pairs = torch.view_as_complex(
            values[..., -dim:].float().unflatten(-1, (-1, 2)).contiguous()
        )
        for _ in range(values.dim() - 2):
            rotation = rotation.unsqueeze(1)
        if inverse:
            rotation = rotation.conj()
        rotated = torch.view_as_real(pairs * rotation).flatten(-2).to(values.dtype)
        return torch.cat((values[..., :-dim], rotated), dim=-1)
