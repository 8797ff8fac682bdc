"""CSA2 attention of one V4.1 layer: its window KV, and for compressed layers the shared
compressed KV, the lightning indexer and the candidate pool (spec/deepseek_v41.md §3.3).

A layer writes its window rows into its ring; a KV source also writes new compressed
entries and index keys into the paged blocks. The caches hold rows as `CacheStorage` keeps
them (by default the released bytes); a layer decodes only what it reads: its window's
rows, the visible index keys, the entries its rows selected. Within a forward, the source's
entries and the latest selection are handed to the layers that reuse them through
`SharedSelection`.
A decode-graph step (FixedDecodePlans) runs its rows together: every read and write goes
through the plans' tensors, in shapes set by the batch size, with no per-sequence loop.
In batch-invariant mode every product over a sequence's rows or its entries runs row by row
in invariant_rows.cpp on the CPU (elsewhere on fixed-shape tiles), every elementwise pass
whose scalar tail would round otherwise in whole vector bodies (layers/batch_invariant.py),
and top-k ties go to the lower entry, so a row's result does not depend on its chunk or its
neighbours.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.batch_invariant import (
    lanewise,
    row_kernels,
    row_linear,
    tiled_keys,
    tiled_rows,
    top_indices,
)
from deepwell.engine.layers.sink_attention import SinkAttentionBackend
from deepwell.engine.layers.step_metadata import (
    CompressedPlan,
    FixedCompressedPlan,
    FixedDecodePlans,
    FixedTailPlan,
    FixedWindowPlan,
    SequenceSpan,
    StepMetadata,
    TailPlan,
    WindowPlan,
)
from deepwell.engine.models.deepseek_v41.cache_formats import qdq_mxfp4
from deepwell.engine.models.deepseek_v41.cache_storage import CacheStorage
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config, LayerPlan, Selection
from deepwell.engine.models.deepseek_v41.packed_modules import Fp8BlockLinear, grouped_projection
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
    """One sequence's compressed state as the latest source left it within this forward;
    entries and index keys as the cache stores them (CacheStorage)."""

    # A decode-graph step keeps its whole batch's state in one, with a leading row axis.
    entries: torch.Tensor  # [entries, stored head_dim]
    index_keys: torch.Tensor  # [entries, stored index_head_dim]
    # [rows, top-k] entry ids, -1 where fewer entries are visible.
    selected: torch.Tensor | None = None
    # [rows, entries] the candidate pool, when a pool source has run.
    pool: torch.Tensor | None = None
    # Decoded when first read, for the other layers reading them in this forward.
    decoded_index_keys: torch.Tensor | None = None
    decoded_entries: torch.Tensor | None = None


@dataclass
class CompressedCaches:
    """One KV source's caches: entries and index keys [blocks, entries_per_block, stored
    dim], and for ratio > 1 its compressor tail ring [slots, rows, 2, head_dim] (float32)."""

    entries: torch.Tensor
    index_keys: torch.Tensor
    tail: torch.Tensor | None


class Compressor(nn.Module):
    """Pools r consecutive positions into one latent entry (a projection at ratio 1)."""

    def __init__(self, config: DeepseekV41Config, ratio: int, invariant: bool) -> None:
        super().__init__()
        self.ratio = ratio
        self.invariant = invariant
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.norm = Norm(config.head_dim, config.rms_norm_eps)
        if ratio > 1:
            self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False)

    def inputs(self, u: torch.Tensor) -> torch.Tensor:
        """What each position contributes to its entry: the latent at ratio 1, the (kv,
        gate) projections otherwise; positions are independent up to here."""
        return self.norm(self.wkv(u)) if self.ratio == 1 else self.projections(u)

    def projections(self, u: torch.Tensor) -> torch.Tensor:
        """Per position (kv, gate) [rows, 2, head_dim], float32 (ratio > 1)."""
        if not self.invariant:
            return self._projections(u)
        if row_kernels(u):
            return torch.stack(
                (row_linear(u, self.wkv.weight), row_linear(u, self.wgate.weight)), 1
            )
        return tiled_rows(self._projections, u)

    def _projections(self, u: torch.Tensor) -> torch.Tensor:
        x = u.float()
        return torch.stack(
            (F.linear(x, self.wkv.weight.float()), F.linear(x, self.wgate.weight.float())), 1
        )

    def pool(self, pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latents of complete groups from (kv, gate) rows [groups·r, 2, dim]."""
        groups = pairs.view(-1, self.ratio, 2, pairs.shape[-1])

        def pooled(groups: torch.Tensor) -> torch.Tensor:
            values, gates = groups[:, :, 0], groups[:, :, 1]
            return self.norm((values * gates.softmax(dim=1)).sum(dim=1).to(dtype))

        if not self.invariant:
            return pooled(groups)
        if row_kernels(groups):
            return self._invariant_pool(groups, dtype)
        return tiled_rows(pooled, groups)

    def _invariant_pool(self, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`pool`'s gate softmax over a group's positions spelled out, its exp in whole vector
        bodies: every step a per-position pass or a sum over the group, in group order."""
        values, gates = groups[:, :, 0], groups[:, :, 1]
        weights = lanewise(torch.exp, gates - gates.amax(dim=1, keepdim=True))
        weights = weights / weights.sum(dim=1, keepdim=True)
        return self.norm((values * weights).sum(dim=1).to(dtype))


class Indexer(nn.Module):
    """Scores visible compressed entries per query and keeps the top-k (lightning indexer)."""

    # The kernel set's top-k (kernel_set.py): per row the ids of the k largest values,
    # ascending, −1 where the value is −inf; None selects in torch.
    top_ids: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def __init__(self, config: DeepseekV41Config, owns_keys: bool, invariant: bool) -> None:
        super().__init__()
        self.invariant = invariant
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
        queries, weights, keys = queries.float(), weights.float(), keys.float()
        if self.invariant and keys.dim() == 2 and row_kernels(queries):
            scores = torch.ops.deepwell_invariant.index_scores(
                queries.contiguous(), weights.contiguous(), keys.contiguous()
            )
        elif self.invariant:
            scores = tiled_keys(
                lambda tile: tiled_rows(lambda q, w: _index_scores(q, w, tile), queries, weights),
                keys,
            )
        else:
            scores = _index_scores(queries, weights, keys)
        entries = torch.arange(keys.shape[-2], device=scores.device)
        hidden = entries.unsqueeze(0) >= visible_counts.unsqueeze(1)
        return scores.masked_fill(hidden, float("-inf"))

    def candidate_pool(self, scores: torch.Tensor, visible_counts: torch.Tensor) -> torch.Tensor:
        """Blocks of entries ranked by their best score; the block holding the newest
        visible entry always stays (spec §3.3, §1.5)."""
        size = self.pool_block_size
        width = scores.shape[1]
        blocks = F.pad(scores, (0, -width % size), value=float("-inf"))
        blocks = blocks.unflatten(-1, (-1, size)).amax(dim=-1)
        newest = (visible_counts - 1).div(size, rounding_mode="floor").unsqueeze(1)
        block_ids = torch.arange(blocks.shape[1], device=blocks.device)
        blocks = blocks.masked_fill(block_ids == newest, float("inf"))
        count = min(self.pool_blocks, blocks.shape[1])
        if self.top_ids is not None:
            ids = self.top_ids(blocks, count)
            # A −1 marks a spare last column, dropped.
            spare = blocks.shape[1]
            keep = torch.zeros(blocks.shape[0], spare + 1, dtype=torch.bool, device=blocks.device)
            keep = keep.scatter_(-1, torch.where(ids >= 0, ids, spare), True)[:, :spare]
        else:
            values, indices = self._top(blocks, count)
            keep = torch.zeros_like(blocks, dtype=torch.bool)
            keep.scatter_(-1, indices, values > float("-inf"))
        return keep.repeat_interleave(size, dim=-1)[:, :width] & torch.isfinite(scores)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k entry ids per row, ascending, −1 where fewer are visible."""
        if self.top_ids is not None:
            return self.top_ids(scores, min(self.topk, scores.shape[1]))
        _, ids = self._top(scores, min(self.topk, scores.shape[1]))
        ids = ids.sort(dim=-1).values
        return torch.where(torch.isfinite(scores.gather(-1, ids)), ids, -1)

    def _top(self, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.invariant:
            return top_indices(values, k)
        top = values.topk(k, dim=-1, sorted=False)
        return top.values, top.indices


def _index_scores(queries, weights, keys) -> torch.Tensor:
    """keys [entries, dim], or [rows, entries, dim] each row its own (a decode-graph step)."""
    per_head = torch.einsum("nhd,cd->nhc" if keys.dim() == 2 else "nhd,ncd->nhc", queries, keys)
    per_head = per_head.relu()
    return (per_head * weights.unsqueeze(-1)).sum(dim=1)


class CSA2Attention(nn.Module):
    def __init__(
        self,
        config: DeepseekV41Config,
        plan: LayerPlan,
        backend: SinkAttentionBackend,
        rotary: PairRotary,
        invariant: bool,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.invariant = invariant
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.groups = config.o_groups
        self.backend = backend
        self.rotary = rotary
        self.qdq = config.cache_qdq
        self.storage = CacheStorage.of(config)
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
        self.compressor = Compressor(config, plan.compress_ratio, invariant) if owns else None
        indexes = plan.selection in (Selection.FULL, Selection.REINDEX)
        self.indexer = Indexer(config, owns, invariant) if indexes else None

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
        window plans for this layer (a decode-graph step's one FixedWindowPlan); `ring` is
        this layer's window ring [slots, ring_rows, stored dim]; `compressed` the caches of
        this layer's KV source; `shared` maps a sequence to its compressed state within
        this forward."""
        if meta.fixed is not None:
            return self.decode_fixed(u, rotation, meta.fixed, windows, ring, compressed, shared)
        qr, q, kv, stored_kv = self.project(u, rotation)
        # Zeros: a batch-invariant step's padding rows belong to no sequence.
        out = torch.zeros_like(q)
        befores = self._windows_before(ring, meta.sequences, windows, kv.dtype)
        for index, (seq, window) in enumerate(zip(meta.sequences, windows, strict=True)):
            rows = seq.rows
            window_keys = torch.cat((befores[index], kv[rows]))
            ring[seq.slot, window.write_rows] = stored_kv[rows][window.write_from :]
            state = None
            if compressed is not None:
                ratio = self.plan.compress_ratio
                plan = meta.compressed[ratio][index]
                if self.compressor is not None:
                    tail = meta.tails[ratio][index] if ratio > 1 else None
                    self._write_entries(u[rows], seq.slot, plan, tail, compressed)
                    shared[index] = SharedSelection(
                        entries=_gather_entries(compressed.entries, plan),
                        index_keys=_gather_entries(compressed.index_keys, plan),
                    )
                state = shared[index]
                self.select(state, u[rows], qr[rows], rotation[rows], plan.visible_counts)
            out[rows] = self.attend(q[rows], window_keys, window.visible, state)
        return self.output(out, rotation)

    def decode_fixed(
        self,
        u: torch.Tensor,
        rotation: torch.Tensor,
        plans: FixedDecodePlans,
        window: FixedWindowPlan,
        ring: torch.Tensor,
        compressed: CompressedCaches | None,
        shared: dict[int, SharedSelection],
    ) -> torch.Tensor:
        """A decode-graph step's rows, one per sequence, each against its window and the
        entries it selects, as `forward` computes them; keys past a row's window or its
        selection are zeroed as well as masked (the padded reads may hold any bytes)."""
        qr, q, kv, stored_kv = self.project(u, rotation)
        slots = plans.slots
        before = self.storage.window.decode(ring[slots.unsqueeze(1), window.ring_rows], kv.dtype)
        ring[slots, window.write_rows] = stored_kv
        keys = torch.cat((before, kv.unsqueeze(1)), dim=1)
        valid = window.visible
        if compressed is not None:
            ratio = self.plan.compress_ratio
            plan = plans.compressed[ratio]
            if self.compressor is not None:
                self._write_entries_fixed(u, slots, plan, plans.tails.get(ratio), compressed)
                shared[0] = SharedSelection(
                    entries=compressed.entries[plan.blocks].flatten(1, 2),
                    index_keys=compressed.index_keys[plan.blocks].flatten(1, 2),
                )
            state = shared[0]
            self.select(state, u, qr, rotation, plan.visible_counts)
            picked = torch.take_along_dim(
                state.entries, state.selected.clamp(min=0).unsqueeze(-1), dim=1
            )
            keys = torch.cat((keys, self.storage.entries.decode(picked, q.dtype)), dim=1)
            valid = torch.cat((valid, state.selected >= 0), dim=1)
        keys = keys.masked_fill(~valid.unsqueeze(-1), 0)
        # Every key is a row's own: passed as its selection, with no shared window keys.
        out = self.backend.forward(
            q, keys.new_empty(0, keys.shape[-1]), valid[:, :0], keys, valid, self.attn_sink
        )
        return self.output(out, rotation)

    def _write_entries_fixed(
        self,
        u: torch.Tensor,
        slots: torch.Tensor,
        plan: FixedCompressedPlan,
        tail: FixedTailPlan | None,
        caches: CompressedCaches,
    ) -> None:
        """Every row pools its group and writes entry p // r; a row that completes no group
        writes back the bytes already there (FixedCompressedPlan)."""
        inputs = self.compressor.inputs(u)
        if tail is None:
            latents = inputs
        else:
            before = caches.tail[slots.unsqueeze(1), tail.read_rows]
            caches.tail[slots, tail.write_rows] = inputs
            groups = torch.cat((before, inputs.unsqueeze(1)), dim=1)
            latents = self.compressor.pool(groups.flatten(0, 1), u.dtype)
        entries, keys = self.entries(latents, plan.new_positions)
        for cache, new in ((caches.entries, entries), (caches.index_keys, keys)):
            kept = cache[plan.new_blocks, plan.new_offsets]
            written = torch.where(plan.has_new.unsqueeze(1), new.to(cache.dtype), kept)
            cache[plan.new_blocks, plan.new_offsets] = written

    def project(
        self, u: torch.Tensor, rotation: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the query latent qr, the rotated queries q [rows, heads, dim], the
        row's window KV [rows, dim] and that KV as the ring stores it; rows are independent
        here."""
        qr = self.q_norm(self.wq_a(u))
        q = self.wq_b(qr).view(-1, self.num_heads, self.head_dim)
        q = self.rotary.apply(q, rotation)
        kv = self.rotary.apply(self.kv_norm(self.wkv(u)), rotation)
        return qr, q, *self.storage.window.rounded_and_stored(kv)

    def read_window(
        self, ring: torch.Tensor, slot: int, rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The values of a slot's window ring rows, in `dtype`."""
        return self.storage.window.decode(ring[slot, rows], dtype)

    def _windows_before(
        self,
        ring: torch.Tensor,
        sequences: list[SequenceSpan],
        windows: list[WindowPlan],
        dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """Each sequence's window ring rows before its chunk, decoded in one pass (rows are
        decoded independently, so this is what each sequence's own decode gives)."""
        if not windows:
            return []
        sizes = [len(window.ring_rows) for window in windows]
        slots = torch.tensor([seq.slot for seq in sequences], device=ring.device)
        slots = slots.repeat_interleave(
            torch.tensor(sizes, device=ring.device), output_size=sum(sizes)
        )
        rows = torch.cat([window.ring_rows for window in windows])
        return list(self.storage.window.decode(ring[slots, rows], dtype).split(sizes))

    def write_window(
        self, ring: torch.Tensor, slot: int, rows: torch.Tensor, keys: torch.Tensor
    ) -> None:
        """Store window keys already rounded (`project`'s values, gathered by context
        parallelism): fp8 rounding is idempotent in value (a group whose largest code
        rounds to 224 re-encodes with half the scale and twice the codes), so they unpack
        to themselves."""
        ring[slot, rows] = self.storage.window.encode(keys, ring.dtype)

    def attend(
        self,
        q: torch.Tensor,
        window_keys: torch.Tensor,
        visible: torch.Tensor,
        state: SharedSelection | None,
        rows: slice = slice(None),
    ) -> torch.Tensor:
        """Queries q of one sequence against its window keys and, when `state` holds
        entries, the entries its `rows` selected."""
        selected_keys = selected_valid = None
        if state is not None and state.entries.shape[0]:
            selected = state.selected[rows]
            selected_valid = selected >= 0
            selected_keys = self._selected_entries(state, selected.clamp(min=0), q.dtype)
        return self.backend.forward(
            q, window_keys, visible, selected_keys, selected_valid, self.attn_sink
        )

    def _selected_entries(
        self, state: SharedSelection, selected: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The values of the entries `selected` [rows, k]: a decode picks only those, unless
        the rows pick more than there are entries (a prefill), then every entry once."""
        if selected.numel() < state.entries.shape[0]:
            return self.storage.entries.decode(state.entries[selected], dtype)
        if state.decoded_entries is None:
            state.decoded_entries = self.storage.entries.decode(state.entries, dtype)
        return state.decoded_entries[selected]

    def output(self, out: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Attention outputs [rows, heads, dim] → the layer's output [rows, hidden]."""
        out = self.rotary.apply(out, rotation, inverse=True)
        grouped = out.view(-1, self.groups, self.num_heads // self.groups * self.head_dim)

        def project(grouped: torch.Tensor) -> torch.Tensor:
            return grouped_projection(self.wo_a, grouped)

        if not self.invariant:
            projected = project(grouped)
        elif not row_kernels(grouped):
            projected = tiled_rows(project, grouped)
        elif isinstance(self.wo_a, Fp8BlockLinear):
            # The packed product goes row by row already (blockscaled.cpp).
            projected = project(grouped)
        else:
            weights = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
            projected = torch.stack(
                [row_linear(grouped[:, g], weights[g]) for g in range(self.groups)], dim=1
            ).to(grouped.dtype)
        return self.wo_b(projected.flatten(1))

    def select(self, state: SharedSelection, u, qr, rotation, visible_counts: torch.Tensor) -> None:
        """An index source or reindex layer scores the entries for one sequence's rows and
        leaves its selection (and a pool source its candidate pool) in `state`; a reuse
        layer keeps the selection there."""
        if self.indexer is None or not state.entries.shape[0]:
            return
        indexer = self.indexer
        queries = indexer.wq_b(qr).view(-1, indexer.num_heads, indexer.head_dim)
        queries = self._rotate(queries, rotation)
        if self.qdq:
            queries = qdq_mxfp4(queries)
        weights = indexer.weights_proj(u).float() * (
            indexer.head_dim**-0.5 * indexer.num_heads**-0.5
        )
        if state.decoded_index_keys is None:
            state.decoded_index_keys = self.storage.index_keys.decode(
                state.index_keys, queries.dtype
            )
        scores = indexer.scores(queries, weights, state.decoded_index_keys, visible_counts)
        if self.plan.builds_pool:
            state.pool = indexer.candidate_pool(scores, visible_counts)
        elif self.plan.uses_pool:
            scores = scores.masked_fill(~state.pool, float("-inf"))
        state.selected = indexer.select(scores)

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
        inputs = self.compressor.inputs(u)
        if tail is not None:
            ring = caches.tail
            pairs_before = ring[slot, tail.read_rows]
            ring[slot, tail.write_rows] = inputs[tail.write_from :]
            inputs = torch.cat((pairs_before, inputs))
        latents = self.latents(inputs, plan.num_entries - plan.first_new, u.dtype)
        if latents.shape[0]:
            self.store_entries(caches, plan, *self.entries(latents, plan.new_positions))

    def latents(self, inputs: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The latents of `count` entries from the compressor inputs (Compressor.inputs) of
        consecutive positions from a group boundary on; at ratio > 1 a trailing incomplete
        group waits in the tail."""
        if self.compressor.ratio == 1:
            return inputs[:count]
        return self.compressor.pool(inputs[: count * self.compressor.ratio], dtype)

    def entries(
        self, latents: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed entries and their index keys from latents whose groups start at
        `positions`, as the cache stores them (spec §3.7). Encoded from the unrounded
        values: nvfp4 rounding is not idempotent (a small group's subnormal e4m3 scale can
        round down when recomputed from rounded values)."""
        if self.invariant and row_kernels(latents):
            rotation = self.rotary.invariant_rotation(positions)
        elif self.invariant:
            rotation = tiled_rows(self.rotary.rotation, positions)
        else:
            rotation = self.rotary.rotation(positions)
        entries = self._rotate(latents, rotation)
        keys = self._rotate(self.indexer.k_norm(self.indexer.wk(latents)), rotation)
        return (
            self.storage.entries.encode(entries, latents.dtype),
            self.storage.index_keys.encode(keys, latents.dtype),
        )

    @staticmethod
    def store_entries(
        caches: CompressedCaches, plan: CompressedPlan, entries: torch.Tensor, keys: torch.Tensor
    ) -> None:
        caches.entries[plan.new_blocks, plan.new_offsets] = entries.to(caches.entries.dtype)
        caches.index_keys[plan.new_blocks, plan.new_offsets] = keys.to(caches.index_keys.dtype)

    def _rotate(self, values: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Rotary over a sequence's rows or entries; in fixed tiles when batch-invariant
        (a complex product's scalar tail path rounds otherwise than its vector one); the
        native rotation goes element by element."""
        if self.invariant and not self.rotary.is_native(values):
            return tiled_rows(self.rotary.apply, values, rotation)
        return self.rotary.apply(values, rotation)


def _gather_entries(cache: torch.Tensor, plan: CompressedPlan) -> torch.Tensor:
    """A sequence's first `num_entries` entries from its blocks, in order."""
    return cache.index_select(0, plan.blocks).flatten(0, 1)[: plan.num_entries]
