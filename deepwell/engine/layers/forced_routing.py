"""Test overrides of MoE routing (DeepInfer's DEEPINFER_FORCE_LOAD_BALANCE and
DEEPINFER_FORCE_IMBALANCE_RATIO, spec/deepinfer.md §1.4): the experts each row picks,
replaced by a fixed spread that is balanced or has one expert hotter by a set ratio."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForcedRouting:
    """`imbalance_ratio` 0: every expert gets an equal share of a step's (row, expert)
    pairs, to within one; >= 1: the last expert gets that ratio times the mean share (capped
    at one pair per row, the most a row can give it) and the others share the rest evenly.
    The last, not the first: EPLB's first placement replicates the first experts."""

    imbalance_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.imbalance_ratio != 0 and self.imbalance_ratio < 1.0:
            raise ValueError(
                f"a forced imbalance ratio is 0 (off) or at least 1.0, got {self.imbalance_ratio}"
            )

    def choose(self, rows: int, num_experts: int, top_k: int, device: torch.device) -> torch.Tensor:
        """[rows, top_k] expert ids, distinct within a row. Pairs are dealt round robin in
        row order, so the spread does not depend on the rows' contents."""
        if not self.imbalance_ratio:
            if top_k > num_experts:
                raise ValueError(f"top-{top_k} routing over {num_experts} experts")
            dealt = torch.arange(rows * top_k, device=device).view(rows, top_k)
            return dealt % num_experts
        if top_k > num_experts - 1:
            raise ValueError(f"a forced imbalance needs more than top_k={top_k} experts")
        mean = rows * top_k / num_experts
        hot_rows = min(rows, round(self.imbalance_ratio * mean))
        # The first hot_rows rows pick the last expert first; every other pick is dealt
        # round robin over the others (consecutive deals, so distinct within a row).
        hot = torch.zeros(rows, top_k, dtype=torch.bool, device=device)
        hot[:hot_rows, 0] = True
        dealt = (~hot).flatten().cumsum(0).view(rows, top_k) - 1
        return torch.where(hot, num_experts - 1, dealt % (num_experts - 1))
