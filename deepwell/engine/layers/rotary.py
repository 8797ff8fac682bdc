"""Rotary position embedding (the "rotate half" form used by HF Llama checkpoints)."""

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, max_position: int, dtype: torch.dtype):
        # Same formula and float32 arithmetic as HF, so float32 runs match it exactly.
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [tokens, heads, dim], k: [tokens, kv_heads, dim] → rotated copies."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
