"""float32 linears on CPU: calls of a few rows padded to MKL's gemm size, off its slow path
for small row counts.

MKL's sgemm (torch's float32 `F.linear` on x86) multiplies calls of 1-15 rows on a path that
takes them about three rows at a time, each pass reading the whole weight; from 16 rows its
gemm kernel reads the weight once. Where the weight outgrows the L2 cache, each pass streams
it again: on the AMX Xeon (2 MiB of L2 a core; one thread, AVX2 forced), with 30 layers'
weights streamed as a decode step streams them, SmolLM2's 576 → 3,072 gate_up took 47-58 ms
a step at 10-15 rows and 34-35 ms padded to 16 rows, the 1,536 → 576 down 21-25 ms against
18 ms, the 576 → 49,152 head 38 / 47 ms at 11 / 14 rows against 24 ms; the weights that fit
in L2 (576 → 832 qkv, 576 → 576 o) were as fast or faster unpadded, and at 8-9 rows padding
won nothing (docs/benchmarks-log.md, branch avx9). So calls of 10 to 15 rows of a weight of
2 MiB or more run as one 16-row call over zero padding rows, whose outputs are dropped. Each
row's result is then that of a 16-row call, which may differ from an unpadded call's in the
last bits (another kernel), as MKL's results already differ between row counts below and
above 16; W's greedy tokens with AVX2 forced were unchanged, 64 of 64.
"""

import torch
import torch.nn.functional as F
from torch import nn

# MKL's sgemm runs its gemm kernel from this many rows.
GEMM_ROWS = 16
# From here (four passes of the small-row path) a GEMM_ROWS-row call is cheaper.
MIN_PADDED_ROWS = 10
# Weights from this size on (the Xeon's L2) stream from L3 or memory on every pass.
PADDED_WEIGHT_BYTES = 2 << 20


def takes_padding(x: torch.Tensor) -> bool:
    return x.dim() == 2 and MIN_PADDED_ROWS <= x.shape[0] < GEMM_ROWS


class RowPaddedLinear(nn.Linear):
    """nn.Linear whose calls of MIN_PADDED_ROWS to GEMM_ROWS - 1 rows are made GEMM_ROWS
    rows long with zero rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not takes_padding(x):
            return F.linear(x, self.weight, self.bias)
        padded = x.new_zeros(GEMM_ROWS, x.shape[1])
        padded[: x.shape[0]] = x
        return F.linear(padded, self.weight, self.bias)[: x.shape[0]]


def can_pad(module: nn.Module) -> bool:
    """A plain float32 CPU nn.Linear whose weight outgrows L2, where float32 products go to
    MKL."""
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.nbytes >= PADDED_WEIGHT_BYTES
        and torch.backends.mkl.is_available()
    )


def pad_small_calls(model: nn.Module) -> int:
    """Turn the model's float32 CPU nn.Linear layers of 2 MiB or more into RowPaddedLinear in
    place (weights untouched); returns how many it turned."""
    count = 0
    for module in model.modules():
        if can_pad(module):
            module.__class__ = RowPaddedLinear
            count += 1
    return count
