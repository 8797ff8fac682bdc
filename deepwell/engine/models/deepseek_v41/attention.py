"""CSA2 attention of one V4.1 layer: its window KV, and for compressed layers the shared
compressed KV, the lightning indexer and the candidate pool (spec/deepseek_v41.md §3.3).

A layer writes its window rows into its ring; a KV source also writes new compressed
entries and index keys into the paged blocks. Within a forward, the source's entries and
the latest selection are handed to the layers that reuse them through `SharedSelection`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.sink_attention import SinkAttentionBackend
from deepwell.engine.layers.step_metadata import (
    CompressedPlan,
    StepMetadata,
    TailPlan,
    WindowPlan,
)
from deepwell.engine.models.deepseek_v41.cache_formats import qdq_fp8, qdq_mxfp4, qdq_nvfp4
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config, LayerPlan, Selection
from deepwell.engine.models.deepseek_v41.rotary import PairRotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled by the weight, in x's dtype."""
    value = x.float()
    value = value * torch.rsqrt(value.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * value).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass
class SharedSelection:
    """One sequence's compressed state as the latest source left it within this forward."""

    entries: torch.Tensor  # [entries, head_dim]
    index_keys: torch.Tensor  # [entries, index_head_dim]
    # [rows, top-k] entry ids, -1 where fewer entries are visible.
    selected: torch.Tensor | None = None
    # [rows, entries] the candidate pool, when a pool source has run.
    pool: torch.Tensor | None = None


@dataclass
class CompressedCaches:
    """One KV source's caches: entries and index keys [blocks, entries_per_block, dim], and
    for ratio > 1 its compressor tail ring [slots, rows, 2, head_dim] (float32)."""

    entries: torch.Tensor
    index_keys: torch.Tensor
    tail: torch.Tensor | None


class Compressor(nn.Module):
    """Pools r consecutive positions into one latent entry (a projection at ratio 1)."""

    def __init__(self, config: DeepseekV41Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.norm = Norm(config.head_dim, config.rms_norm_eps)
        if ratio > 1:
            self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False)

    def projections(self, u: torch.Tensor) -> torch.Tensor:
        """Per position (kv, gate) [rows, 2, head_dim], float32 (ratio > 1)."""
        x = u.float()
        return torch.stack(
            (F.linear(x, self.wkv.weight.float()), F.linear(x, self.wgate.weight.float())), 1
        )

    def pool(self, pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latents of complete groups from (kv, gate) rows [groups·r, 2, dim]."""
        groups = pairs.view(-1, self.ratio, 2, pairs.shape[-1])
        values, gates = groups[:, :, 0], groups[:, :, 1]
        pooled = (values * gates.softmax(dim=1)).sum(dim=1).to(dtype)
        return self.norm(pooled)


class Indexer(nn.Module):
    """Scores visible compressed entries per query and keeps the top-k (lightning indexer)."""

    def __init__(self, config: DeepseekV41Config, owns_keys: bool) -> None:
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.pool_blocks = config.candidate_topk_blocks
        self.pool_block_size = config.candidate_block_size
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = Norm(self.head_dim, config.rms_norm_eps)

    def scores(self, queries, weights, keys, visible_counts) -> torch.Tensor:
        """[rows, entries]: Σ_h w_h·relu(q_h·k), −inf past each row's visible entries."""
        per_head = torch.einsum("nhd,cd->nhc", queries.float(), keys.float()).relu()
        scores = (per_head * weights.float().unsqueeze(-1)).sum(dim=1)
        hidden = torch.arange(keys.shape[0]).unsqueeze(0) >= visible_counts.unsqueeze(1)
        return scores.masked_fill(hidden, float("-inf"))

    def candidate_pool(self, scores: torch.Tensor, visible_counts: torch.Tensor) -> torch.Tensor:
        """Blocks of entries ranked by their best score; the block holding the newest
        visible entry always stays (spec §3.3, §1.5)."""
        size = self.pool_block_size
        width = scores.shape[1]
        blocks = F.pad(scores, (0, -width % size), value=float("-inf"))
        blocks = blocks.unflatten(-1, (-1, size)).amax(dim=-1)
        newest = (visible_counts - 1).div(size, rounding_mode="floor").unsqueeze(1)
        blocks = blocks.masked_fill(torch.arange(blocks.shape[1]) == newest, float("inf"))
        top = blocks.topk(min(self.pool_blocks, blocks.shape[1]), dim=-1)
        keep = torch.zeros_like(blocks, dtype=torch.bool)
        keep.scatter_(-1, top.indices, top.values > float("-inf"))
        return keep.repeat_interleave(size, dim=-1)[:, :width] & torch.isfinite(scores)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k entry ids per row, ascending, −1 where fewer are visible."""
        top = scores.topk(min(self.topk, scores.shape[1]), dim=-1, sorted=False)
        ids = top.indices.sort(dim=-1).values
        return torch.where(torch.isfinite(scores.gather(-1, ids)), ids, -1)


class CSA2Attention(nn.Module):
    def __init__(
        self,
        config: DeepseekV41Config,
        plan: LayerPlan,
        backend: SinkAttentionBackend,
        rotary: PairRotary,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.groups = config.o_groups
        self.backend = backend
        self.rotary = rotary
        self.qdq = config.cache_qdq
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = Norm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = Norm(self.head_dim, config.rms_norm_eps)
        # Block-diagonal: group g maps its heads' outputs to its own o_lora_rank slice.
        group_in = self.num_heads * self.head_dim // self.groups
        self.wo_a = nn.Linear(group_in, self.groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))
        owns = plan.selection is Selection.FULL
        self.compressor = Compressor(config, plan.compress_ratio) if owns else None
        indexes = plan.selection in (Selection.FULL, Selection.REINDEX)
        self.indexer = Indexer(config, owns_keys=owns) if indexes else None

    def forward(
        self,
        u: torch.Tensor,
        rotation: torch.Tensor,
        meta: StepMetadata,
        windows: list[WindowPlan],
        ring: torch.Tensor,
        compressed: CompressedCaches | None,
        shared: dict[int, SharedSelection],
    ) -> torch.Tensor:
        """u [rows, hidden] (compute dtype), rotation [rows, pairs]; `windows` the step's
        window plans for this layer; `ring` is this layer's window ring [slots, ring_rows,
        dim]; `compressed` the caches of this layer's KV source; `shared` maps a sequence to
        its compressed state within this forward."""
        qr = self.q_norm(self.wq_a(u))
        q = self.wq_b(qr).view(-1, self.num_heads, self.head_dim)
        q = self.rotary.apply(q, rotation)
        kv = self.rotary.apply(self.kv_norm(self.wkv(u)), rotation)
        if self.qdq:
            kv = qdq_fp8(kv)
        out = torch.empty_like(q)
        for index, (seq, window) in enumerate(zip(meta.sequences, windows, strict=True)):
            rows = seq.rows
            chunk_kv = kv[rows]
            window_keys = torch.cat((ring[seq.slot, window.ring_rows], chunk_kv))
            ring[seq.slot, window.write_rows] = chunk_kv[window.write_from :].to(ring.dtype)
            selected_keys = selected_valid = None
            if compressed is not None:
                state = self._compressed_state(
                    index, u[rows], qr[rows], rotation[rows], meta, compressed, shared
                )
                if state.entries.shape[0]:
                    selected_valid = state.selected >= 0
                    selected_keys = state.entries[state.selected.clamp(min=0)]
            out[rows] = self.backend.forward(
                q[rows], window_keys, window.visible, selected_keys, selected_valid, self.attn_sink
            )
        out = self.rotary.apply(out, rotation, inverse=True)
        grouped = out.view(-1, self.groups, self.num_heads // self.groups * self.head_dim)
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        projected = torch.einsum("ngi,goi->ngo", grouped, weight)
        return self.wo_b(projected.flatten(1))

    def _compressed_state(
        self, index: int, u, qr, rotation, meta: StepMetadata, caches: CompressedCaches, shared
    ) -> SharedSelection:
        ratio = self.plan.compress_ratio
        plan = meta.compressed[ratio][index]
        if self.compressor is not None:
            tail = meta.tails[ratio][index] if ratio > 1 else None
            self._write_entries(u, meta.sequences[index].slot, plan, tail, caches)
            shared[index] = SharedSelection(
                entries=_gather_entries(caches.entries, plan),
                index_keys=_gather_entries(caches.index_keys, plan),
            )
        state = shared[index]
        if self.indexer is not None and state.entries.shape[0]:
            indexer = self.indexer
            queries = indexer.wq_b(qr).view(-1, indexer.num_heads, indexer.head_dim)
            queries = self.rotary.apply(queries, rotation)
            if self.qdq:
                queries = qdq_mxfp4(queries)
            weights = indexer.weights_proj(u).float() * (
                indexer.head_dim**-0.5 * indexer.num_heads**-0.5
            )
            scores = indexer.scores(queries, weights, state.index_keys, plan.visible_counts)
            if self.plan.builds_pool:
                state.pool = indexer.candidate_pool(scores, plan.visible_counts)
            elif self.plan.uses_pool:
                scores = scores.masked_fill(~state.pool, float("-inf"))
            state.selected = indexer.select(scores)
        return state

    def write_entries(self, u: torch.Tensor, meta: StepMetadata, caches: CompressedCaches) -> None:
        """Compress rows this layer does not otherwise run (compact bounded replay: the
        rows before the replay start), one sequence of `meta` at a time."""
        ratio = self.plan.compress_ratio
        for index, seq in enumerate(meta.sequences):
            tail = meta.tails[ratio][index] if ratio > 1 else None
            self._write_entries(u[seq.rows], seq.slot, meta.compressed[ratio][index], tail, caches)

    def _write_entries(
        self, u, slot: int, plan: CompressedPlan, tail: TailPlan | None, caches: CompressedCaches
    ) -> None:
        """Compress the chunk's complete groups into new entries and index keys."""
        compressor = self.compressor
        if tail is None:
            latents = compressor.norm(compressor.wkv(u))
        else:
            pairs = compressor.projections(u)
            ring = caches.tail
            pairs_before = ring[slot, tail.read_rows]
            ring[slot, tail.write_rows] = pairs[tail.write_from :]
            # From a group boundary on; a trailing incomplete group waits in the tail.
            complete = (plan.num_entries - plan.first_new) * compressor.ratio
            latents = compressor.pool(torch.cat((pairs_before, pairs))[:complete], u.dtype)
        if not latents.shape[0]:
            return
        rotation = self.rotary.rotation(plan.new_positions)
        entries = self.rotary.apply(latents, rotation)
        keys = self.rotary.apply(self.indexer.k_norm(self.indexer.wk(latents)), rotation)
        if self.qdq:
            entries, keys = qdq_nvfp4(entries), qdq_mxfp4(keys)
        caches.entries[plan.new_blocks, plan.new_offsets] = entries.to(caches.entries.dtype)
        caches.index_keys[plan.new_blocks, plan.new_offsets] = keys.to(caches.index_keys.dtype)


def _gather_entries(cache: torch.Tensor, plan: CompressedPlan) -> torch.Tensor:
    """A sequence's first `num_entries` entries from its blocks, in order."""
    return cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.num_entries]
