"""Mirror context parallelism for one DeepSeek-V4.1 prefill chunk: every rank runs its two
sub-chunks' rows through every layer, all-gathering per layer what attention reads of other
positions; rank 0 writes the sequence's caches as a one-rank prefill would.

Per layer, each rank projects its own rows; the window KV of every position of the chunk
(and, in a KV source layer, every position's compressor inputs, from which each rank pools
the same compressed entries and index keys) are all-gathered into sequence order; what came
before the chunk (window rows, a compressor tail, earlier entries) is broadcast from rank
0's caches. Each rank then attends its own queries (window and causal masks, its own top-k
selections). Everything else (mHC, norms, Engram, MoE) is per row and stays local.
Ranks 1..N−1 run it from parallel/context.py's `run_follower`. spec/deepseek_v41.md §3.3,
§4; docs/parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from deepwell.engine.kv.cache import KVCache
from deepwell.engine.layers.batch_invariant import ROW_TILE
from deepwell.engine.layers.step_metadata import SequenceSpan, StepMetadata
from deepwell.engine.models.deepseek_v41.attention import CSA2Attention, SharedSelection
from deepwell.engine.models.deepseek_v41.config import LayerPlan
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING
from deepwell.engine.models.deepseek_v41.engram_hash import ngram_rows
from deepwell.engine.models.deepseek_v41.mhc import collapse
from deepwell.engine.parallel.context_group import ContextGroup
from deepwell.engine.parallel.context_layout import MirrorLayout

if TYPE_CHECKING:
    # The model's hook (context_parallel_model.py) builds this module's prefill.
    from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM


class SequenceCaches:
    """Rank 0's view of the sequence's caches: what lies before the chunk, read for the
    other ranks, and the chunk's own rows, written from the gathered tensors, with the plans
    the runner made for the sequence (its slot, ring rows, blocks)."""

    def __init__(
        self, model: DeepseekV41ForCausalLM, kv_cache: KVCache, meta: StepMetadata, index: int
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sequence = meta.sequences[index]
        self.window = meta.windows["window"][index]
        self.compressed = {ratio: plans[index] for ratio, plans in meta.compressed.items()}
        self.tails = {ratio: plans[index] for ratio, plans in meta.tails.items()}
        self.dspark_window = (
            meta.windows[DSPARK_RING][index] if DSPARK_RING in meta.windows else None
        )

    def window_before(self, layer: int) -> torch.Tensor:
        """The window rows of the positions just before the chunk, oldest first, decoded."""
        ring = self.kv_cache.rings["window"][layer]
        attn = self.model.layers[layer].attn
        return attn.read_window(ring, self.sequence.slot, self.window.ring_rows, self.model.dtype)

    def write_window(self, layer: int, keys: torch.Tensor) -> None:
        ring = self.kv_cache.rings["window"][layer]
        plan = self.window
        attn = self.model.layers[layer].attn
        attn.write_window(ring, self.sequence.slot, plan.write_rows, keys[plan.write_from :])

    def tail_before(self, plan: LayerPlan) -> torch.Tensor:
        """A ratio > 1 source's compressor inputs from its group boundary to the chunk."""
        tail = self.tails[plan.compress_ratio]
        return self._caches(plan).tail[self.sequence.slot, tail.read_rows]

    def entries_before(self, plan: LayerPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """A source's entries and index keys of the positions before the chunk, as stored."""
        caches = self._caches(plan)
        compressed = self.compressed[plan.compress_ratio]

        def first(cache: torch.Tensor) -> torch.Tensor:
            return cache.index_select(0, compressed.blocks).flatten(0, 1)[: compressed.first_new]

        return first(caches.entries), first(caches.index_keys)

    def write_entries(
        self, plan: LayerPlan, inputs: torch.Tensor, entries: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """A KV source's compressor tail (the chunk's last inputs) and its new entries."""
        caches = self._caches(plan)
        ratio = plan.compress_ratio
        if ratio > 1:
            tail = self.tails[ratio]
            caches.tail[self.sequence.slot, tail.write_rows] = inputs[tail.write_from :]
        if entries.shape[0]:
            CSA2Attention.store_entries(caches, self.compressed[ratio], entries, keys)

    def write_dspark(self, features: list[torch.Tensor]) -> None:
        """DSpark's context rings from the target layers' features of the chunk."""
        seq = self.sequence
        span = SequenceSpan(0, seq.num_rows, seq.start, seq.slot, seq.block_table)
        meta = StepMetadata([span], windows={DSPARK_RING: [self.dspark_window]})
        positions = torch.arange(seq.start, seq.start + seq.num_rows)
        self.model.dspark.write_context(features, positions, meta, self.kv_cache.rings[DSPARK_RING])

    def _caches(self, plan: LayerPlan):
        return self.model.compressed_caches(plan, self.kv_cache)


@dataclass
class _Shard:
    """One rank's part of one prefill chunk [start, start + layout.num_tokens)."""

    layout: MirrorLayout
    group: ContextGroup
    start: int
    positions: torch.Tensor
    # The rank's two sub-chunks: its rows and their positions.
    spans: list[tuple[slice, range]]
    # Rank 0 only.
    caches: SequenceCaches | None
    # The compressed state the latest KV source and index source left (one sequence).
    shared: SharedSelection | None = None
    features: list[torch.Tensor] = field(default_factory=list)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every position's row of the chunk, in sequence order, from each rank's rows
        (beyond its positions: batch-invariant padding, left out)."""
        padded = self.layout.pad(self.group.rank, rows[: len(self.positions)])
        return self.group.all_gather(padded)[self.layout.order]

    def from_rank_0(self, value: torch.Tensor | None, like: torch.Tensor, rows: int):
        """Rank 0's `value` (read from its caches; None elsewhere) on every rank, as
        [rows, *like.shape[1:]] in like's dtype."""
        if self.caches is not None:
            value = value.to(like.dtype)
        else:
            value = like.new_empty((rows, *like.shape[1:]))
        if rows:
            self.group.broadcast(value, src=0)
        return value


class ContextParallelPrefill:
    """A prefill chunk over the group; every rank calls `forward` with the same token ids
    (rank 0 announces them, followers receive them)."""

    def __init__(self, model: DeepseekV41ForCausalLM, group: ContextGroup) -> None:
        self.model = model
        self.group = group
        # Earlier tokens each row's Engram hash reads.
        self.history = model.config.engram_max_ngram_size - 1 if model.engram_tables else 0

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, start: int, caches: SequenceCaches | None
    ) -> torch.Tensor | None:
        """token_ids: the `history` tokens before position `start` (-1 before the
        sequence), then the chunk's. Returns the final hidden state [1, hidden] of the
        chunk's last position on rank 0 (None on the others); rank 0 passes `caches`."""
        model, group = self.model, self.group
        layout = MirrorLayout(token_ids.numel() - self.history, group.size)
        offsets = layout.positions(group.rank)
        early, late = layout.spans(group.rank)
        shard = _Shard(
            layout,
            group,
            start,
            start + offsets,
            [(slice(0, len(early)), early), (slice(len(early), len(offsets)), late)],
            caches,
        )
        rows = self.history + offsets  # the rank's rows in token_ids
        positions = shard.positions
        if model.batch_invariant:
            # Whole row tiles, as the model's own forward pads a step (model.py): no row
            # falls in a kernel's scalar tail; nothing reads the padding rows.
            padding = -len(offsets) % ROW_TILE
            rows = F.pad(rows, (0, padding), value=self.history)
            positions = F.pad(positions, (0, padding))
        rotations = {
            False: model.plain_rotary.rotation(positions),
            True: model.compress_rotary.rotation(positions),
        }
        streams, pre = model.initial_streams(token_ids[rows])
        history = None
        if model.engram_tables is not None:
            # Column s: the token s positions earlier (-1 before the sequence), as the
            # runner's token history with the row's own token first.
            history = token_ids[rows.unsqueeze(1) - torch.arange(self.history + 1)]
            history[len(offsets) :] = -1
        targets = () if model.dspark is None else model.dspark.targets
        for block in model.layers:
            plan = block.plan
            engram_rows = None
            if block.engram is not None:
                engram_rows = ngram_rows(model.engram_tables, plan.engram_slot, history)
            rotation = rotations[bool(plan.compress_ratio)]
            streams, pre = block.run(
                streams,
                pre,
                partial(self._attend, block.attn, rotation=rotation, shard=shard),
                engram_rows,
                model.dtype,
                shard.features if plan.index in targets else None,
            )
        if model.dspark is not None:
            features = [shard.gather(feature) for feature in shard.features]
            if caches is not None:
                caches.write_dspark(features)
        return self._last_hidden(layout, streams, pre)

    def _attend(
        self, attn: CSA2Attention, u: torch.Tensor, rotation: torch.Tensor, shard: _Shard
    ) -> torch.Tensor:
        """One layer's attention for the rank's rows, with every position's keys."""
        qr, q, kv, _ = attn.project(u, rotation)
        plan, caches, start = attn.plan, shard.caches, shard.start
        window = self.model.config.sliding_window
        # Rank 0 reads what precedes the chunk before the chunk's rows overwrite its rings.
        keys_from = max(0, start - window + 1)
        before = caches.window_before(plan.index) if caches is not None else None
        keys = torch.cat((shard.from_rank_0(before, kv, start - keys_from), shard.gather(kv)))
        if caches is not None:
            caches.write_window(plan.index, keys[start - keys_from :])
        state = None
        ratio = plan.compress_ratio
        if ratio:
            if attn.compressor is not None:
                shard.shared = self._compress(attn, u, shard)
            state = shard.shared
            # Padding rows see no entry.
            visible = F.pad((shard.positions + 1) // ratio, (0, u.shape[0] - len(shard.positions)))
            attn.select(state, u, qr, rotation, visible)
        out = torch.zeros_like(q)
        for rows, span in shard.spans:
            if not span:
                continue
            first = max(keys_from, start + span.start - window + 1)
            key_positions = torch.arange(first, start + span.stop).unsqueeze(0)
            query_positions = torch.arange(start + span.start, start + span.stop).unsqueeze(1)
            visible = (key_positions <= query_positions) & (
                key_positions > query_positions - window
            )
            span_keys = keys[first - keys_from : start + span.stop - keys_from]
            out[rows] = attn.attend(q[rows], span_keys, visible, state, rows)
        return attn.output(out, rotation)

    def _compress(self, attn: CSA2Attention, u: torch.Tensor, shard: _Shard) -> SharedSelection:
        """A KV source's entries and index keys for the whole sequence so far."""
        plan, caches, start = attn.plan, shard.caches, shard.start
        ratio = plan.compress_ratio
        end = start + shard.layout.num_tokens
        # Pooled on every rank from every position's inputs: a group may straddle two
        # sub-chunks, and each rank's queries read entries from all of them.
        inputs = shard.gather(attn.compressor.inputs(u))
        earlier = start // ratio
        tail = old_entries = old_keys = None
        if caches is not None:
            # As a one-rank forward: read the tail's rows before writing the chunk's.
            tail = caches.tail_before(plan) if ratio > 1 else None
            old_entries, old_keys = caches.entries_before(plan)
        pooled = inputs
        if ratio > 1:
            pooled = torch.cat((shard.from_rank_0(tail, inputs, start % ratio), inputs))
        latents = attn.latents(pooled, end // ratio - earlier, u.dtype)
        entries, index_keys = attn.entries(latents, torch.arange(earlier, end // ratio) * ratio)
        if caches is not None:
            caches.write_entries(plan, inputs, entries, index_keys)
        # Stored form, as a one-rank forward reads them back from the cache.
        return SharedSelection(
            torch.cat((shard.from_rank_0(old_entries, entries, earlier), entries)),
            torch.cat((shard.from_rank_0(old_keys, index_keys, earlier), index_keys)),
        )

    def _last_hidden(
        self, layout: MirrorLayout, streams: torch.Tensor, pre: torch.Tensor
    ) -> torch.Tensor | None:
        """The chunk's last position's final hidden state, moved to rank 0 if another rank
        has it (the last sub-chunks are empty when the chunk is small against 2N)."""
        owner = layout.owner(layout.num_tokens - 1)
        rank = self.group.rank
        hidden = None
        if rank == owner:
            # The last position is its owner's last row before any padding.
            last = len(layout.positions(rank)) - 1
            hidden = self.model.norm(collapse(streams[last : last + 1], pre[last : last + 1]))
        if owner != 0:
            if hidden is None:
                hidden = streams.new_empty((1, self.model.config.hidden_size))
            self.group.broadcast(hidden, src=owner)
        return hidden if rank == 0 else None
