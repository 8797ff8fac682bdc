"""Torch SDPA on CPU in bf16 with torch held below AVX-512: prefill chunks run (ATen's flash
kernel would pack for AMX from its AVX2 build and raise), and the route is chosen only there."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine.layers import cpu_sdpa

# A fresh 96-token chunk (causal, no mask) and a 72-token one continuing 40 cached tokens
# (masked): both 64 rows or more, where ATen's flash kernel packs bf16 keys for AMX.
PREFILL_IN_A_CAPPED_TORCH = textwrap.dedent(
    """
    import torch
    from deepwell.engine.layers.attention import PrefillSpan
    from deepwell.engine.layers.torch_paged import TorchPagedAttention

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 64, 16
    backend = TorchPagedAttention(heads, kv_heads, dim)
    for cached, length in ((0, 96), (40, 72)):
        context = cached + length
        table = torch.arange((context + block - 1) // block)
        caches = [torch.randn(len(table), kv_heads, block, dim) for _ in range(2)]
        q = torch.randn(length, heads, dim)
        k, v = (c.transpose(1, 2).flatten(0, 1)[cached:context] for c in caches)
        mask = None
        if cached:
            mask = torch.ones(length, context, dtype=torch.bool).tril(cached)
        span = PrefillSpan(0, length, context, table, mask)
        want = backend._prefill(q, k, v, *caches, span)
        half = [t.bfloat16() for t in (q, k, v, *caches)]
        got = backend._prefill(*half, span).float()
        assert (got - want).abs().max() < 0.05, (cached, (got - want).abs().max())
    print("prefilled")
    """
)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's AVX2 level")
def test_bf16_prefill_runs_with_torch_forced_to_avx2():
    # On an AMX Xeon this raised "pack_vnni2 is only supported when avx512 is supported";
    # elsewhere ATen never packs and it checks the route changes nothing it should not.
    environ = os.environ | {"ATEN_CPU_CAPABILITY": "avx2"}
    environ.pop("ONEDNN_MAX_CPU_ISA", None)
    environ.pop("DNNL_MAX_CPU_ISA", None)
    run = subprocess.run(
        [sys.executable, "-c", PREFILL_IN_A_CAPPED_TORCH],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "prefilled" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("level", "amx", "math"),
    [
        ("AVX2", True, True),
        ("DEFAULT", True, True),
        ("AVX512", True, False),
        ("AVX2", False, False),
    ],
)
def test_math_backend_only_where_flash_would_pack_below_avx512(monkeypatch, level, amx, math):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: level)
    monkeypatch.setattr(cpu_sdpa, "onednn_uses_amx", lambda: amx)
    cpu_sdpa.flash_packs_without_avx512.cache_clear()
    sdpa = F.scaled_dot_product_attention
    flash_allowed = []

    def spy(*args, **kwargs):
        flash_allowed.append(torch._C._get_flash_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(cpu_sdpa.F, "scaled_dot_product_attention", spy)
    try:
        q = torch.randn(1, 4, 8, 16)
        cpu_sdpa.attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), is_causal=True)
        cpu_sdpa.attention(q, q, q, is_causal=True)  # float32: never packed
        assert flash_allowed == [not math, True]
    finally:
        cpu_sdpa.flash_packs_without_avx512.cache_clear()
