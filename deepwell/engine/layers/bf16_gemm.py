"""bf16 linears of decode-shaped steps on AVX512_BF16 (bf16_gemm.cpp): the weight repacked
once into the kernel's panels, and the call that multiplies rows by them.

Where the CPU or the build lacks AVX512_BF16 (ATEN_CPU_CAPABILITY=avx2 builds without it)
no panels are made and the linears keep oneDNN's path (layers/packed_linear.py).
"""

import functools
import logging
import os

import torch
import torch.nn.functional as F

from deepwell.engine.layers.decode_kernel import load_bf16_gemm_kernel

logger = logging.getLogger(__name__)

# Outputs per panel (bf16_gemm.cpp's kPanel).
PANEL = 32
# Rows up to which a call takes the panels (benchmarks/decode_linears.py, weights streamed as
# a decode step streams them, one thread; docs/benchmarks-log.md, branch gemm8). Against
# oneDNN on AVX512_BF16 without AMX the kernel was 1.05-1.61x faster at every row count to 64
# (measured to 64: W's decode steps). Where oneDNN has AMX tiles no panels are made: the
# kernel won only at 1-4 rows there (1.08-1.37x; 0.56-0.63x at 16), W was level (33.00
# against 33.24 CPU s), and a switch between kernels at 64 rows would add to the bf16 ulps by
# which a row's result already moves with the row count on oneDNN's AMX path (at some counts
# and shapes: benchmarks/onednn_row_counts.py); a seeded request repeated over a prefix-cache
# hit samples alike only as far as its rows' bits agree (exactly: --batch-invariant).
MAX_ROWS = 64


@functools.cache
def panel_kernel_ready() -> bool:
    """Whether the kernel built here with its AVX512_BF16 path; the reason said once if not.
    Below torch's AVX-512 level the build could not have the path: nothing is compiled."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    loaded = load_bf16_gemm_kernel()
    if loaded.module is None:
        logger.warning(
            "bf16 decode linears: oneDNN, the panel kernel is unavailable: %s", loaded.reason
        )
        return False
    return loaded.module.instruction_set() == "avx512_bf16"


def onednn_uses_amx() -> bool:
    """Whether oneDNN multiplies bf16 on AMX tiles here: the CPU has them and no
    ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA) caps oneDNN below them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return torch.cpu._is_amx_tile_supported() and ("AMX" in cap.upper() or cap.upper() == "ALL")


def can_use_panels(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight [out, in] with an even `in` (the kernel reads input pairs), on a
    build with the AVX512_BF16 path, where oneDNN has no AMX tiles."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and not onednn_uses_amx()
        and panel_kernel_ready()
    )


def panel_layout(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] → panels [ceil(out / 32), in / 2, 32, 2]: per panel of 32 outputs
    and per input pair, the 32 outputs' two weights side by side (zero outputs pad the last)."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % PANEL))
    panels = padded.view(-1, PANEL, in_features // 2, 2).transpose(1, 2)
    return panels.contiguous()


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    float32_out: bool = False,
) -> torch.Tensor:
    """x [rows, in] bf16 @ weight.T (+ bias) in bf16 [rows, out]; with `float32_out` the
    float32 sums (plus the bias), unrounded."""
    if x.stride(-1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    return torch.ops.deepwell_bf16_gemm.linear(
        x, panels, None if bias is None else bias.float(), out_features, float32_out
    )
