"""Decode linears on GGUF blocks (`--quantization int4`): calls of a few rows multiply Q4_1
layer weights and a Q8_0 output head in quant_gemv.cpp; larger calls keep the dense weights.

A decode step at batch 1 multiplies one row by every weight: it streams the weights and is
bound by memory traffic. Q4_1 (w = d * q + m per 32 inputs, q in 0..15) reads 0.625 bytes
a weight and Q8_0 (w = d * q, q int8) 1.125 with its int16 block sums, against bf16's 2;
the kernel quantises the activations per 32-block to int8 as llama.cpp does, so the dot
products are int8 ones (AVX-512 VNNI or AVX2). Weights come from the checkpoint's own blocks where a GGUF file
stores them so (the embedded SmolLM2: Q4_1 layers, Q8_0 tied embedding), else from the
float weights quantised at load.

The weights are repacked at load into row-interleaved tiles of 16 outputs (kernel_layout;
the byte map in quant_gemv.cpp), so VNNI's vpdpbusd adds 4 inputs to 16 outputs' lanes at
once with no horizontal sums; one layout for the VNNI, AVX2 and scalar paths.

SmolLM2's linears for one decode step (30 distinct layers of qkv, o, gate_up, down and the
49,152-row head, in model order, weights streaming from memory as in the engine), one
thread, AVX-512 VNNI Xeon VM, load average 1.2-1.5, best of 5, ms
(PYTHONPATH=. benchmarks/quant_decode.py --threads 1 --repeats 20 --step-repeats 5
--skip-engine):

    rows             1      2      4      6      8
    this kernel    5.62   7.25  11.93  12.36  12.59
    torch int4    12.37  14.71  17.49  25.29  27.11   (_weight_int4pack_mm_for_cpu + bf16
                                                       head: what int4 ran before)
    bf16 packed   26.84  28.94  29.69  29.74  27.69   (oneDNN, AMX)
    float32       40.16  45.31  81.30  81.91 105.12

The per-row layout this replaced, in alternating processes with it (load 1.5-2.2, best of
4 rounds; docs/benchmarks.md "Row-interleaved tiles"): 10.69 / 10.78 / 14.36 / 22.35 ms at
1 / 2 / 4 / 8 rows against the tiles' 7.45 / 7.67 / 9.29 / 13.40; the AVX2 build 2.0-2.9x.

Hence the cut-overs below. Activations rounded to 8 bits move the embedded model's
next-token logprobs 0.45 nats from float32's at most (bf16: 0.16; docs/benchmarks.md,
"GGUF-block decode linears").
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.decode_kernel import load_quant_kernel
from deepwell.engine.layers.packed_linear import PackedLinear
from deepwell.engine.models.loader import GGUFBlocks

BLOCK = 32
# Outputs per tile of the kernel's layout (kernel_layout; kernel_parts.h kTileOutputs).
TILE = 16
# Calls of up to this many rows run the kernel, larger ones (prefill chunks, batched decode)
# the dense weights. A step of linears (the table above): float32 dense is 6-8x slower and
# oneDNN's packed bf16 (AMX) 2.2x slower at every row count up to 8, where the kernel's
# instantiations stop; an engine decoding 8 sequences at once ran 874 tok/s on it against
# 296 on packed bf16 (docs/benchmarks.md, "Decode at each batch size").
QUANT_MAX_ROWS = 8
# Load's check that a checkpoint's blocks are the weight the model loaded reads every
# GUARD_ROW_STRIDE-th row (_stored_weight).
GUARD_ROW_STRIDE = 16


@dataclass(frozen=True)
class BlockWeight:
    """A weight in blocks of 32 inputs: w = d * q + m ("Q4_1", q uint8 in 0..15) or
    w = d * q ("Q8_0", q int8, m None); q [out, blocks, 32], d and m float32 [out, blocks]."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """float32 [out, blocks * 32], as gguf.quants.dequantize computes it."""
        values = self.d.unsqueeze(-1) * self.q.float()
        if self.m is not None:
            values = values + self.m.unsqueeze(-1)
        return values.flatten(1)

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        """The weight's rows at `index`, in that order."""
        m = None if self.m is None else self.m[index]
        return BlockWeight(self.kind, self.q[index], self.d[index], m)


def blocks_from_gguf(blocks: GGUFBlocks) -> BlockWeight:
    """Unpack GGUF's Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles: q[j] low, q[j + 16] high)
    or Q8_0 (fp16 d, 32 int8) blocks."""
    rows = blocks.data.shape[0]
    size = {"Q4_1": 20, "Q8_0": 34}[blocks.kind]
    raw = blocks.data.view(rows, -1, size)

    def half(start: int) -> torch.Tensor:
        return raw[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()

    if blocks.kind == "Q8_0":
        return BlockWeight("Q8_0", raw[..., 2:].contiguous().view(torch.int8), half(0), None)
    nibbles = raw[..., 4:]
    return BlockWeight("Q4_1", torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1), half(0), half(2))


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """Rounded to fp16, as GGUF stores scales (the kernel reads them so)."""
    return values.half().float()


def quantize_q4_1(weight: torch.Tensor) -> BlockWeight:
    """Each block's min and max to q = 0 and 15, d and m in fp16 (llama.cpp's Q4_1; q is
    rounded against the fp16 d and m, so it fits what the kernel reads)."""
    groups = weight.float().view(weight.shape[0], -1, BLOCK)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    d, m = _fp16((high - low) / 15), _fp16(low)
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((groups - m.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15)
    return BlockWeight("Q4_1", q.to(torch.uint8), d, m)


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Each block's largest magnitude to ±127, d in fp16 (llama.cpp's Q8_0)."""
    groups = weight.float().view(weight.shape[0], -1, BLOCK)
    d = _fp16(groups.abs().amax(dim=-1) / 127)
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127)
    return BlockWeight("Q8_0", q.to(torch.int8), d, None)


def concatenate(parts: list[BlockWeight]) -> BlockWeight:
    """The weight whose rows are the parts' rows in order (a fused projection)."""
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return BlockWeight(
        parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m
    )


class QuantDecodeLinear(nn.Linear):
    """nn.Linear whose calls of 1 to `max_rows` rows run the block kernel; others run the
    dense weight as PackedLinear runs it where it was one (bf16: `tiles` or `packed_weight`
    set), else F.linear."""

    kernel: ModuleType
    kind: str
    max_rows: int
    # The kernel's layout (quant_gemv.cpp, kernel_layout): uint8 [tiles, bytes], 16 outputs
    # interleaved per tile, their blocks' fp16 scales behind each block.
    quant_weight: torch.Tensor
    tiles: torch.Tensor | None
    packed_weight: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.max_rows:
            x = x.contiguous()
            if self.kind == "Q4_1":
                out = self.kernel.q4_1_linear(x, self.quant_weight, self.out_features)
            else:
                out = self.kernel.q8_0_linear(x, self.quant_weight, self.out_features)
            return out if self.bias is None else out + self.bias
        if self.tiles is not None or self.packed_weight is not None:
            return PackedLinear.forward(self, x)
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def to_decode_linear(module: nn.Linear, weight: BlockWeight, kernel: ModuleType) -> None:
    """Give `module` (nn.Linear or PackedLinear) the block weight, repacked for the kernel;
    in place. Its scales must be fp16 values (GGUF's; the quantisers round to them)."""
    module.register_buffer("quant_weight", kernel_layout(weight), persistent=False)
    dense = {name: getattr(module, name, None) for name in ("tiles", "packed_weight", "panels")}
    module.__class__ = QuantDecodeLinear
    module.kernel = kernel
    module.kind = weight.kind
    module.max_rows = QUANT_MAX_ROWS
    for name, tensor in dense.items():
        module.register_buffer(name, tensor, persistent=False)


def kernel_layout(weight: BlockWeight) -> torch.Tensor:
    """quant_gemv.cpp's row-interleaved tiles, uint8 [ceil(out / 16), blocks * 16 * bytes]:
    per tile and block, the 16 outputs' q four inputs at a time (Q4_1: inputs i and i + 16
    in one byte's nibbles), then fp16 d[16], then fp16 m[16] (Q4_1) or int16 Σq[16] (Q8_0)."""
    q, d, m = weight.q, weight.d, weight.m
    padding = -q.shape[0] % TILE
    if padding:
        # Zero rows (d = m = 0) fill the last tile; the kernel stores only real outputs.
        q = F.pad(q, (0, 0, 0, 0, 0, padding))
        d = F.pad(d, (0, 0, 0, padding))
        m = None if m is None else F.pad(m, (0, 0, 0, padding))
    tiles, blocks = q.shape[0] // TILE, q.shape[1]
    # [tile, output, block, group of 4 inputs, input] -> [tile, block, group, output, input]
    groups = q.view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        """[out, blocks] -> [tiles, blocks, 16]."""
        return t.view(tiles, TILE, blocks).transpose(1, 2)

    if weight.kind == "Q4_1":
        quants = groups[:, :, :4] | (groups[:, :, 4:] << 4)
        parts = [quants, per_tile(d).half(), per_tile(m).half()]
    else:
        parts = [groups, per_tile(d).half(), per_tile(q.sum(dim=-1, dtype=torch.int16))]

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).view(tiles, blocks, -1)

    return torch.cat([as_bytes(p) for p in parts], dim=2).view(tiles, -1)


def load_kernel() -> ModuleType:
    loaded = load_quant_kernel()
    if loaded.module is None:
        raise ValueError(
            f"--quantization int4 needs the quantised linear kernel, unavailable: {loaded.reason}"
        )
    return loaded.module


def can_quantize(module: nn.Module) -> bool:
    return (
        type(module) in (nn.Linear, PackedLinear)
        and module.in_features % BLOCK == 0
        and module.weight.device.type == "cpu"
    )


@torch.no_grad()
def quantize_linears(
    model: nn.Module, head: nn.Module | None, blocks: Mapping[str, GGUFBlocks]
) -> int:
    """Turn the model's linears into QuantDecodeLinear in place: from the checkpoint's own
    Q4_1 / Q8_0 blocks where `blocks` holds them, else from the float weights, Q4_1 for
    layers and Q8_0 for the output `head`. Returns how many it turned."""
    kernel = load_kernel()
    holders = _weight_holders(model)
    count = 0
    for name, module in model.named_modules():
        if not can_quantize(module):
            continue
        sources = _source_names(model, name, holders[id(module.weight)])
        stored = _stored_weight(name, module, [_checkpoint_blocks(n, blocks) for n in sources])
        if stored is None:
            stored = (quantize_q8_0 if module is head else quantize_q4_1)(module.weight)
        to_decode_linear(module, stored, kernel)
        count += 1
    return count


def _stored_weight(
    name: str, module: nn.Module, parts: list[GGUFBlocks | None]
) -> BlockWeight | None:
    """The module's weight from the checkpoint's blocks of its sources, or None where they
    do not hold all of it in one kept format."""
    if not parts or any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
        return None
    weight = concatenate([blocks_from_gguf(p) for p in parts])
    # The float weight the model loaded came from the same blocks: a mismatch means the
    # name mapping is wrong, which must not pass silently. A wrong mapping changes every
    # row, so rows spread over the weight (each part of a fused projection among them) show
    # it for a fraction of a whole dequantisation's cost (0.6 s of the embedded model's load).
    sample = torch.arange(0, module.weight.shape[0], GUARD_ROW_STRIDE)
    expected = weight.rows(sample).dequantize().to(module.weight.dtype)
    if not torch.equal(expected, module.weight[sample]):
        raise ModelLoadError(f"{name}: the checkpoint's blocks do not match its loaded weight")
    return weight


def _weight_holders(model: nn.Module) -> dict[int, list[str]]:
    """The names of the modules holding each weight tensor (by id), in module order."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            holders.setdefault(id(weight), []).append(name)
    return holders


def _source_names(model: nn.Module, name: str, weight_holders: list[str]) -> list[str]:
    """Checkpoint names whose rows make up the weight of module `name`, which
    `weight_holders` hold: its own, a fused projection's parts, or for a tied head the
    embedding it shares."""
    for other_name in weight_holders:
        if other_name != name:
            return [other_name]
    # The model's fused projections (models/llama.py's `fused_projections`), if it has any.
    for target, parts in getattr(model, "fused_projections", {}).items():
        if name.endswith(f".{target}"):
            prefix = name.removesuffix(target)
            return [prefix + part for part in parts]
    return [name]


def _checkpoint_blocks(name: str, blocks: Mapping[str, GGUFBlocks]) -> GGUFBlocks | None:
    # Checkpoint names are HF's: the Llama family's layers sit under "model.".
    return blocks.get(f"{name}.weight", blocks.get(f"model.{name}.weight"))
