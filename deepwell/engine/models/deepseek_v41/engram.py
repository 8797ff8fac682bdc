"""Engram: an n-gram memory read that updates all residual streams before its layer.

The table rows come from hashing the last tokens' normalised classes (engram_hash.py);
the read is gated per stream by a signed-square-root similarity (spec/deepseek_v41.md §3.5).
"""

import torch
from torch import nn

from deepwell.engine.layers.batch_invariant import lanewise


class Engram(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        head_dim: int,
        hash_heads: int,
        streams: int,
        hidden_size: int,
        eps: float,
        invariant: bool = False,
    ) -> None:
        """`invariant`: the gate's sigmoid runs in whole vector bodies (batch_invariant.lanewise)."""
        super().__init__()
        self.invariant = invariant
        self.streams = streams
        self.hidden_size = hidden_size
        self.eps = eps
        self.embed = nn.Embedding(num_embeddings, head_dim)
        self.wkv = nn.Linear(hash_heads * head_dim, hidden_size * (streams + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(streams, hidden_size))
        self.k_weight = nn.Parameter(torch.ones(streams, hidden_size))

    def forward(
        self,
        streams: torch.Tensor,
        table_rows: torch.Tensor,
        image_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """streams [rows, S, hidden] float32, table_rows [rows, hash_heads] → new streams;
        `image_rows` [rows] bool: image-span rows, which keep their streams (the reference
        masks their gate)."""
        memory = self.embed(table_rows).flatten(1)
        key, value = (
            self.wkv(memory)
            .float()
            .split((self.streams * self.hidden_size, self.hidden_size), dim=-1)
        )
        key = key.unflatten(-1, (self.streams, self.hidden_size))
        weights = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(streams.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        dot = (streams * weights * key).sum(-1) * rstd * self.hidden_size**-0.5
        gate = lanewise(_gate, dot) if self.invariant else _gate(dot)
        if image_rows is not None:
            gate = gate.masked_fill(image_rows.unsqueeze(1), 0)
        return streams + gate.unsqueeze(-1) * value.unsqueeze(1)


def _gate(dot: torch.Tensor) -> torch.Tensor:
    """The read's gate from its signed-square-root similarity."""
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
