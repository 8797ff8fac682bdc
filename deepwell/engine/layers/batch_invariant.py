"""Batch-invariant kernels: a row's result is bitwise the same whatever else is in the batch.

Used when EngineArgs.batch_invariant is on (spec/deepinfer.md §1.6): bf16 CPU linears on AMX
tiles where the CPU has them, else on a row-wise kernel, and the others over fixed row tiles, attention one row at a time in the C++
paged kernel (or over fixed query tiles and whole KV blocks), prefill or decode, and sink
attention over a fixed number of key slots per query. On the CPU, DeepSeek-V4.1's other
products run row by row in invariant_rows.cpp (`row_kernels`) and its elementwise passes
in whole vector bodies (`lanewise`), with no padding to row tiles.
"""

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.amx_linear import amx_kernel_ready, amx_linear, tile_layout
from deepwell.engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    QueryTiles,
    RowBlockLists,
)
from deepwell.engine.layers.blockscaled import native_kernel
from deepwell.engine.layers.cpp_paged import MAX_GROUP
from deepwell.engine.layers.decode_kernel import (
    load_decode_kernel,
    load_invariant_rows_kernel,
)
from deepwell.engine.layers.packed_linear import PackedLinear
from deepwell.engine.layers.sink_attention import SinkAttentionBackend

logger = logging.getLogger(__name__)

# CPU GEMMs (MKL for float32, oneDNN for bf16) pick their blocking, hence a row's reduction
# order, from the row count. Measured: float32 rows differ between 1, 2-3 and 7 or more
# rows, and between multiples of 8; bf16 rows on an AMX Xeon differ between up to 32 rows
# and more (36/37 for 1536 → 576), and again between 33-768 rows and 2,048, at 1 or 2
# threads; capped at AVX-512 bf16, 1536 → 576 rows differ between 10 and 11 rows. So a
# batch-invariant linear never lets the row count reach the kernel: it runs ROW_TILE rows
# per call, zero-padded, and a row's bits depend on its own values only (the rows of a call
# do not mix; tests/engine/layers/test_batch_invariant.py checks it where the tests run).
# 64: SmolLM2's linears (AMX Xeon, 1 thread) then take 1.45x one call's time for a lone
# decode, 1.25x for a 32-row decode step and 2x for a 1,024-row prefill (32 rows: 1.3x,
# 1.1x, 2.9x; 16 rows: 1x, 1.3x, 4.3x); docs/benchmarks.md.
ROW_TILE = 64
# Keys per call of a product over a key set that grows with the context (DeepSeek-V4.1's
# indexer over compressed entries): key j always lands in call j // KEY_TILE, column
# j % KEY_TILE, of a call shaped like every other.
KEY_TILE = 64
# Rows of an attention product from which a row's bits depend neither on the row count nor
# on the row's place (measured with torch 2.13's CPU kernels: bfloat16 from one row, float32
# from 6, padded to 8 here; tests/engine/layers/test_batch_invariant.py checks it where the
# tests run). So a decode is a one-row tile, and a prefill chunk's rows go in tiles as long
# as pays.
MIN_PRODUCT_ROWS = {torch.bfloat16: 1, torch.float32: 8}
# Rows per tile of a prefill chunk: a tile gathers each KV block it sees once for all its
# rows, and its chunk's last tile is mostly padding.
CHUNK_TILE = 16
# (tile, block) pairs times tile rows scored per attention call: bounds the scores and the
# gathered keys and values at ~100 MB for SmolLM2 in bf16, however long the contexts.
MAX_PAIR_ROWS = 2048
# Scoring the first `span` pool blocks where they lie reads them once; gathering reads,
# writes and rereads the pairs' blocks. In place while span <= 3 x pairs (as torch_paged).
IN_PLACE_SPAN_FACTOR = 3
# ATen's vectorised elementwise loop takes 2 x Vectorized<T>::size() elements a turn (64 for
# bfloat16 on AVX-512, fewer elsewhere) and sends the rest through the scalar op, whose exp or
# sigmoid rounds otherwise; a pass over a multiple of LANE_TILE elements has no such rest.
LANE_TILE = 64
# at::internal::GRAIN_SIZE: a pass over fewer elements runs on one thread (a thread's share
# would start its own vector loop, and its own scalar rest, anywhere).
LANEWISE_MAX = 32768


def tiled_rows(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn over ROW_TILE-row slices of the inputs (rows on dim 0, zero-padded to whole tiles),
    concatenated: when fn treats rows independently, every call has the same shapes, so a
    row's bits depend on its own values only. Fixed shapes matter beyond GEMMs: an
    elementwise kernel runs a tensor's last few elements through its scalar path (another
    exp or sigmoid than the vector one), so a row's bits would follow the element count."""
    rows = inputs[0].shape[0]
    num_tiles = max(-(-rows // ROW_TILE), 1)
    padded = [_padded_rows(x, num_tiles * ROW_TILE) for x in inputs]
    if num_tiles == 1:
        return fn(*padded)[:rows]
    tiles = zip(*(x.split(ROW_TILE) for x in padded), strict=True)
    return torch.cat([fn(*parts) for parts in tiles])[:rows]


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[: x.shape[0]] = x
    return padded


def lanewise(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """fn, an elementwise function of same-shaped tensors, over their elements flattened and
    zero-padded to whole LANE_TILEs, at most LANEWISE_MAX a call: every element goes through
    the vector body of each pass on one thread, so its bits depend on its own value only,
    whatever the element count (rows and their widths)."""
    shape = inputs[0].shape
    count = inputs[0].numel()
    padding = -count % LANE_TILE if count else LANE_TILE
    flat = [F.pad(x.reshape(-1), (0, padding)) for x in inputs]
    if count + padding <= LANEWISE_MAX:
        out = fn(*flat)
    else:
        pieces = zip(*(x.split(LANEWISE_MAX) for x in flat), strict=True)
        out = torch.cat([fn(*piece) for piece in pieces])
    return out[:count].view(shape)


@functools.cache
def _row_kernels_loaded() -> bool:
    loaded = load_invariant_rows_kernel()
    if loaded.module is None:
        logger.warning("batch-invariant products run on padded row tiles: %s", loaded.reason)
    return loaded.module is not None


def row_kernels(tensor: torch.Tensor) -> bool:
    """Whether invariant_rows.cpp (torch.ops.deepwell_invariant) takes `tensor`'s rows: on the
    CPU where it builds. Elsewhere the invariant paths run ROW_TILE-row tiles."""
    return tensor.is_cpu and _row_kernels_loaded()


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [rows, out] = x @ weight.T for x [rows, in] and weight [out, in] (float32 or
    bfloat16), each output one dot product in a fixed order (row_kernels must hold)."""
    return torch.ops.deepwell_invariant.linear(x.contiguous(), weight.contiguous())


def tiled_keys(fn: Callable[[torch.Tensor], torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """fn over KEY_TILE-key slices of keys [num_keys, ...] (zero-padded), its results
    [..., KEY_TILE] concatenated on the last dim and cut to num_keys."""
    num_keys = keys.shape[0]
    padded = keys.new_zeros(max(-(-num_keys // KEY_TILE), 1) * KEY_TILE, *keys.shape[1:])
    padded[:num_keys] = keys
    return torch.cat([fn(tile) for tile in padded.split(KEY_TILE)], dim=-1)[..., :num_keys]


def top_indices(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row and their indices, ties to the lower index: the same
    choice whatever the row's length (topk's choice among ties follows the length)."""
    ranked = values.sort(dim=-1, descending=True, stable=True)
    return ranked.values[..., :k], ranked.indices[..., :k]


class RowTiledLinear(nn.Linear):
    """A linear over ROW_TILE-row calls, the rows zero-padded to a whole number of calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_rows(super().forward, x)


class RowTiledPackedLinear(RowTiledLinear, PackedLinear):
    """A packed bf16 linear over ROW_TILE-row calls."""


class RowwiseLinear(nn.Linear):
    """A bf16 or float32 CPU linear on blockscaled.cpp's row-wise kernel of its dtype
    (`bf16_linear`, `f32_linear`), all rows in one call, unpadded.

    Each output is one float32 dot product in a fixed order, whatever the row count (the
    kernel's rows never mix), rounded once to x's dtype after the bias. Padding every call to
    ROW_TILE rows cost 3.2x in tok/s on an AVX-512 EPYC without AMX, where oneDNN computes
    the padding rows at full price (a lone decode's linears and lm_head 64 times over);
    docs/benchmarks-log.md, "Batch invariance on AVX-512 without AMX".
    """

    kernel: ModuleType

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        linear = kernel.f32_linear if self.weight.dtype == torch.float32 else kernel.bf16_linear
        out = linear(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


class AmxTileLinear(nn.Linear):
    """A bf16 CPU linear on AMX tiles (amx_linear.cpp), all rows in one call, the weight read
    from its tile layout (`tiles`, packed once); rounded once to bf16 after the bias.

    Each output is one float32 tile accumulator over the input's 32-wide blocks in order, and
    a tile product computes a row from that row alone: a row's bits are the same whatever the
    row count. At 16 rows RowwiseLinear's vector dot products took 1.76x the default step,
    whose oneDNN linears run on these tiles; docs/benchmarks-log.md, "Batch invariance on
    AMX tiles".
    """

    tiles: torch.Tensor

    @torch.no_grad()
    def retile(self) -> None:
        """(Re)make the tiles from `weight`: once at load, and after the weight changes in
        place (an expert moved by EPLB)."""
        self.register_buffer("tiles", tile_layout(self.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = amx_linear(x.reshape(-1, self.in_features), self.tiles, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def tile_linears(model: nn.Module) -> None:
    """Make the model's linears batch invariant in place (weights untouched): bf16 CPU ones
    run AmxTileLinear where the CPU has AMX tiles and amx_linear.cpp builds, else
    RowwiseLinear where blockscaled.cpp builds, as float32 CPU ones do; every other one runs
    ROW_TILE-row calls (a lone decode's linears 64 times over)."""
    tiled = {nn.Linear: RowTiledLinear, PackedLinear: RowTiledPackedLinear}
    for module in model.modules():
        if type(module) not in tiled:
            continue
        kernel = rowwise_kernel(module.weight)
        if kernel is None:
            module.__class__ = tiled[type(module)]
            continue
        # The packed copies of the weight are no longer read.
        for name in ("tiles", "packed_weight", "panels"):
            module._buffers.pop(name, None)
        if module.weight.dtype == torch.bfloat16 and amx_kernel_ready():
            module.__class__ = AmxTileLinear
            module.retile()
            continue
        module.__class__ = RowwiseLinear
        module.kernel = kernel


def rowwise_kernel(weight: torch.Tensor) -> ModuleType | None:
    """blockscaled.cpp where `weight` is a bf16 or float32 CPU matrix its kernel takes, else
    None."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        return None
    if not weight.is_contiguous():
        return None
    return native_kernel()


def tile_queries(spans: list[tuple[int, int, int, list[int]]], block_size: int) -> list[QueryTiles]:
    """Spans of (first step row, first position, rows, block ids) → the step's one-row tiles
    (decodes, one-token chunks) and its chunk tiles, each kind laid out apart."""
    one_row = [span for span in spans if span[2] == 1]
    chunks = [span for span in spans if span[2] > 1]
    return [
        _lay_out(spans, width, block_size)
        for spans, width in ((one_row, 1), (chunks, CHUNK_TILE))
        if spans
    ]


def _lay_out(
    spans: list[tuple[int, int, int, list[int]]], width: int, block_size: int
) -> QueryTiles:
    rows: list[list[int]] = []
    positions: list[list[int]] = []
    pair_tiles: list[int] = []
    pair_blocks: list[int] = []
    pair_starts: list[int] = []
    tile_num_pairs: list[int] = []
    for first_row, first_position, num_rows, block_ids in spans:
        for offset in range(0, num_rows, width):
            used = min(width, num_rows - offset)
            padding = [-1] * (width - used)
            rows.append(list(range(first_row + offset, first_row + offset + used)) + padding)
            first = first_position + offset
            positions.append(list(range(first, first + used)) + padding)
            num_blocks = (first + used - 1) // block_size + 1
            pair_tiles += [len(rows) - 1] * num_blocks
            pair_blocks += block_ids[:num_blocks]
            pair_starts += range(0, num_blocks * block_size, block_size)
            tile_num_pairs.append(num_blocks)
    slot_positions = torch.tensor(positions, dtype=torch.long)
    pair_tile_tensor = torch.tensor(pair_tiles, dtype=torch.long)
    keys = torch.tensor(pair_starts, dtype=torch.long)[:, None] + torch.arange(block_size)
    span = max(pair_blocks) + 1
    in_place = len(set(pair_blocks)) == len(pair_blocks) and span <= IN_PLACE_SPAN_FACTOR * len(
        pair_blocks
    )
    return QueryTiles(
        rows=torch.tensor(rows, dtype=torch.long),
        pair_tiles=pair_tile_tensor,
        pair_blocks=torch.tensor(pair_blocks, dtype=torch.long),
        pair_masks=keys[:, None, :] > slot_positions[pair_tile_tensor][:, :, None],
        tile_num_pairs=tile_num_pairs,
        # In place when one call takes every pair, or each call would score the whole span.
        pair_block_span=span if in_place and len(pair_blocks) * width <= MAX_PAIR_ROWS else None,
    )


def row_block_lists(spans: list[tuple[int, int, int, list[int]]], block_size: int) -> RowBlockLists:
    """Spans of (first step row, first position, rows, block ids), in step row order → each
    row's own blocks up to its position, for the C++ paged kernel."""
    ids: list[int] = []
    starts, lens, sequence_starts = [0], [], [0]
    for _, first_position, num_rows, block_ids in spans:
        for position in range(first_position, first_position + num_rows):
            used = position // block_size + 1
            ids += block_ids[:used]
            starts.append(len(ids))
            lens.append(position + 1)
        sequence_starts.append(len(lens))
    return RowBlockLists(
        block_ids=torch.tensor(ids, dtype=torch.long),
        block_starts=torch.tensor(starts, dtype=torch.long),
        context_lens=torch.tensor(lens, dtype=torch.long),
        sequence_starts=torch.tensor(sequence_starts, dtype=torch.long),
    )


class BatchInvariantAttention(AttentionBackend):
    """Every query row alone over its own KV blocks: paged_decode.cpp where it loads (CPU,
    at most MAX_GROUP query heads per KV head), else query tiles with fixed-shape ops.

    The kernel walks a row's blocks in order with an online softmax, in the same arithmetic
    whatever the rows beside it, for prefill rows as for decodes (each row sees the keys up
    to its own position): so a row's bits depend on its own query and keys only. One call
    for the step's rows, where the tiles took ~40 torch ops a layer (31% of a batch-1 step
    and 35% at batch 16 on the EPYC, docs/benchmarks-log.md).

    The tile path:

    A row's scores are one row of a [rows, head_dim] x [head_dim, block] product, its output
    one row of a [rows, block] x [block, head_dim] one: from MIN_PRODUCT_ROWS rows on, the
    same bits whatever the row count and the row's place. Softmax max and sums run over
    whole blocks, then across the row's blocks in block order, a block it cannot see adding
    exact zeros. So a row's result is the same whatever the chunking of its prompt or the
    rows beside it, and a decode is a one-row tile. No SDPA: its kernel choice and reduction
    order depend on the query count.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.kernel = load_decode_kernel().module if self.group <= MAX_GROUP else None

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        lists = meta.row_block_lists
        if self.kernel is not None and lists is not None and key_cache.device.type == "cpu":
            self.kernel.paged_store(
                k, v, key_cache, value_cache, meta.slot_blocks, meta.slot_offsets
            )
            return self.kernel.paged_decode(
                q,
                key_cache,
                value_cache,
                lists.block_ids,
                lists.block_starts,
                lists.context_lens,
                lists.sequence_starts,
                self.scale,
                False,
            )
        if meta.query_tiles is None:
            raise ValueError("batch-invariant attention needs the step's query tiles")
        key_cache[meta.slot_blocks, :, meta.slot_offsets] = k
        value_cache[meta.slot_blocks, :, meta.slot_offsets] = v
        # Padding slots (row -1) read and write one scratch row past the step's rows.
        padded_q = torch.cat([q * self.scale, q.new_zeros(1, *q.shape[1:])])
        out = q.new_empty(q.shape[0] + 1, *q.shape[1:])
        for tiles in meta.query_tiles:
            max_pairs = MAX_PAIR_ROWS // tiles.rows.shape[1]
            first_tile = first_pair = num_pairs = 0
            for tile, count in enumerate(tiles.tile_num_pairs):
                num_pairs += count
                if tile + 1 < len(tiles.tile_num_pairs) and num_pairs - first_pair < max_pairs:
                    continue
                rows = tiles.rows[first_tile : tile + 1]
                pairs = slice(first_pair, num_pairs)
                out[rows.flatten()] = self._attend(
                    padded_q[rows],
                    key_cache,
                    value_cache,
                    tiles.pair_blocks[pairs],
                    tiles.pair_block_span,
                    tiles.pair_tiles[pairs] - first_tile,
                    tiles.pair_masks[pairs],
                )
                first_tile, first_pair = tile + 1, num_pairs
        return out[:-1]

    def _attend(self, q, key_cache, value_cache, blocks, span, pair_tiles, masks) -> torch.Tensor:
        """q: [tiles, width, heads, dim]; caches: [num_blocks, kv_heads, block, dim];
        blocks: the block of each (tile, block) pair. With a `span`, every pair has its own
        block below it, scored where it lies: each block's product has the same shape as
        when gathered, so the same bits."""
        num_tiles, width = q.shape[:2]
        kv_heads, group, dim = self.num_kv_heads, self.group, self.head_dim
        tile_rows = width * group
        # [tiles, kv_heads, width * group, dim]: a KV head's query rows as one matrix, with
        # zero rows up to the product rows whose bits do not depend on the count.
        grouped = q.view(num_tiles, width, kv_heads, group, dim).transpose(1, 2)
        grouped = grouped.reshape(num_tiles, kv_heads, tile_rows, dim)
        padding_rows = max(MIN_PRODUCT_ROWS[q.dtype] - tile_rows, 0)
        if padding_rows:
            grouped = F.pad(grouped, (0, 0, 0, padding_rows))
        pair_queries = grouped.index_select(0, pair_tiles)
        if span is None:
            keys = key_cache.index_select(0, blocks)
            scores = torch.matmul(pair_queries, keys.transpose(-1, -2))
        else:
            queries = pair_queries.new_zeros(span, *pair_queries.shape[1:])
            queries.index_copy_(0, blocks, pair_queries)
            scores = torch.matmul(queries, key_cache[:span].transpose(-1, -2))
            scores = scores.index_select(0, blocks)
        num_pairs, block = scores.shape[0], scores.shape[-1]
        scores = scores[:, :, :tile_rows].float().view(num_pairs, kv_heads, width, group, block)
        scores.masked_fill_(masks[:, None, :, None, :], float("-inf"))
        index = pair_tiles.view(-1, 1, 1, 1).expand(-1, kv_heads, width, group)
        row_max = torch.full((num_tiles, kv_heads, width, group), float("-inf"))
        row_max.scatter_reduce_(0, index, scores.amax(dim=-1), "amax")
        # Padding slots see nothing; a zero max keeps their weights 0 instead of NaN.
        row_max.masked_fill_(row_max == float("-inf"), 0.0)
        weights = torch.exp(scores - row_max.index_select(0, pair_tiles).unsqueeze(-1))
        total = torch.zeros(num_tiles, kv_heads, width, group)
        total.index_add_(0, pair_tiles, weights.sum(dim=-1))
        weights = weights.view(num_pairs, kv_heads, tile_rows, block).to(q.dtype)
        if span is None:
            if padding_rows:
                weights = F.pad(weights, (0, 0, 0, padding_rows))
            partial = torch.matmul(weights, value_cache.index_select(0, blocks))
        else:
            spread = weights.new_zeros(span, kv_heads, tile_rows + padding_rows, block)
            spread[blocks, :, :tile_rows] = weights
            partial = torch.matmul(spread, value_cache[:span]).index_select(0, blocks)
        out = torch.zeros(num_tiles, kv_heads, tile_rows, dim)
        out.index_add_(0, pair_tiles, partial[:, :, :tile_rows].float())
        out = out.view(num_tiles, kv_heads, width, group, dim)
        out /= total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
        return out.transpose(1, 2).reshape(num_tiles * width, self.num_heads, dim).to(q.dtype)


class BatchInvariantSinkAttention(SinkAttentionBackend):
    """Sink attention over a fixed number of key slots per query: each query alone in
    invariant_rows.cpp on the CPU, else on ROW_TILE-query calls.

    A query's visible window keys are right-aligned into `window` slots (its own key last,
    so a key's slot is its distance from the query, however the prompt was chunked), its
    valid selected entries packed into `max_selected` slots in entry order; scores, softmax
    and output then run over the same slots in the same order whatever the chunk, the
    query's place in it or the step's other rows. Empty slots add exact zeros.
    """

    def forward(self, q, window_keys, window_visible, selected_keys, selected_valid, sinks):
        keys, valid = _right_aligned(window_keys, window_visible, self.window)
        num_queries, dim = q.shape[0], window_keys.shape[-1]
        if selected_keys is None:
            picked = keys.new_zeros(num_queries, self.max_selected, dim)
            picked_valid = valid.new_zeros(num_queries, self.max_selected)
        else:
            picked, picked_valid = _packed(selected_keys, selected_valid, self.max_selected)
        keys = torch.cat((keys, picked), 1).float()
        valid = torch.cat((valid, picked_valid), 1)
        if row_kernels(q):
            return torch.ops.deepwell_invariant.sink_attention(
                q.contiguous(), keys, valid, sinks.float().contiguous(), self.scale
            )
        return tiled_rows(lambda *tile: self._attend(*tile, sinks), q, keys, valid)

    def _attend(self, q, keys, valid, sinks) -> torch.Tensor:
        """q [tile, heads, dim], keys [tile, slots, dim] float32, valid [tile, slots]."""
        scores = torch.matmul(q.float(), keys.transpose(1, 2)) * self.scale
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        # A padding query sees only the sink: weight 1 there, no NaN.
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)
        return torch.matmul(probs[..., :-1], keys).to(q.dtype)


def _right_aligned(keys: torch.Tensor, visible: torch.Tensor, width: int):
    """keys [k, dim], visible [n, k] (each row's visible keys contiguous in position order)
    → [n, width, dim] with row i's visible keys ending at slot width - 1, and their mask."""
    num_keys = keys.shape[0]
    slot = width - visible.sum(1, keepdim=True) + visible.cumsum(1) - 1
    rows, columns = visible.nonzero(as_tuple=True)
    index = torch.full((visible.shape[0], width), num_keys, dtype=torch.long)
    index[rows, slot[rows, columns]] = columns
    padded = torch.cat((keys, keys.new_zeros(1, keys.shape[-1])))
    return padded[index], index < num_keys


def _packed(selected: torch.Tensor, valid: torch.Tensor, width: int):
    """selected [n, k, dim] with valid [n, k] (k <= width) → the valid ones first, in order,
    in [n, width, dim], and their mask."""
    rows, columns = valid.nonzero(as_tuple=True)
    slot = (valid.cumsum(1) - 1)[rows, columns]
    packed = selected.new_zeros(valid.shape[0], width, selected.shape[-1])
    packed[rows, slot] = selected[rows, columns]
    mask = valid.new_zeros(valid.shape[0], width)
    mask[rows, slot] = True
    return packed, mask
