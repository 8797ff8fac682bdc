"""A Llama layer's elementwise glue: residual add + RMSNorm, and silu(gate) * up; in one pass
per row in C++ (llama_glue.cpp) where the decode kernel loads, else the torch ops.

Both paths compute each row alone in float32 (batch invariant either way); they differ by
float32 rounding (the order of a row's sum), bounded in tests/engine/layers/test_fused_glue.py.
"""

import functools

import torch
import torch.nn.functional as F

from deepwell.engine.layers.decode_kernel import load_decode_kernel


class TorchGlue:
    """The pure-torch glue: the fallback, and the reference the kernel is checked against."""

    @staticmethod
    def add_rms_norm(
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, rms_norm(residual + delta) * weight in `dtype`); no add when
        delta is None. The residual stream is float32; a bf16 delta upcasts exactly."""
        if delta is not None:
            residual = residual + delta
        return residual, F.rms_norm(residual, weight.shape, weight, eps).to(dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up = [gate | up], in gate_up's dtype."""
        gate, up = gate_up.chunk(2, dim=-1)
        # In place into silu's fresh output: one allocation fewer, the same products.
        return F.silu(gate).mul_(up)


class KernelGlue:
    """The fused glue: the residual is updated in place (it is the layer loop's own tensor)."""

    @staticmethod
    def add_rms_norm(
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return residual, torch.ops.deepwell_glue.add_rms_norm(residual, delta, weight, eps, dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.deepwell_glue.silu_mul(gate_up)


Glue = type[TorchGlue] | type[KernelGlue]


@functools.cache
def kernel_glue() -> Glue | None:
    """KernelGlue when the decode kernel loads (its ops are then registered), else None."""
    return KernelGlue if load_decode_kernel().module is not None else None
