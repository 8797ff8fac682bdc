"""A scheduled step's rows as model inputs, gathered chunk by chunk (runner.py): token ids,
positions, sequence spans and token history (`StepRows`), and what paged full attention
needs of the same rows (`PagedRows` → `AttentionMetadata`; for a decode-graph step,
`fixed_decode_metadata` → `FixedDecodeMetadata`, and over rings and compressed caches
`fixed_decode_plans` → `FixedDecodePlans`).
"""

from dataclasses import dataclass, field

import torch

from deepwell.engine.device import long_tensor
from deepwell.engine.kv.layout import CacheRole, KVLayout
from deepwell.engine.layers.attention import (
    AttentionMetadata,
    FixedDecodeMetadata,
    PrefillSpan,
)
from deepwell.engine.layers.batch_invariant import row_block_lists, tile_queries
from deepwell.engine.layers.step_metadata import (
    FixedCompressedPlan,
    FixedDecodePlans,
    FixedTailPlan,
    FixedWindowPlan,
    ImagePiece,
    SequenceSpan,
    StepImages,
)
from deepwell.engine.request import Request
from deepwell.engine.scheduler import ScheduledChunk


@dataclass
class StepRows:
    """The step's input rows, a chunk's rows after the chunk before."""

    block_size: int
    # Earlier token ids each row carries (KVLayout.token_history); 0: none.
    history_depth: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # Per chunk: its last row, and its span's (row, num_rows, start, slot, replay_start).
    last_rows: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # Per chunk, one after another: the block ids covering its positions.
    table_ids: list[int] = field(default_factory=list)
    table_lengths: list[int] = field(default_factory=list)
    # Per row: its earlier token ids, newest first (-1 before position 0).
    history: list[list[int]] = field(default_factory=list)
    # Rows holding a request's pending token, known only once the step before samples.
    pending_rows: list[tuple[int, Request]] = field(default_factory=list)
    # (row, column) of history entries that are a request's pending token.
    pending_history: list[tuple[int, int, Request]] = field(default_factory=list)
    # The rows of image spans the chunks cover.
    image_pieces: list[ImagePiece] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk) -> None:
        """The chunk's rows."""
        request, start = chunk.request, chunk.start
        end = start + chunk.num_rows
        row = len(self.input_ids)
        known = request.token_ids[start : start + chunk.num_tokens]
        pending_position = None
        if len(known) < chunk.num_tokens:
            # Its last input is the token the step before samples; filled in at launch.
            self.pending_rows.append((row + len(known), request))
            pending_position = start + len(known)
            known.append(0)
        self.input_ids += known + chunk.draft
        if self.history_depth:
            self._add_history(request, start, known + chunk.draft, pending_position, row)
        self.positions += range(start, end)
        for image, (first, last, _) in zip(request.images, request.image_spans, strict=True):
            lo, hi = max(first, start), min(last, end)
            if lo < hi:
                self.image_pieces.append(ImagePiece(row + lo - start, image, lo - first, hi - lo))
        self.last_rows.append(row + chunk.num_rows - 1)
        slot = -1 if request.slot is None else request.slot
        self.spans.append((row, chunk.num_rows, start, slot, request.replay_start))
        table = request.block_ids[: -(-end // self.block_size)]
        self.table_ids += table
        self.table_lengths.append(len(table))

    def sequences(self) -> list[SequenceSpan]:
        """The chunks' sequence spans. Their block tables are views of one tensor: a
        `torch.tensor` call per chunk cost ~0.4 ms of a 64-row decode step's prepare."""
        tables = long_tensor(self.table_ids).split(self.table_lengths)
        return [
            SequenceSpan(row, num_rows, start, slot, table, replay_start)
            for (row, num_rows, start, slot, replay_start), table in zip(
                self.spans, tables, strict=True
            )
        ]

    def images(self) -> StepImages | None:
        """The step's image rows; None without any."""
        if not self.image_pieces:
            return None
        mask = torch.zeros(len(self.input_ids), dtype=torch.bool)
        rows = []
        for piece in self.image_pieces:
            mask[piece.row : piece.row + piece.count] = True
            rows += range(piece.row, piece.row + piece.count)
        return StepImages(mask, self.image_pieces, torch.tensor(rows, dtype=torch.long))

    def token_history(self) -> torch.Tensor:
        """[rows, history_depth] earlier token ids (pending entries still 0)."""
        return torch.tensor(self.history, dtype=torch.long).view(-1, self.history_depth)

    def _add_history(
        self,
        request: Request,
        start: int,
        inputs: list[int],
        pending_position: int | None,
        row: int,
    ) -> None:
        """Each input row's earlier token ids, newest first (-1 before position 0); entries
        that are the pending token are recorded to be filled in at launch."""
        depth = self.history_depth
        earlier = request.token_ids[max(0, start - depth) : start]
        tokens = [-1] * (depth - len(earlier)) + earlier + inputs
        # Image positions are no tokens to Engram: n-grams stop at them (spec §3.5).
        first = start - depth
        for span_start, span_end, _ in request.image_spans:
            for position in range(max(span_start, first), min(span_end, start + len(inputs))):
                tokens[position - first] = -1
        for offset in range(len(inputs)):
            position = start + offset
            self.history.append(tokens[offset : offset + depth][::-1])
            if pending_position is not None and 0 < position - pending_position <= depth:
                column = position - pending_position - 1
                self.pending_history.append((row + offset, column, request))


@dataclass
class PagedRows:
    """What paged full attention needs of the step's rows (layers/attention.py)."""

    block_size: int
    # Lay out query tiles instead of decodes and prefills (layers/batch_invariant.py).
    batch_invariant: bool
    # Per row: the block and the offset in it of the cache slot its key and value go to, its
    # sequence's state slot and cached length.
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    seq_slots: list[int] = field(default_factory=list)
    seq_starts: list[int] = field(default_factory=list)
    # Decode rows: the blocks each reads, row by row, and each row's context length; rows
    # per decode chunk.
    decode_blocks: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    decode_sequence_rows: list[int] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Batch-invariant query spans: (row, start, rows, block ids).
    spans: list[tuple[int, int, int, list[int]]] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk, span: SequenceSpan, decode: bool) -> None:
        """The chunk's rows at `span`; `decode`: it is decode-shaped (the step's first rows)."""
        bs, request = self.block_size, chunk.request
        blocks, start, row = request.block_ids, chunk.start, span.row
        end = start + chunk.num_rows
        self.slot_blocks += [blocks[p // bs] for p in range(start, end)]
        self.slot_offsets += [p % bs for p in range(start, end)]
        self.seq_slots += [span.slot] * chunk.num_rows
        self.seq_starts += [request.num_cached_tokens] * chunk.num_rows
        if self.batch_invariant:
            self.spans.append((row, start, chunk.num_rows, blocks))
        elif decode:
            self.decode_sequence_rows.append(chunk.num_rows)
            # Each row sees the keys up to its own position.
            for query_end in range(start + 1, end + 1):
                self.decode_blocks += blocks[: -(-query_end // bs)]
                self.decode_lens.append(query_end)
        else:
            mask = None
            if start:
                query_pos = torch.arange(start, end).unsqueeze(1)
                mask = torch.arange(end).unsqueeze(0) <= query_pos
            self.prefills.append(PrefillSpan(row, chunk.num_rows, end, span.block_table, mask))

    def metadata(self) -> AttentionMetadata:
        bs = self.block_size
        return AttentionMetadata(
            slot_blocks=long_tensor(self.slot_blocks),
            slot_offsets=long_tensor(self.slot_offsets),
            num_decodes=len(self.decode_lens),
            decode_context_lens=self.decode_lens,
            decode_blocks=self.decode_blocks,
            block_size=bs,
            prefills=self.prefills,
            seq_slots=self.seq_slots,
            seq_starts=self.seq_starts,
            query_tiles=tile_queries(self.spans, bs) if self.batch_invariant else None,
            row_block_lists=row_block_lists(self.spans, bs) if self.batch_invariant else None,
            decode_sequence_rows=self.decode_sequence_rows,
        )


def fixed_decode_metadata(
    chunks: list[ScheduledChunk], block_size: int, max_blocks: int
) -> FixedDecodeMetadata:
    """Paged attention's view of a step of single-token decodes (padding rows included) in
    shapes set by the row count: block tables [rows, max_blocks], padded with block 0."""
    tables, slots, lengths = [], [], []
    for chunk in chunks:
        blocks, position = chunk.request.block_ids, chunk.start
        used = position // block_size + 1
        if used > max_blocks:
            raise ValueError(
                f"request {chunk.request.request_id}: position {position} needs {used} blocks, "
                f"past the decode graphs' {max_blocks} per sequence"
            )
        tables.append(blocks[:used] + [0] * (max_blocks - used))
        slots.append(blocks[position // block_size] * block_size + position % block_size)
        lengths.append(position + 1)
    slot_tensor = torch.tensor(slots, dtype=torch.long)
    return FixedDecodeMetadata(
        slot_blocks=slot_tensor // block_size,
        slot_offsets=slot_tensor % block_size,
        block_tables=torch.tensor(tables, dtype=torch.long),
        context_lens=torch.tensor(lengths, dtype=torch.long),
    )


def fixed_decode_plans(
    chunks: list[ScheduledChunk],
    layout: KVLayout,
    block_size: int,
    max_blocks: int,
    bounded: bool,
) -> FixedDecodePlans:
    """The ring and compressed plans of a step of single-token decodes (padding rows
    included) in shapes set by the row count and the layout; `bounded`: the YOCO consumers'
    windows stop at each request's replay start (kv/replay.py)."""
    positions, slots, tables, floors = [], [], [], []
    for chunk in chunks:
        request, position = chunk.request, chunk.start
        used = position // block_size + 1
        if used > max_blocks:
            raise ValueError(
                f"request {request.request_id}: position {position} needs {used} blocks, "
                f"past the decode graphs' {max_blocks} per sequence"
            )
        positions.append(position)
        slots.append(-1 if request.slot is None else request.slot)
        tables.append(request.block_ids[:used] + [0] * (max_blocks - used))
        floors.append(request.replay_start)
    position = torch.tensor(positions, dtype=torch.long).unsqueeze(1)
    table = torch.tensor(tables, dtype=torch.long)
    windows, consumer_windows, tails = {}, {}, {}
    for ring in layout.rings:
        if ring.role is CacheRole.WINDOW:
            windows[ring.name] = _fixed_window(position, ring.window, ring.rows, None)
            if bounded and ring.consumers_from is not None:
                floor = torch.tensor(floors, dtype=torch.long).unsqueeze(1)
                consumer_windows[ring.name] = _fixed_window(position, ring.window, ring.rows, floor)
        else:
            ratio = ring.window + 1
            before = position + torch.arange(1 - ratio, 0)
            tails[ratio] = FixedTailPlan(before % ring.rows, (position % ring.rows).squeeze(1))
    compressed = {}
    for ratio in sorted({s.compress_ratio for s in layout.paged if s.role is CacheRole.COMPRESSED}):
        per_block = block_size // ratio
        entry = (position // ratio).squeeze(1)
        compressed[ratio] = FixedCompressedPlan(
            blocks=table,
            visible_counts=(position.squeeze(1) + 1) // ratio,
            has_new=(position.squeeze(1) + 1) % ratio == 0,
            new_blocks=table.gather(1, (entry // per_block).unsqueeze(1)).squeeze(1),
            new_offsets=entry % per_block,
            new_positions=entry * ratio,
        )
    return FixedDecodePlans(
        torch.tensor(slots, dtype=torch.long), windows, consumer_windows, compressed, tails
    )


def _fixed_window(
    position: torch.Tensor, window: int, ring_rows: int, floor: torch.Tensor | None
) -> FixedWindowPlan:
    """Window keys of the positions `position` [rows, 1]: the `window - 1` before each
    (those before 0, or before `floor`, masked), then its own."""
    keys = position + torch.arange(1 - window, 1)
    visible = keys >= (0 if floor is None else floor.clamp(min=0))
    return FixedWindowPlan(keys[:, :-1] % ring_rows, visible, (position % ring_rows).squeeze(1))
