"""The mirror layout of context parallelism: which prompt positions each rank computes,
and how the ranks' rows come back into sequence order after an all-gather.

A prompt of T tokens is cut into 2N chunks of ceil(T / 2N) tokens; rank r takes chunk r
and its mirror 2N−1−r, so every rank holds one early and one late chunk and the causal
attention work is even (DeepInfer's balanced CP, spec/deepinfer.md §1.6).
"""

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class MirrorLayout:
    num_tokens: int
    size: int

    @property
    def chunk(self) -> int:
        """Tokens per chunk; the last chunks may be short or empty."""
        return -(-self.num_tokens // (2 * self.size))

    def chunk_span(self, index: int) -> range:
        """Positions of chunk `index` (of 2N)."""
        start = min(index * self.chunk, self.num_tokens)
        return range(start, min(start + self.chunk, self.num_tokens))

    def spans(self, rank: int) -> tuple[range, range]:
        """The rank's two chunks, early one first."""
        return self.chunk_span(rank), self.chunk_span(2 * self.size - 1 - rank)

    def positions(self, rank: int) -> torch.Tensor:
        """The rank's positions, ascending: its rows in a context-parallel forward."""
        early, late = self.spans(rank)
        return torch.cat(
            (torch.arange(early.start, early.stop), torch.arange(late.start, late.stop))
        )

    def owner(self, position: int) -> int:
        index = position // self.chunk
        return index if index < self.size else 2 * self.size - 1 - index

    def pad(self, rank: int, rows: torch.Tensor) -> torch.Tensor:
        """The rank's rows [its positions, ...] in its slot of the gather: two chunk-sized
        halves, each chunk at the start of its half (collectives move equal shapes)."""
        early, late = self.spans(rank)
        padded = rows.new_zeros((2 * self.chunk, *rows.shape[1:]))
        padded[: len(early)] = rows[: len(early)]
        padded[self.chunk : self.chunk + len(late)] = rows[len(early) :]
        return padded

    @cached_property
    def order(self) -> torch.Tensor:
        """[T]: the row of position p in the gathered [N · 2 · chunk] rows."""
        positions = torch.arange(self.num_tokens)
        index = positions // self.chunk
        late = index >= self.size
        rank = torch.where(late, 2 * self.size - 1 - index, index)
        return rank * 2 * self.chunk + late * self.chunk + positions % self.chunk
