"""Residual add + RMSNorm in one Triton pass per row: the Llama layer's glue under `--kernels triton`.

The torch reference is fused_glue.py's TorchGlue (float32 stream, normed row cast to the
compute dtype); the residual is updated in place, as KernelGlue does.
"""

from __future__ import annotations

import torch

from deepwell.engine.layers.fused_glue import TorchGlue
from deepwell.engine.layers.triton import require_triton

triton = require_triton()
tl = triton.language


@triton.jit
def _add_rms_norm_kernel(
    residual_ptr,  # [rows, hidden] float32, updated in place
    delta_ptr,  # [rows, hidden], or residual_ptr when there is nothing to add
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden] in the compute dtype
    hidden,
    eps,
    has_delta: tl.constexpr,
    block: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, block)
    inside = columns < hidden
    offsets = row * hidden + columns
    x = tl.load(residual_ptr + offsets, mask=inside, other=0.0)
    if has_delta:
        x += tl.load(delta_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(residual_ptr + offsets, x, mask=inside)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + offsets, (x * inverse_rms * weight).to(out_ptr.dtype.element_ty), mask=inside
    )


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchGlue.add_rms_norm's result, with `residual` (float32, contiguous) updated in place."""
    hidden = residual.shape[-1]
    out = torch.empty(residual.shape, dtype=dtype, device=residual.device)
    rows = residual.numel() // hidden
    if rows:
        _add_rms_norm_kernel[(rows,)](
            residual,
            residual if delta is None else delta.contiguous(),
            weight,
            out,
            hidden,
            eps,
            has_delta=delta is not None,
            block=triton.next_power_of_2(hidden),
        )
    return residual, out


class TritonGlue(TorchGlue):
    """The Llama layer glue of `--kernels triton`: the add + norm in Triton, silu * up in torch."""

    add_rms_norm = staticmethod(add_rms_norm)
