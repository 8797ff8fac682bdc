"""Sparse MQA with an attention sink: the attention kernel of DeepSeek-V4.1 layers.

Each query attends to a set of window keys (masked per query) and to its own selection of
compressed entries; keys are also the values (one shared latent, spec/deepseek_v41.md
§3.3), and a per-head sink adds exp(sink) to the softmax denominator only. The interface
is what a CUDA kernel implements; `TorchSinkAttention` is the CPU path. Keys come as
values: the model decodes the cache rows it reads (V4.1 stores them packed,
models/deepseek_v41/cache_storage.py), so a backend never sees the cache's bytes.
"""

from abc import ABC, abstractmethod

import torch


class SinkAttentionBackend(ABC):
    def __init__(self, num_heads: int, head_dim: int, window: int, max_selected: int) -> None:
        """window: most window keys a query sees; max_selected: most entries it selects."""
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.window = window
        self.max_selected = max_selected

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        window_keys: torch.Tensor,
        window_visible: torch.Tensor,
        selected_keys: torch.Tensor | None,
        selected_valid: torch.Tensor | None,
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """One sequence's queries.

        q [n, heads, dim]; window_keys [keys, dim] with window_visible [n, keys];
        selected_keys [n, k, dim] with selected_valid [n, k] (None: no compressed entries);
        sinks [heads] float32. Returns [n, heads, dim] in q's dtype.
        """


class TorchSinkAttention(SinkAttentionBackend):
    def forward(self, q, window_keys, window_visible, selected_keys, selected_valid, sinks):
        query = q.float()
        keys = window_keys.float()
        scores = torch.einsum("nhd,kd->nhk", query, keys) * self.scale
        scores = scores.masked_fill(~window_visible.unsqueeze(1), float("-inf"))
        parts = [scores]
        if selected_keys is not None:
            picked = selected_keys.float()
            selected = torch.einsum("nhd,nkd->nhk", query, picked) * self.scale
            parts.append(selected.masked_fill(~selected_valid.unsqueeze(1), float("-inf")))
        sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([*parts, sink], dim=-1).softmax(dim=-1)
        out = torch.einsum("nhk,kd->nhd", probs[..., : keys.shape[0]], keys)
        if selected_keys is not None:
            width = keys.shape[0] + picked.shape[1]
            out = out + torch.einsum("nhk,nkd->nhd", probs[..., keys.shape[0] : width], picked)
        return out.to(q.dtype)
