"""bf16 linears on CPU with their weights packed once at load: into amx_linear.cpp's tiles
where oneDNN would run them on AMX tiles; elsewhere into oneDNN's blocked layout, and where it
runs here, into bf16_gemm.cpp's panels for decode-shaped calls.

On AMX the tile kernel takes every call. Against oneDNN's AMX path at two threads it was 1.25×
at 1 row, 1.8-1.9× at 16-32, 1.3× at 64 and 1.12-1.18× at 256-1,024 (SmolLM2's four layer
linears, benchmarks/amx_prompt_linears.py): oneDNN leaves its second thread idle on these
shapes, where the kernel splits the output tiles evenly. Each row's result is its own (the
batch-invariant mode's kernel), and the bits differ from oneDNN's in the last place for a
few outputs (another accumulation order).

F.linear hands oneDNN the plain weight, which it re-packs on every call. Packing at load
runs the same kernel without that copy (for SmolLM2's projections the bits are the same at
every row count, tests/engine/layers/test_packed_linear.py; odd small shapes may differ in
the last bit, where F.linear picks another kernel). Measured on 2 threads,
SmolLM2's 576 → 49,152 lm_head takes 1.1 ms instead of 4.2 ms for one row and 9.8 ms
instead of 14.1 ms for 64 rows; 576 → 1,536 takes 0.28 ms instead of 0.33 ms for 64 rows.

Calls of few rows (a decode step's) take the panel kernel instead where it is faster
(bf16_gemm.py, `MAX_ROWS`): its bits may differ from oneDNN's in the last place (another
accumulation order), each within float32 accumulation error of the exact product.
"""

import torch
from torch import nn

from deepwell.engine.layers.amx_linear import (
    TILE_OUTPUTS,
    amx_linear,
    amx_silu_mul_linear,
    gate_up_tile_layout,
    linears_on_tiles,
    tile_layout,
)
from deepwell.engine.layers.bf16_gemm import MAX_ROWS, can_use_panels, panel_layout, panel_linear


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def takes_panels(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a call of `x` on a packed `module` runs its panels. A function, not a method:
    QuantDecodeLinear borrows PackedLinear.forward without being one."""
    return module.panels is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS


class PackedLinear(nn.Linear):
    """nn.Linear that multiplies by its `tiles` where they are set, else by its
    `packed_weight`, and calls of up to MAX_ROWS rows by its `panels` where those are set (the
    plain `weight` stays for tied embeddings, dtype checks and memory accounting)."""

    tiles: torch.Tensor | None
    packed_weight: torch.Tensor | None
    panels: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            out = amx_linear(
                x.reshape(-1, self.in_features), self.tiles, self.bias, self.out_features
            )
            return out.view(*x.shape[:-1], self.out_features)
        if takes_panels(self, x):
            return panel_linear(x, self.panels, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [None], ""
        )


@torch.no_grad()
def repack(module: nn.Linear) -> None:
    """(Re)make a bf16 linear's packed copy from its `weight`: the tiles where they run here
    (a SiluGateUpLinear's in its gate-and-up layout), else oneDNN's packed weight and the
    panels where the panel kernel runs here."""
    weight = module.weight
    layout = gate_up_tile_layout if type(module) is SiluGateUpLinear else tile_layout
    tiles = layout(weight) if linears_on_tiles() else None
    packed = None
    if tiles is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    panels = panel_layout(weight) if tiles is None and can_use_panels(weight) else None
    module.register_buffer("tiles", tiles, persistent=False)
    module.register_buffer("packed_weight", packed, persistent=False)
    module.register_buffer("panels", panels, persistent=False)


@torch.no_grad()
def pack_linears(model: nn.Module) -> None:
    """Turn the model's bf16 CPU nn.Linear layers into PackedLinear in place."""
    for module in model.modules():
        if type(module) is nn.Linear and can_pack(module.weight):
            module.__class__ = PackedLinear
            repack(module)


class SiluGateUpLinear(PackedLinear):
    """A gate_up linear ([gate; up], no bias) on AMX tiles laid out by gate_up_tile_layout,
    whose `silu_mul` gives silu(gate) * up in one pass: the MLP's activation computed as the
    tiles' results are stored, overlapping the tile products, where the glue's own pass read
    the [rows, 2 × intermediate] output back (a 1,024-row prompt chunk's 6.3 MB at SmolLM2's
    sizes). Its bits are those of the linear and the fused glue's silu_mul."""

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        intermediate = self.out_features // 2
        out = amx_silu_mul_linear(x.reshape(-1, self.in_features), self.tiles, intermediate)
        return out.view(*x.shape[:-1], intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [gate | up] in the weight's order, from the pairs the tiles compute.
        pairs = (
            super().forward(x).view(-1, self.out_features // (2 * TILE_OUTPUTS), 2, TILE_OUTPUTS)
        )
        return pairs.transpose(1, 2).reshape(*x.shape[:-1], self.out_features)


@torch.no_grad()
def fuse_gate_up(module: nn.Module) -> bool:
    """Make a packed gate_up linear a SiluGateUpLinear in place where it runs on AMX tiles
    and has no bias, its intermediate size a multiple of 16; whether it did. The caller
    vouches that the model's silu_mul is the fused glue's, whose bits the kernel gives."""
    if (
        type(module) is not PackedLinear
        or module.tiles is None
        or module.bias is not None
        or module.out_features // 2 % TILE_OUTPUTS
    ):
        return False
    module.__class__ = SiluGateUpLinear
    repack(module)
    return True
