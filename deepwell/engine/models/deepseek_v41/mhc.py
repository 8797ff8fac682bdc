"""Single-pass manifold hyper-connections (mHC): V4.1's 4-stream residual.

Each sublayer predicts (pre, post, comb) from the streams; its input is the streams
collapsed with the PREVIOUS sublayer's pre (spec/deepseek_v41.md §3.2).
"""

import torch
from torch import nn

from deepwell.engine.layers.batch_invariant import tiled_rows


class HyperConnection(nn.Module):
    def __init__(
        self, streams: int, hidden_size: int, iterations: int, eps: float, norm_eps, invariant
    ):
        super().__init__()
        # Batch-invariant: the mixing product runs on fixed row tiles.
        self.invariant = invariant
        self.streams = streams
        self.iterations = iterations
        self.eps = eps
        self.norm_eps = norm_eps
        width = streams * (streams + 2)
        self.fn = nn.Parameter(torch.zeros(width, streams * hidden_size))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        """streams [rows, S, hidden] float32 → pre [rows, S], post [rows, S], comb
        [rows, S_in, S_out], all float32."""
        s = self.streams
        flat = streams.flatten(1)
        mixes = tiled_rows(self._mix, flat) if self.invariant else self._mix(flat)
        mixes = mixes * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        scales = torch.cat(
            (self.scale[0].expand(s), self.scale[1].expand(s), self.scale[2].expand(s * s))
        )
        logits = torch.addcmul(self.base, mixes, scales)
        pre = torch.sigmoid(logits[:, :s]) + self.eps
        post = 2 * torch.sigmoid(logits[:, s : 2 * s])
        comb = logits[:, 2 * s :].unflatten(-1, (s, s)).softmax(dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    def _mix(self, flat: torch.Tensor) -> torch.Tensor:
        return flat @ self.fn.t()


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_s pre[s]·streams[s]: [rows, S, hidden] → [rows, hidden]."""
    return (pre.unsqueeze(-1) * streams).sum(1)


def expand(output: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """New stream s = post[s]·output + Σ_r comb[r, s]·streams[r]."""
    mixed = (comb.unsqueeze(-1) * streams.unsqueeze(2)).sum(1)
    return post.unsqueeze(-1) * output.unsqueeze(1) + mixed
