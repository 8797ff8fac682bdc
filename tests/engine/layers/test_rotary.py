"""Rotary embedding: the roll-and-signed-sin form gives HF's rotate_half result bit for bit,
and the C++ pass (llama_rotary.cpp) gives the roll form's bits, on its vector and portable
paths, at torch's own level and with torch forced to AVX2."""

import platform

import pytest
import torch

from deepwell.engine.layers.decode_kernel import load_llama_rotary_kernel
from deepwell.engine.layers.rotary import RotaryEmbedding, apply_rotary

from .avx2_rerun import rerun_at_avx2


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rotary_matches_rotate_half_bit_for_bit(dtype):
    head_dim, base = 64, 10000.0
    rotary = RotaryEmbedding(head_dim, base, 4096, dtype)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    x = torch.randn(5, 12, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    # HF's cos/sin: the same float32 angles, cast to the compute dtype.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    assert torch.equal(apply_rotary(x, *rotary.lookup(positions)), hf_rotary(x, cos, sin))


@pytest.fixture(scope="module")
def rotate():
    """Built once per machine (cached); only a machine without a compiler skips."""
    loaded = load_llama_rotary_kernel()
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"Llama rotary kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason
    return loaded.module.rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# 64, 128 and 192: the vector path; 96: the vector path at AVX2, not at AVX-512 (half a head
# is not two whole vectors of 16); 40: the portable path.
@pytest.mark.parametrize(
    ("tokens", "head_dim"), [(1, 64), (37, 64), (300, 128), (5, 192), (5, 96), (5, 40)]
)
def test_the_cpp_pass_gives_the_torch_ops_bits(rotate, dtype, tokens, head_dim):
    rotary = RotaryEmbedding(head_dim, 10000.0, 8192, dtype)
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    # q and k heads inside the fused qkv projection's rows, as the model's split leaves them;
    # large values make every rounding count.
    fused = (torch.randn(tokens, 15, head_dim, generator=gen) * 40).to(dtype)
    qk = fused[:, :12]
    expected = apply_rotary(qk, *rotary.lookup(positions))
    assert torch.equal(rotate(qk, *rotary.lookup(positions)), expected)


@pytest.mark.parametrize("head_dim", [64, 96, 40])
def test_the_cpp_pass_keeps_the_torch_ops_bits_at_special_values(rotate, head_dim):
    rotary = RotaryEmbedding(head_dim, 10000.0, 8192, torch.bfloat16)
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 9, 12
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-39, -1e-39, 0.0, -0.0]
    )
    # Sprinkled over the heads: NaNs, overflowing products, inf - inf sums, subnormals, zeros.
    where = torch.rand(x.shape, generator=gen) < 0.2
    picks = specials[torch.randint(0, len(specials), x.shape, generator=gen)]
    x = torch.where(where, picks, x).bfloat16()
    cos, sin = rotary.lookup(torch.randint(0, 8192, (tokens,), generator=gen))
    got, want = rotate(x, cos, sin).view(torch.int16), apply_rotary(x, cos, sin).view(torch.int16)
    if head_dim % 32 == 0:
        # Whole vectors: both sides round every NaN to 0xffff, so every bit pattern matches.
        assert torch.equal(got, want)
    else:
        # The portable path's scalar tail rounds a NaN to 0x7fc0 where torch's vector loop
        # gives 0xffff (as before the vector path existed): a NaN either way.
        differ = got != want
        assert torch.equal(differ, differ & rotate(x, cos, sin).isnan())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's AVX2 level")
def test_the_cpp_pass_keeps_the_bits_with_torch_forced_to_avx2():
    """The same checks in a process whose torch (and so the kernel's build) runs at AVX2."""
    run = rerun_at_avx2(__file__, "cpp_pass and not forced_to_avx2 or builds_at_torchs_level")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_the_cpp_pass_builds_at_torchs_level():
    loaded = load_llama_rotary_kernel()
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"Llama rotary kernel unavailable: {loaded.reason}")
    assert loaded.reason.startswith(torch.backends.cpu.get_cpu_capability()), loaded.reason


def test_the_cpp_pass_refuses_mismatched_tables(rotate):
    rotary = RotaryEmbedding(64, 10000.0, 64, torch.float32)
    x = torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cos and signed_sin must be x's dtype"):
        rotate(x, *rotary.lookup(torch.arange(4)))
    with pytest.raises(RuntimeError, match=r"must be contiguous \[4, 1, 64\]"):
        rotate(x.float(), *rotary.lookup(torch.arange(5)))
