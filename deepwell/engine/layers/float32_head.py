"""A bf16 output head whose logits are the float32 sums of its bf16 products, never rounded
to bf16.

A bf16 logit keeps 8 significant bits: between 8 and 16 its step is 1/16, so logits closer
than that become exact ties, which argmax breaks by token id. On the embedded SmolLM2 in bf16,
the first token of "What is the capital of France?" was such a tie ("L" −1.924, "The" −1.924
after rounding) and the greedy answer began "L'Étoile, la Marseillaise…"; from the float32
sums it is "The capital of France is Paris.", as in float32. DeepSeek-V4.1's reference
computes its head in float32 too (models/deepseek_v41/binding.py).

The kernel by CPU, each computing a row from that row alone (so the head is batch invariant
in every mode) and storing the float32 sums with no bf16 copy in between:
- AMX tiles (amx_linear.cpp) where oneDNN multiplies bf16 on them;
- else AVX512_BF16's panels (bf16_gemm.cpp), MAX_ROWS rows a call;
- else blockscaled.cpp's row-wise kernel (its torch reference where it does not build).
A head on GGUF blocks (`--quantization int4`: Q8_0) takes its calls of up to `max_rows` rows
on the block kernel, asked for float32, and longer ones on its dense bf16 weight as above.
A GPU head keeps its own linear (compute_logits widens its logits).
"""

from types import ModuleType

import torch
from torch import nn

from deepwell.engine.layers.amx_linear import amx_linear, linears_on_tiles, tile_layout
from deepwell.engine.layers.bf16_gemm import MAX_ROWS, can_use_panels, panel_layout, panel_linear
from deepwell.engine.layers.blockscaled import bf16_linear
from deepwell.engine.layers.quant_linear import QuantDecodeLinear


class Float32Head(nn.Linear):
    """nn.Linear over a bf16 CPU weight whose forward returns the float32 sums of its
    products (plus the bias) for bf16 inputs (float32 inputs are rounded to bf16 first: the
    model's dtype). Made in place by `to_float32_head`."""

    # The weight in the kernel's layout: AMX tiles or AVX512_BF16 panels; neither for the
    # row-wise kernel, which reads `weight` itself.
    tiles: torch.Tensor | None
    panels: torch.Tensor | None
    # A head on GGUF blocks: the block kernel's weight (quant_linear.kernel_layout) for calls
    # of up to max_rows rows; None otherwise.
    quant_weight: torch.Tensor | None
    kernel: ModuleType | None
    kind: str
    max_rows: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self._sums(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None and 0 < x.shape[0] <= self.max_rows:
            # The block kernel's call, asked in float32: its float32 input gives float32 sums
            # out, of the same (exactly widened) values, which it quantises alike.
            return QuantDecodeLinear.forward(self, x.float())
        if self.tiles is not None:
            return amx_linear(x, self.tiles, self.bias, self.out_features, float32_out=True)
        if self.panels is not None:
            parts = [
                panel_linear(
                    x[start : start + MAX_ROWS],
                    self.panels,
                    self.bias,
                    self.out_features,
                    float32_out=True,
                )
                for start in range(0, x.shape[0], MAX_ROWS)
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        out = bf16_linear(x.contiguous(), self.weight)
        return out if self.bias is None else out + self.bias


def can_take_float32_head(module: nn.Module) -> bool:
    """A linear over a bf16 CPU weight (plain, oneDNN-packed, or on GGUF blocks)."""
    return (
        isinstance(module, nn.Linear)
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
        and module.weight.dim() == 2
    )


@torch.no_grad()
def to_float32_head(module: nn.Linear) -> None:
    """Make `module` (can_take_float32_head) a Float32Head in place, its weight untouched
    (it may be tied to the embeddings): the kernel's layout made once, the copies its calls
    no longer read (oneDNN's packed weight) dropped."""
    quant_weight = getattr(module, "quant_weight", None)
    kernel, kind, max_rows = (
        (module.kernel, module.kind, module.max_rows) if quant_weight is not None else (None, "", 0)
    )
    for name in ("packed_weight", "panels", "tiles", "quant_weight"):
        module._buffers.pop(name, None)
    module.__class__ = Float32Head
    module.kernel, module.kind, module.max_rows = kernel, kind, max_rows
    module.register_buffer("quant_weight", quant_weight, persistent=False)
    weight = module.weight
    on_tiles = linears_on_tiles()
    module.register_buffer("tiles", tile_layout(weight) if on_tiles else None, persistent=False)
    panels = panel_layout(weight) if not on_tiles and can_use_panels(weight) else None
    module.register_buffer("panels", panels, persistent=False)
