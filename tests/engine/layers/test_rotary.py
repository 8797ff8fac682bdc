"""Rotary embedding: the roll-and-signed-sin form gives HF's rotate_half result bit for bit."""

import pytest
import torch

from deepwell.engine.layers.rotary import RotaryEmbedding, apply_rotary


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
