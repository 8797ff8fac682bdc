"""A tiny Llama whose last layer attends over a sliding window kept in a per-sequence ring.

Shaped like DeepSeek-V4.1's SWA state (spec/deepseek_v41.md §4): the window lives in a
ring slot, not in the paged blocks, so a prefix hit must rebuild it by replay. It is the
last layer, so replaying its window over exact full-attention states is exact; with stacked
SWA layers bounded replay is an approximation (spec/deepseek_v41.md §4).
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import KVLayout, PagedSpec, RingSpec
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.rotary import apply_rotary
from deepwell.engine.layers.step_metadata import StepMetadata
from deepwell.engine.models.llama import LlamaConfig, LlamaForCausalLM

from .tiny_llama import write_tiny_llama

ARCHITECTURE = "SlidingWindowLlamaForCausalLM"
WINDOW = 8
MAX_BACKTRACK = 2


class RingAttention(nn.Module):
    """Attention over the last WINDOW positions, read from a ring of WINDOW + MAX_BACKTRACK
    rows; rows before the sequence's restart position are never read."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x, rope, meta: AttentionMetadata, ring) -> torch.Tensor:
        key_ring, value_ring, positions = ring
        rows = key_ring.shape[1]
        kv_size = self.num_kv_heads * self.head_dim
        qk, v = self.qkv_proj(x).split((self.num_heads * self.head_dim + kv_size, kv_size), -1)
        qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        # Row by row: a sequence's rows come in position order, and each writes its ring
        # row before the next one reads the window.
        slots, starts = meta.seq_slots, meta.seq_starts
        for row, position in enumerate(positions.tolist()):
            slot = slots[row]
            key_ring[slot, position % rows] = k[row]
            value_ring[slot, position % rows] = v[row]
            first = max(position - WINDOW + 1, starts[row])
            ring_rows = [p % rows for p in range(first, position + 1)]
            keys = key_ring[slot, ring_rows].transpose(0, 1)
            values = value_ring[slot, ring_rows].transpose(0, 1)
            query = q[row].unsqueeze(1)  # [heads, 1, head_dim]
            attended = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
            out[row] = attended.squeeze(1)
        return self.o_proj(out.flatten(1))


class SlidingWindowLlama(LlamaForCausalLM):
    def __init__(self, config: LlamaConfig, backend_class, dtype: torch.dtype) -> None:
        super().__init__(config, backend_class, dtype)
        # Same parameter names as the full-attention layer, so the weights load unchanged.
        self.layers[-1].self_attn = RingAttention(config)

    def kv_layout(self) -> KVLayout:
        c = self.config
        entry = (c.num_key_value_heads, c.head_dim)
        full = c.num_hidden_layers - 1
        return KVLayout(
            paged=(
                PagedSpec("key", full, entry, entry_axis=1),
                PagedSpec("value", full, entry, entry_axis=1),
            ),
            rings=(
                RingSpec("swa_key", 1, entry, WINDOW, MAX_BACKTRACK),
                RingSpec("swa_value", 1, entry, WINDOW, MAX_BACKTRACK),
            ),
        )

    def forward(self, input_ids, positions, meta: StepMetadata, kv_cache: KVCache):
        x = self.embed_tokens(input_ids).float()
        rope = self.rotary.lookup(positions)
        caches = zip(kv_cache.paged["key"], kv_cache.paged["value"], strict=True)
        delta = None
        for layer, layer_cache in zip(self.layers[:-1], caches, strict=True):
            x, delta = layer.forward(x, delta, rope, meta.paged, layer_cache)
        ring = (kv_cache.rings["swa_key"][0], kv_cache.rings["swa_value"][0], positions)
        x, delta = self.layers[-1].forward(x, delta, rope, meta.paged, ring)
        return self.norm(x + delta)


def write_sliding_window_llama(path: Path) -> Path:
    write_tiny_llama(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [ARCHITECTURE]
    (path / "config.json").write_text(json.dumps(config))
    return path
