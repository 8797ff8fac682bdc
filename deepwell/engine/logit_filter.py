"""LogitFilter: the engine-wide limits on what any row may generate, applied to a step's
logits before sampling and draft verification alike (DeepInfer's SAMPLER_FORCE_TOPK and
DECODE_TOKEN_BLACKLIST, spec/deepinfer.md §1.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitFilter:
    # Each row keeps its k largest logits (ties with the k-th included); 0: all.
    force_top_k: int = 0
    banned_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, force_top_k: int, banned_token_ids: tuple[int, ...], vocab_size: int):
        """The filter the settings ask for, or None when they ask for none."""
        out_of_range = [i for i in banned_token_ids if i >= vocab_size]
        if out_of_range:
            raise ValueError(
                f"decode_token_blacklist holds ids outside the vocabulary of {vocab_size}: "
                f"{out_of_range}"
            )
        if len(set(banned_token_ids)) >= vocab_size:
            raise ValueError("decode_token_blacklist bans every token of the vocabulary")
        if not force_top_k and not banned_token_ids:
            return None
        return cls(force_top_k, tuple(sorted(set(banned_token_ids))))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab], changed in place (a step's own logits) and returned."""
        if self.banned_token_ids:
            logits[:, list(self.banned_token_ids)] = float("-inf")
        if 0 < self.force_top_k < logits.shape[-1]:
            kth = logits.topk(self.force_top_k, dim=-1).values[:, -1:]
            logits.masked_fill_(logits < kth, float("-inf"))
        return logits
