"""bf16 linears on AMX tiles (amx_linear.cpp): every bf16 linear's where oneDNN would run
them on the tiles (layers/packed_linear.py), the batch-invariant mode's, and the bf16 output
head's float32 logits (layers/float32_head.py). The weight packed once into the kernel's tile
layout, and the call that multiplies rows by it.

Where the CPU, torch's level or the build lacks AMX tiles nothing is packed: the linears keep
oneDNN (or the panels), the batch-invariant mode blockscaled.cpp's row-wise kernel
(layers/batch_invariant.py, RowwiseLinear).
"""

import functools
import logging

import torch
import torch.nn.functional as F

from deepwell.engine.layers import bf16_gemm
from deepwell.engine.layers.decode_kernel import amx_tiles_lacking, load_amx_linear_kernel

logger = logging.getLogger(__name__)

# Inputs per tile block and outputs per weight tile (amx_linear.cpp's kBlockInputs and
# kTileOutputs): a weight tile is 16 input pairs × 16 outputs × 2.
BLOCK_INPUTS = 32
TILE_OUTPUTS = 16


@functools.cache
def amx_kernel_ready() -> bool:
    """Whether amx_linear.cpp runs its tiles here; where the CPU has them but the kernel does
    not, the reason is said once."""
    if amx_tiles_lacking() is not None:
        return False
    loaded = load_amx_linear_kernel()
    if loaded.module is None:
        logger.warning("batch-invariant bf16 linears: row-wise, not on AMX: %s", loaded.reason)
        return False
    return loaded.module.instruction_set() == "amx_bf16"


def linears_on_tiles() -> bool:
    """Whether bf16 linears run amx_linear.cpp here: where oneDNN would multiply them on AMX
    tiles (none capped by ONEDNN_MAX_CPU_ISA) and the kernel runs its own. Asked of
    bf16_gemm's module each time, so that imitating another CPU there (the tests) holds here."""
    return bf16_gemm.onednn_uses_amx() and amx_kernel_ready()


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 → tiles [ceil(out / 16), ceil(in / 32), 16, 16, 2]: per 16
    outputs and 32 inputs, a tile whose row p holds the 16 outputs' weights for inputs 2p and
    2p + 1 side by side (the VNNI layout tdpbf16ps reads); zeros pad the outputs and inputs."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, -in_features % BLOCK_INPUTS, 0, -out_features % TILE_OUTPUTS))
    tiles = padded.view(
        padded.shape[0] // TILE_OUTPUTS, TILE_OUTPUTS, -1, BLOCK_INPUTS // 2, 2
    ).permute(0, 2, 3, 1, 4)
    return tiles.contiguous()


def amx_linear(
    x: torch.Tensor,
    tiles: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    float32_out: bool = False,
) -> torch.Tensor:
    """bf16 [rows, out] = x [rows, in] bf16 @ weight.T (+ bias), from the weight's
    tile_layout: the float32 sum plus the bias rounded once (with `float32_out`, not rounded:
    float32 [rows, out]), each row's bits its own whatever the rows beside it
    (amx_kernel_ready must hold)."""
    return torch.ops.deepwell_amx_linear.linear(
        x, tiles, None if bias is None else bias.float().contiguous(), out_features, float32_out
    )


def gate_up_tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """tile_layout of a gate_up weight [gate; up] ([2 × intermediate, in]) with its output
    tiles reordered gate tile j, up tile j, so that each output tile pair the kernel computes
    holds one tile of silu_mul_linear's inputs (intermediate a multiple of 16)."""
    intermediate = weight.shape[0] // 2
    gate, up = weight.view(2, intermediate // TILE_OUTPUTS, TILE_OUTPUTS, weight.shape[1])
    return tile_layout(torch.stack((gate, up), dim=1).reshape(weight.shape))


def amx_silu_mul_linear(x: torch.Tensor, tiles: torch.Tensor, intermediate: int) -> torch.Tensor:
    """bf16 [rows, intermediate] = silu(gate) * up of x [rows, in] bf16 through a gate_up
    linear without bias packed by gate_up_tile_layout: the bits of amx_linear on its
    tile_layout followed by the fused glue's silu_mul, in one pass (amx_kernel_ready must
    hold)."""
    return torch.ops.deepwell_amx_linear.silu_mul_linear(x, tiles, intermediate)
