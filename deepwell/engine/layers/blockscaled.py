"""Linears on DeepSeek-V4.1's released weight encodings (spec §3.8), computed from them as
stored: no weight is expanded to bf16 or float32 (docs/engine.md, "Block-scaled kernels").

- `fp8_block_linear`: float8_e4m3fn [out, in] with a float8_e8m0fnu scale per 32x32 block;
- `bf16_linear`: a bfloat16 [out, in] weight (the output head), float32 accumulation;
- `mxfp4_experts`: one MoE layer's routed experts, each W1 / W3 / W2 int8 pairs of E2M1 codes
  [out, in / 2] with an e8m0 scale per row and 32 inputs, reached through `MxFp4Experts`'s
  pointer tables so that separately memory-mapped tensors need no stacking.

Each runs blockscaled.cpp (AVX-512, AVX2 or scalar, built on first use) or, where no kernel
can be built, the torch reference below: it dequantises a slice of output rows at a time and
multiplies, so a whole matrix is never expanded at once. The fallback is logged once, with its
reason. Outputs are float32; in the native kernel a row's result never depends on the other
rows of the call (the batch-invariant mode relies on it).
"""

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from deepwell.engine.layers.decode_kernel import load_blockscaled_kernel
from deepwell.engine.models.deepseek_v41.weight_formats import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
)

logger = logging.getLogger(__name__)

BLOCK = 32
# Output rows the torch reference dequantises at once (a multiple of BLOCK): 2 MiB of float32
# per thousand inputs.
REFERENCE_ROWS = 512


@functools.cache
def native_kernel() -> ModuleType | None:
    """blockscaled.cpp for this CPU, or None (logged once) where it cannot be built."""
    loaded = load_blockscaled_kernel("native")
    if loaded.module is None:
        logger.warning(
            "block-scaled linears run on the torch reference (slower): %s", loaded.reason
        )
    return loaded.module


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [rows, out] ≈ x.float() @ dequantize_fp8_blocks(weight, scale).T for x
    [rows, in] float32 or bfloat16, weight float8_e4m3fn [out, in], scale float8_e8m0fnu
    [ceil(out / 32), ceil(in / 32)]."""
    _check_fp8(x, weight, scale)
    kernel = native_kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        return kernel.fp8_block_linear(x, weight, scale)
    return fp8_block_linear_reference(x, weight, scale)


def fp8_block_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_block_linear for a weight and scale already checked (`check_fp8_weight`, as a bound
    Fp8BlockLinear's are): the native kernel checks x itself, so a decode step's ~100 calls
    skip the Python-level checks, which cost more than the kernel's own at batch 1."""
    kernel = native_kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        return kernel.fp8_block_linear(x, weight, scale)
    return fp8_block_linear(x, weight, scale)


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """A ValueError unless weight is float8_e4m3fn [out, in] with its e8m0 block scale."""
    columns = weight.shape[1] if weight.dim() == 2 else -1
    _check_fp8(torch.empty(0, columns), weight, scale)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [rows, out] = x.float() @ weight.float().T for x [rows, in] float32 or bfloat16
    and weight bfloat16 [out, in], without materialising weight.float()."""
    _check_rows(x, weight, torch.bfloat16, weight.shape[1] if weight.dim() == 2 else -1)
    kernel = native_kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        return kernel.bf16_linear(x, weight)
    return bf16_linear_reference(x, weight)


# eq=False: equality by identity (comparing tensor tuples elementwise means nothing here).
@dataclass(frozen=True, eq=False)
class MxFp4Experts:
    """One MoE layer's routed experts in the released MXFP4 encoding: per expert (index = slot
    id) W1 (gate) and W3 (up) int8 [intermediate, hidden / 2], W2 (down) int8 [hidden,
    intermediate / 2], each with an e8m0 scale [rows, ceil(columns / 32)]. The tensors are
    kept here (the kernel reads them through the int64 address tables, built once)."""

    w1: tuple[torch.Tensor, ...]
    w1_scale: tuple[torch.Tensor, ...]
    w3: tuple[torch.Tensor, ...]
    w3_scale: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    w2_scale: tuple[torch.Tensor, ...]
    # int64 [num_experts] data_ptr() of the tensors above, in the same order.
    tables: tuple[torch.Tensor, ...]

    @classmethod
    def from_tensors(
        cls,
        w1: Sequence[torch.Tensor],
        w1_scale: Sequence[torch.Tensor],
        w3: Sequence[torch.Tensor],
        w3_scale: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        w2_scale: Sequence[torch.Tensor],
    ) -> "MxFp4Experts":
        """Validate every expert's six tensors (dtype, shape, contiguous memory on one device)
        and build the address tables. A ValueError names the first tensor that is wrong."""
        parts = {
            "w1": w1,
            "w1_scale": w1_scale,
            "w3": w3,
            "w3_scale": w3_scale,
            "w2": w2,
            "w2_scale": w2_scale,
        }
        count = len(w1)
        if count == 0:
            raise ValueError("MxFp4Experts needs at least one expert")
        for name, tensors in parts.items():
            if len(tensors) != count:
                raise ValueError(f"{name} has {len(tensors)} experts, w1 has {count}")
        if w1[0].dim() != 2 or w2[0].dim() != 2:
            raise ValueError("expert weights must be two-dimensional")
        intermediate, hidden = w1[0].shape[0], 2 * w1[0].shape[1]
        blocks = -(-hidden // BLOCK), -(-intermediate // BLOCK)
        expected = {
            "w1": (torch.int8, (intermediate, hidden // 2)),
            "w1_scale": (torch.float8_e8m0fnu, (intermediate, blocks[0])),
            "w3": (torch.int8, (intermediate, hidden // 2)),
            "w3_scale": (torch.float8_e8m0fnu, (intermediate, blocks[0])),
            "w2": (torch.int8, (hidden, intermediate // 2)),
            "w2_scale": (torch.float8_e8m0fnu, (hidden, blocks[1])),
        }
        if intermediate % 2:
            raise ValueError(f"MXFP4 packs column pairs; intermediate size {intermediate} is odd")
        for name, tensors in parts.items():
            dtype, shape = expected[name]
            for index, tensor in enumerate(tensors):
                if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise ValueError(
                        f"expert {index} {name}: expected {dtype} {list(shape)}, "
                        f"got {tensor.dtype} {list(tensor.shape)}"
                    )
                if tensor.device != w1[0].device or not tensor.is_contiguous():
                    raise ValueError(
                        f"expert {index} {name} must be contiguous memory on {w1[0].device}"
                    )
        kept = {name: tuple(tensors) for name, tensors in parts.items()}
        # Built once, beside the weights: a kernel on their device reads them without a copy.
        tables = tuple(
            torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=w1[0].device)
            for tensors in kept.values()
        )
        return cls(**kept, tables=tables)

    @property
    def num_experts(self) -> int:
        return len(self.w1)

    @property
    def hidden_size(self) -> int:
        return self.w2[0].shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w1[0].shape[0]


def mxfp4_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    experts: MxFp4Experts,
    limit: float,
) -> torch.Tensor:
    """float32 [pairs, hidden]: row p = weights[p] * expert_{slots[p]}(x[p]) with expert(x) =
    W2(silu(min(W1 x, limit)) * clamp(W3 x, -limit, limit)), for x [pairs, hidden] float32 or
    bfloat16, slots int64 [pairs] and weights float32 [pairs], pairs in any order. One native
    call for all the layer's experts, with no host synchronisation."""
    _check_pairs(x, slots, weights, experts)
    kernel = native_kernel() if x.device.type == "cpu" else None
    if kernel is not None:
        return kernel.mxfp4_experts(
            x,
            slots,
            weights,
            *experts.tables,
            experts.hidden_size,
            experts.intermediate_size,
            float(limit),
        )
    return mxfp4_experts_reference(x, slots, weights, experts, limit)


# --- the torch reference: dequantise a slice of rows, multiply ---


def fp8_block_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    def rows(begin: int, end: int) -> torch.Tensor:
        blocks = scale[begin // BLOCK : -(-end // BLOCK)]
        return dequantize_fp8_blocks(weight[begin:end], blocks)

    return _sliced_matmul(x, weight.shape[0], rows)


def bf16_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _sliced_matmul(x, weight.shape[0], lambda begin, end: weight[begin:end].float())


def mxfp4_experts_reference(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    experts: MxFp4Experts,
    limit: float,
) -> torch.Tensor:
    """mxfp4_experts in torch, one expert at a time (a loop over the experts that have pairs,
    reading slots on the host: this is the slow path)."""

    def matrix(data: torch.Tensor, scale: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
        return lambda begin, end: dequantize_mxfp4(data[begin:end], scale[begin:end])

    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(slots).tolist():
        picked = (slots == expert).nonzero().squeeze(1)
        rows = x[picked]
        gate = _sliced_matmul(
            rows, experts.intermediate_size, matrix(experts.w1[expert], experts.w1_scale[expert])
        )
        up = _sliced_matmul(
            rows, experts.intermediate_size, matrix(experts.w3[expert], experts.w3_scale[expert])
        )
        inner = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        down = _sliced_matmul(
            inner, experts.hidden_size, matrix(experts.w2[expert], experts.w2_scale[expert])
        )
        out[picked] = down * weights[picked].unsqueeze(1)
    return out


def _sliced_matmul(
    x: torch.Tensor, out_features: int, rows: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """x.float() @ W.T with W's float32 rows [begin, end) from `rows`, REFERENCE_ROWS at a time."""
    x = x.float()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for begin in range(0, out_features, REFERENCE_ROWS):
        end = min(out_features, begin + REFERENCE_ROWS)
        out[:, begin:end] = x @ rows(begin, end).T
    return out


# --- argument checks (the kernel checks again; these name the Python-level mistake) ---


def _check_rows(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, columns: int) -> None:
    if weight.dtype != dtype or weight.dim() != 2:
        raise ValueError(
            f"weight must be a {dtype} [out, in] matrix, got {weight.dtype} {list(weight.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != columns:
        raise ValueError(f"x must be [rows, {columns}], got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")


def _check_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    _check_rows(x, weight, torch.float8_e4m3fn, weight.shape[1] if weight.dim() == 2 else -1)
    expected = (-(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK))
    if scale.dtype != torch.float8_e8m0fnu or tuple(scale.shape) != expected:
        raise ValueError(
            f"scale must be float8_e8m0fnu {list(expected)}, got {scale.dtype} {list(scale.shape)}"
        )


def _check_pairs(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, experts: MxFp4Experts
) -> None:
    pairs = x.shape[0] if x.dim() == 2 else -1
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x must be [pairs, {experts.hidden_size}], got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (pairs,):
        raise ValueError(f"slots must be int64 [{pairs}], got {slots.dtype} {list(slots.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (pairs,):
        raise ValueError(
            f"weights must be float32 [{pairs}], got {weights.dtype} {list(weights.shape)}"
        )
