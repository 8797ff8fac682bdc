"""Mirror context parallelism for one DeepSeek-V4.1 prefill: every rank runs its two
chunks' rows through every layer, all-gathering per layer what attention reads of other
positions; rank 0 writes the sequence's caches as a one-rank prefill would.

Per layer, each rank projects its own rows; the window KV of every position (and, in a KV
source layer, every position's compressor inputs, from which each rank pools the same
compressed entries and index keys) are all-gathered into sequence order; each rank then
attends its own queries (window and causal masks, its own top-k selections). Everything
else (mHC, norms, Engram, MoE) is per row and stays local. `run_follower` is the loop of
ranks 1..N−1. spec/deepseek_v41.md §3.3, §4; docs/parallel_context.md.
"""

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepwell.engine.args import EngineArgs
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.layers.step_metadata import SequenceSpan, StepMetadata
from deepwell.engine.models.deepseek_v41.attention import CSA2Attention, SharedSelection
from deepwell.engine.models.deepseek_v41.config import LayerPlan
from deepwell.engine.models.deepseek_v41.dspark import DSPARK_RING
from deepwell.engine.models.deepseek_v41.engram_hash import ngram_rows
from deepwell.engine.models.deepseek_v41.mhc import collapse
from deepwell.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepwell.engine.parallel.context_group import ContextGroup, GroupAddress
from deepwell.engine.parallel.context_layout import MirrorLayout

logger = logging.getLogger(__name__)


class CacheWriter:
    """Rank 0's writes of one sequence's caches from the gathered tensors, with the plans
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

    def write_window(self, layer: int, keys: torch.Tensor) -> None:
        ring = self.kv_cache.rings["window"][layer]
        plan = self.window
        ring[self.sequence.slot, plan.write_rows] = keys[plan.write_from :].to(ring.dtype)

    def write_entries(
        self, plan: LayerPlan, inputs: torch.Tensor, entries: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """A KV source's compressor tail (the last positions' inputs) and its entries."""
        caches = self.model.compressed_caches(plan, self.kv_cache)
        ratio = plan.compress_ratio
        if ratio > 1:
            tail = self.tails[ratio]
            caches.tail[self.sequence.slot, tail.write_rows] = inputs[tail.write_from :]
        if entries.shape[0]:
            CSA2Attention.store_entries(caches, self.compressed[ratio], entries, keys)

    def write_dspark(self, features: list[torch.Tensor]) -> None:
        """DSpark's context rings from the target layers' features of every position."""
        seq = self.sequence
        span = SequenceSpan(0, seq.num_rows, 0, seq.slot, seq.block_table)
        meta = StepMetadata([span], windows={DSPARK_RING: [self.dspark_window]})
        positions = torch.arange(seq.num_rows)
        self.model.dspark.write_context(features, positions, meta, self.kv_cache.rings[DSPARK_RING])


@dataclass
class _Shard:
    """One rank's part of one prefill."""

    layout: MirrorLayout
    group: ContextGroup
    positions: torch.Tensor
    # The rank's two chunks: its rows and their positions.
    chunks: list[tuple[slice, range]]
    writer: CacheWriter | None
    # The compressed state the latest KV source and index source left (one sequence).
    shared: SharedSelection | None = None
    features: list[torch.Tensor] = field(default_factory=list)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every position's row, in sequence order, from each rank's own rows."""
        padded = self.layout.pad(self.group.rank, rows)
        return self.group.all_gather(padded)[self.layout.order]


class ContextParallelPrefill:
    """A prefill from position 0 over the group; every rank calls `forward` with the same
    token ids (rank 0 announces them, followers receive them)."""

    def __init__(self, model: DeepseekV41ForCausalLM, group: ContextGroup) -> None:
        self.model = model
        self.group = group

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, writer: CacheWriter | None) -> torch.Tensor | None:
        """token_ids [T]. Returns the final hidden state [1, hidden] of the last position on
        rank 0 (None on the others); `writer` (rank 0) stores the sequence's caches."""
        model, config, group = self.model, self.model.config, self.group
        layout = MirrorLayout(token_ids.numel(), group.size)
        positions = layout.positions(group.rank)
        early, late = layout.spans(group.rank)
        shard = _Shard(
            layout,
            group,
            positions,
            [(slice(0, len(early)), early), (slice(len(early), len(positions)), late)],
            writer,
        )
        rotations = {
            False: model.plain_rotary.rotation(positions),
            True: model.compress_rotary.rotation(positions),
        }
        streams, pre = model.initial_streams(token_ids[positions])
        history = None
        if model.engram_tables is not None:
            # Column s: the token s positions earlier, -1 before the sequence (as the
            # runner's token history, with the row's own token first).
            back = positions.unsqueeze(1) - torch.arange(config.engram_max_ngram_size)
            history = torch.where(back >= 0, token_ids[back.clamp(min=0)], -1)
        targets = () if model.dspark is None else model.dspark.targets
        for block in model.layers:
            plan = block.plan
            rotation = rotations[bool(plan.compress_ratio)]
            engram_rows = None
            if block.engram is not None:
                engram_rows = ngram_rows(model.engram_tables, plan.engram_slot, history)

            def attend(u: torch.Tensor, attn=block.attn, rotation=rotation) -> torch.Tensor:
                return self._attend(attn, u, rotation, shard)

            streams, pre = block.run(
                streams,
                pre,
                attend,
                engram_rows,
                model.dtype,
                shard.features if plan.index in targets else None,
            )
        if model.dspark is not None:
            features = [shard.gather(feature) for feature in shard.features]
            if writer is not None:
                writer.write_dspark(features)
        return self._last_hidden(layout, streams, pre)

    def _attend(
        self, attn: CSA2Attention, u: torch.Tensor, rotation: torch.Tensor, shard: _Shard
    ) -> torch.Tensor:
        """One layer's attention for the rank's rows, with every position's keys."""
        qr, q, kv = attn.project(u, rotation)
        keys = shard.gather(kv)
        plan = attn.plan
        if shard.writer is not None:
            shard.writer.write_window(plan.index, keys)
        state = None
        ratio = plan.compress_ratio
        if ratio:
            if attn.compressor is not None:
                # Pooled on every rank from every position's inputs: a group may straddle
                # two chunks, and each rank's queries read entries from all of them.
                inputs = shard.gather(attn.compressor.inputs(u))
                count = shard.layout.num_tokens // ratio
                latents = attn.latents(inputs, count, u.dtype)
                entries, index_keys = attn.entries(latents, torch.arange(count) * ratio)
                if shard.writer is not None:
                    shard.writer.write_entries(plan, inputs, entries, index_keys)
                # As a one-rank forward reads them back from the cache, in its dtype.
                shard.shared = SharedSelection(entries.to(u.dtype), index_keys.to(u.dtype))
            state = shard.shared
            attn.select(state, u, qr, rotation, (shard.positions + 1) // ratio)
        window = self.model.config.sliding_window
        out = torch.zeros_like(q)
        for rows, span in shard.chunks:
            if not span:
                continue
            first = max(0, span.start - window + 1)
            key_positions = torch.arange(first, span.stop).unsqueeze(0)
            query_positions = torch.arange(span.start, span.stop).unsqueeze(1)
            visible = (key_positions <= query_positions) & (
                key_positions > query_positions - window
            )
            out[rows] = attn.attend(q[rows], keys[first : span.stop], visible, state, rows)
        return attn.output(out, rotation)

    def _last_hidden(
        self, layout: MirrorLayout, streams: torch.Tensor, pre: torch.Tensor
    ) -> torch.Tensor | None:
        """The last position's final hidden state, moved to rank 0 if another rank has it
        (the last chunks are empty when T is small against 2N)."""
        owner = layout.owner(layout.num_tokens - 1)
        rank = self.group.rank
        hidden = None
        if rank == owner:
            # The last position is its owner's last row.
            hidden = self.model.norm(collapse(streams[-1:], pre[-1:]))
        if owner != 0:
            if hidden is None:
                hidden = streams.new_empty((1, self.model.config.hidden_size))
            self.group.broadcast(hidden, src=owner)
        return hidden if rank == 0 else None


def run_follower(rank: int, address: GroupAddress, args: EngineArgs) -> None:
    """Rank 1..N−1: load the model, then run each announced prefill until told to stop."""
    from deepwell.engine.build import load_model

    # Ranks share this machine's cores.
    torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 1) // address.size))
    group = ContextGroup.connect(rank, address)
    model = load_model(args).model
    group.join()
    prefill = ContextParallelPrefill(model, group)
    try:
        while (token_ids := group.receive()) is not None:
            prefill.forward(token_ids, None)
    except dist.DistNetworkError:
        logger.warning("context-parallel rank %d: rank 0 left the group; stopping", rank)
    finally:
        group.close()
