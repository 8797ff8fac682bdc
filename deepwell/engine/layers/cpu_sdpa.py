"""Torch's scaled-dot-product attention on CPU: kept off ATen's flash kernel in the one state
where that kernel fails (bf16 with torch below AVX-512 while oneDNN may use AMX tiles), and
a continued prefill chunk on that kernel without a mask where it multiplies on AMX tiles.

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


@functools.cache
def flash_uses_amx() -> bool:
    """Whether ATen's flash kernel multiplies bf16 on AMX tiles here: torch runs its AVX-512
    kernels, which pack for them, and oneDNN's level has them. On the AMX Xeon, in the
    engine, it ran a 2,048-row bf16 chunk's causal attention 2.4x faster than
    prefill_attention.cpp's AVX512_BF16 products and a 512-row one level with them
    (cpp_paged.AMX_FLASH_MIN_ROWS; docs/benchmarks-log.md, "Prefill attention on AMX tiles")."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and onednn_uses_amx()


def continued_chunk_attention(
    q: torch.Tensor,
    prior_keys: torch.Tensor,
    prior_values: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk q [heads, length, dim] that follows `prior` cached
    positions ([kv_heads, prior, dim] keys and values) and brings its own keys and values
    [kv_heads, length, dim]: one flash call over the prior keys, which every row sees whole,
    and one causal call over the chunk's own, merged by their log-sum-exps. A single call
    would need a [length, prior + length] mask, which the flash kernel applies to every
    score it computes: at 2,048 rows over 4,096 keys 34.6 against 24.2 ms."""
    group = q.shape[0] // keys.shape[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The prior part has no mask: a KV head's query heads fold into its rows.
    heads, length, dim = q.shape
    folded = q.reshape(prior_keys.shape[0], group * length, dim).unsqueeze(0)
    seen, seen_lse = flash(folded, prior_keys.unsqueeze(0), prior_values.unsqueeze(0), scale=scale)
    seen, seen_lse = seen.reshape(heads, length, dim), seen_lse.reshape(heads, length, 1)
    own, own_lse = flash(
        q.unsqueeze(0),
        keys.repeat_interleave(group, 0).unsqueeze(0),
        values.repeat_interleave(group, 0).unsqueeze(0),
        is_causal=True,
        scale=scale,
    )
    own, own_lse = own[0], own_lse[0].unsqueeze(-1)
    top = torch.maximum(seen_lse, own_lse)
    seen_weight, own_weight = (seen_lse - top).exp(), (own_lse - top).exp()
    merged = seen.float() * seen_weight + own.float() * own_weight
    return (merged / (seen_weight + own_weight)).to(q.dtype)
