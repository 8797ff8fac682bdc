"""Torch's scaled-dot-product attention on CPU, kept off ATen's flash kernel in the one state
where that kernel fails (bf16 with torch below AVX-512 while oneDNN may use AMX tiles).

ATen's CPU flash attention packs bf16 keys for AMX (`pack_vnni2`) when oneDNN's instruction
set reaches AMX and the query and the keys are 64 rows or more, but the packing is compiled
only into its AVX-512 kernels: under ATEN_CPU_CAPABILITY=avx2 on an AMX Xeon every such
call raises "pack_vnni2 is only supported when avx512 is supported". There the math backend
runs instead (unfused, in bf16 as asked); everywhere else SDPA picks its own kernel. Only
prefill chunks need this: decode rows are one query each and 3-d inputs (the V4.1 vision
tower's) never reach the flash kernel.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepwell.engine.layers.bf16_gemm import onednn_uses_amx


@functools.cache
def flash_packs_without_avx512() -> bool:
    """Whether ATen's flash kernel would pack bf16 for AMX from a build below AVX-512: torch
    runs at AVX2 (or lower) while oneDNN's level, which the packing decision reads, has
    AMX tiles. Fixed for the process: both levels are read once at start-up."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512" and onednn_uses_amx()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with its default scale, on the math backend where
    the flash kernel would fail on these inputs' dtype."""
    math_only = q.dtype == torch.bfloat16 and q.device.type == "cpu"
    math_only = math_only and flash_packs_without_avx512()
    with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )
