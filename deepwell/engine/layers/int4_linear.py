"""Weight-only int4 linears (32-weight groups) for small-row calls on CPU: decode steps.

A decode step at batch 1 multiplies one row by every weight: it streams the weights and is
bound by memory traffic. torch's `_weight_int4pack_mm_for_cpu` reads 4-bit weights with a
bf16 scale and offset per group of 32 inputs. SmolLM2's layer linears per step (30 layers
of qkv, o, gate_up and down plus the bf16 lm_head, one thread, AMX Xeon, CPU ms): 12.8
against 38.6 for packed bf16 at 1 row, 14.7 / 40.9 at 2, 19.0 / 39.8 at 4, 35.9 / 40.2 at
8; without the lm_head, 37.7 / 32.2 at 12 rows and 91.1 / 38.7 at 32. So calls of up to
`INT4_MAX_ROWS` rows (batch-1 decode, a 6-row speculative verify) run int4, and larger ones
(prefill, batched decode) keep the packed bf16 weights, which the int4 copy adds a quarter
to. (Per-channel int8, `_weight_int8pack_mm`, was tried first: 22.8 ms at 1 row, slower
than int4 at every row count, and it moved the logits four times as far from bf16's as
bf16's are from float32's. It was dropped.)

The grouping is GGUF's Q4_1 (w = d * q + m per 32 weights, q in 0..15), which is what the
embedded SmolLM2's layer weights are stored in: quantising their dequantised values again
with each group's min and max gets the same q back, so on such a checkpoint int4 costs only
the bf16 rounding of each group's d and m (tests/engine/layers/test_int4_linear.py bounds
the logits). Its tied lm_head (Q8_0 in the GGUF) stays bf16.
"""

import torch

from deepwell.engine.layers.packed_linear import PackedLinear

GROUP_SIZE = 32
INT4_MAX_ROWS = 6


class Int4DecodeLinear(PackedLinear):
    """PackedLinear whose calls of at most INT4_MAX_ROWS rows use its int4 weights."""

    int4_weight: torch.Tensor  # torch's packed int4 layout
    # [in_features / GROUP_SIZE, out_features, 2]: scale and offset, the weight's dtype.
    int4_scales_zeros: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > INT4_MAX_ROWS:
            return super().forward(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.int4_weight, GROUP_SIZE, self.int4_scales_zeros
        )
        return out if self.bias is None else out + self.bias


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of GROUP_SIZE inputs: q in 0..15 ([out, in] int32) and
    [in / GROUP_SIZE, out, 2] (scale, offset) in the weight's dtype, such that
    weight ≈ (q - 8) * scale + offset, the form torch's int4 kernel computes."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    scales_zeros = torch.stack((scale, low + 8 * scale), dim=-1).transpose(0, 1)
    return q.view(out_features, in_features).to(torch.int32), scales_zeros.to(weight.dtype)


def can_quantize(module: torch.nn.Module) -> bool:
    return type(module) is PackedLinear and module.in_features % GROUP_SIZE == 0


@torch.no_grad()
def quantize_linears(model: torch.nn.Module, keep: tuple[torch.nn.Module, ...] = ()) -> int:
    """Give the model's packed bf16 linears, except `keep`, an int4 copy for small-row
    calls, in place; returns how many it quantised."""
    count = 0
    for module in model.modules():
        if can_quantize(module) and not any(module is k for k in keep):
            q, scales_zeros = quantize_int4(module.weight)
            module.__class__ = Int4DecodeLinear
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            module.register_buffer("int4_weight", packed, persistent=False)
            module.register_buffer("int4_scales_zeros", scales_zeros.contiguous(), persistent=False)
            count += 1
    return count
