"""A continued prefill chunk's two-block attention equals one masked attention over its whole
context: every query row sees the cached prefix and the chunk's rows up to its own."""

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine.layers.blocked_prefill import continued_chunk_attention


def masked_reference(q, keys, values, cached):
    """float64 SDPA with the explicit visibility mask (positions cached + i see keys <= it)."""
    rows = q.shape[0]
    positions = torch.arange(cached, cached + rows).unsqueeze(1)
    visible = torch.arange(cached + rows).unsqueeze(0) <= positions
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        keys.double(),
        values.double(),
        attn_mask=visible,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("rows", "cached", "heads", "kv_heads", "dim"),
    [
        (1, 1, 4, 4, 8),  # one row after one cached token, no GQA
        (7, 13, 6, 2, 16),  # rows and prefix off every block size
        (64, 200, 9, 3, 64),  # SmolLM2's heads
        (300, 1000, 8, 1, 32),  # longer than the kernel's query and key blocks
    ],
)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_two_blocks_equal_the_masked_attention_over_the_context(
    rows, cached, heads, kv_heads, dim, dtype, tolerance
):
    generator = torch.Generator().manual_seed(rows + cached)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, cached + rows, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, cached + rows, dim, generator=generator).to(dtype)
    out = continued_chunk_attention(q, keys, values, cached, dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    expected = masked_reference(q, keys, values, cached)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_row_sees_no_key_past_its_own_position():
    """A value planted only at keys past row 0's position never reaches row 0's output."""
    rows, cached, dim = 4, 5, 8
    q = torch.zeros(rows, 2, dim)
    keys = torch.zeros(1, cached + rows, dim)
    values = torch.zeros(1, cached + rows, dim)
    values[0, cached + 1 :] = 1000.0
    out = continued_chunk_attention(q, keys, values, cached, dim**-0.5)
    assert torch.equal(out[0], torch.zeros(2, dim))
    # Row 1 sees one of the planted keys among its cached + 2 equally scored ones.
    torch.testing.assert_close(out[1], torch.full((2, dim), 1000.0 / (cached + 2)))
