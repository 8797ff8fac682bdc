"""Rotary position embedding (the "rotate half" form used by HF Llama checkpoints).

cos/sin are looked up once per step and shared by every layer.
"""

import functools
import logging
from collections.abc import Callable

import torch

from deepwell.engine.layers.decode_kernel import load_llama_rotary_kernel

logger = logging.getLogger(__name__)

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, max_position: int, dtype: torch.dtype):
        # Same formula and float32 arithmetic as HF, so float32 runs match it exactly.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        # rotate_half(x) * sin is roll(x, half) * sin with the first half of sin negated:
        # the same products (negation is exact), one op where rotate_half takes four.
        sin = emb.sin()
        self.signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), -1).to(
            dtype
        )

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token: [tokens, 1, head_dim], broadcasting over
        heads; `apply_rotary` takes them as they are."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; HF's x * cos + rotate_half(x) * sin, bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


@functools.cache
def fused_rotary() -> Rotate | None:
    """apply_rotary in one C++ pass (llama_rotary.cpp, the same bits), where it builds; None
    where it does not, said once in the log."""
    kernel = load_llama_rotary_kernel()
    if kernel.module is None:
        logger.warning("rotary: torch ops, the C++ kernel is unavailable: %s", kernel.reason)
        return None
    return kernel.module.rotate
