"""StepMetadata: what a model's layers read about a step, built by the runner once per step
per kind of cache the model declared (kv/layout.py), never per layer.

- full-attention paged K/V (Llama): `AttentionMetadata`, for `AttentionBackend`s;
- sliding-window rings: one `WindowPlan` per sequence, per ring geometry;
- compressed paged entries at ratio r: one `CompressedPlan` per sequence, per ratio;
- compressor tails (rings holding an incomplete group's projections): one `TailPlan` per
  sequence, per ratio;
- SWA bounded replay (kv/replay.py): window plans floored at each sequence's replay start
  for the YOCO consumer layers, and in compact mode the `CompactPlan` of the rows they run;
- a decode-graph step of ring and compressed caches (engine/decode_graphs.py): the same
  plans in shapes set by the batch size alone (`FixedDecodePlans`), built in step_rows.py.
Every plan is built from the step's `SequenceSpan`s, so a new cache kind adds a plan here
and the scheduler, block manager and runner stay as they are.
"""

from dataclasses import dataclass, field

import torch

from deepwell.engine.layers.attention import AttentionMetadata, FixedDecodeMetadata
from deepwell.engine.multimodal import ImageInput


@dataclass
class SequenceSpan:
    """One sequence's rows in a step: rows [row, row + num_rows) hold its positions
    [start, start + num_rows), in order."""

    row: int
    num_rows: int
    start: int
    # The sequence's state slot (-1 without one) and the block ids covering its positions.
    slot: int
    block_table: torch.Tensor
    # First position the YOCO consumer layers' window sees (Request.replay_start).
    replay_start: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.num_rows)


@dataclass
class WindowPlan:
    """One sequence's window keys: ring rows of the positions before its chunk (oldest
    first), then the chunk's own rows."""

    ring_rows: torch.Tensor
    # [rows, len(ring_rows) + rows]: key within the query's window and not after it.
    visible: torch.Tensor
    # The chunk's last positions that the ring keeps: their ring rows, from chunk row
    # `write_from` on.
    write_rows: torch.Tensor
    write_from: int


@dataclass
class CompressedPlan:
    """One sequence's compressed entries at ratio r: entry j pools positions [j·r, j·r + r)
    and is visible to queries at p ≥ j·r + r − 1."""

    first_new: int
    num_entries: int
    # Where the chunk's new entries go: block ids and offsets within the block.
    new_blocks: torch.Tensor
    new_offsets: torch.Tensor
    # Position of each new entry's first token (its rotary position).
    new_positions: torch.Tensor
    # Blocks holding entries [0, num_entries), in order.
    blocks: torch.Tensor
    # [rows]: entries each query sees.
    visible_counts: torch.Tensor


@dataclass
class TailPlan:
    """One sequence's compressor tail at ratio r: the chunk starts inside a group whose first
    positions' projections wait in the ring (`read_rows`, oldest first); the ring then keeps
    the chunk's last positions."""

    read_rows: torch.Tensor
    write_rows: torch.Tensor
    write_from: int


@dataclass
class CompactPlan:
    """Compact bounded replay: from the YOCO boundary layer on, the step runs only its rows
    at or after their sequence's replay start. The boundary layer still compresses the
    dropped rows, since the consumers' shared compressed KV covers every position."""

    # Rows of the step kept, ascending, and those dropped.
    rows: torch.Tensor
    dropped_rows: torch.Tensor
    # The kept rows as sequences (renumbered), with window plans floored at the replay start.
    kept: "StepMetadata"
    # The dropped rows as sequences (renumbered), with the compressed plans of their new
    # entries.
    dropped: "StepMetadata"


@dataclass
class ImagePiece:
    """Step rows [row, row + count) are positions [first, first + count) of `image`'s span
    (a chunk boundary may cut a span anywhere)."""

    row: int
    image: ImageInput
    first: int
    count: int


@dataclass
class StepImages:
    """The step's image-span rows and the embeddings that replace their token embeddings."""

    # [rows] bool: the row is a position of some image's span.
    mask: torch.Tensor
    pieces: list[ImagePiece]
    # [image rows] the rows, in pieces' order, and [image rows, hidden] their embeddings,
    # set by the runner on the compute thread (the encoder cache lives there).
    rows: torch.Tensor
    embeddings: torch.Tensor | None = None


@dataclass
class FixedWindowPlan:
    """A decode-graph step's window keys, a row per sequence: the ring rows of the
    `window - 1` positions before the row's (oldest first; those before position 0 or the
    floor are masked), then the row's own key."""

    ring_rows: torch.Tensor  # [rows, window - 1]
    visible: torch.Tensor  # [rows, window]
    write_rows: torch.Tensor  # [rows]: where the row's key goes


@dataclass
class FixedCompressedPlan:
    """A decode-graph step's compressed entries at ratio r, a row per sequence: every
    entry its padded block table can hold, the first `visible_counts` of them seen. A row
    completing a group (`has_new`) writes entry p // r; the others write that entry's bytes
    back as they are, so every row writes and no shape depends on which."""

    blocks: torch.Tensor  # [rows, max_blocks]: the block table, padded with block 0
    visible_counts: torch.Tensor  # [rows]
    has_new: torch.Tensor  # [rows] bool
    # [rows] entry p // r: its block, its offset in the block, its first position.
    new_blocks: torch.Tensor
    new_offsets: torch.Tensor
    new_positions: torch.Tensor


@dataclass
class FixedTailPlan:
    """A decode-graph step's compressor tail at ratio r: the ring rows of the r − 1
    positions before each row's (the rest of its group when the row completes one), and
    where the row's own projections go."""

    read_rows: torch.Tensor  # [rows, ratio - 1]
    write_rows: torch.Tensor  # [rows]


@dataclass
class FixedDecodePlans:
    """A step of single-token decodes over rings and compressed caches in shapes set by
    its row count and the layout alone (window, ratios, max_blocks_per_seq): the graph key
    of such a step is its padded batch size and model, and its plans are data."""

    slots: torch.Tensor  # [rows]: each row's state slot
    # ring spec name → plan; the YOCO consumers' plans floored at the replay start, when
    # the engine bounds their window (kv/replay.py).
    windows: dict[str, FixedWindowPlan]
    consumer_windows: dict[str, FixedWindowPlan]
    compressed: dict[int, FixedCompressedPlan]
    tails: dict[int, FixedTailPlan]

    def window(self, ring: str, consumer: bool) -> FixedWindowPlan:
        """The window plan of a layer of `ring` (`consumer`: a YOCO consumer layer)."""
        return (
            self.consumer_windows.get(ring, self.windows[ring]) if consumer else self.windows[ring]
        )


@dataclass
class StepMetadata:
    sequences: list[SequenceSpan]
    # [rows, depth]: token ids of the positions just before each row's (column s-1 holds
    # position p - s), -1 before the sequence starts; None when the layout asks for none.
    token_history: torch.Tensor | None = None
    # Full-attention paged K/V, when the layout has any (a decode-graph step's fixed form).
    paged: AttentionMetadata | FixedDecodeMetadata | None = None
    # ring spec name → one plan per sequence
    windows: dict[str, list[WindowPlan]] = field(default_factory=dict)
    # compress ratio → one plan per sequence
    compressed: dict[int, list[CompressedPlan]] = field(default_factory=dict)
    tails: dict[int, list[TailPlan]] = field(default_factory=dict)
    # ring spec name → window plans floored at each sequence's replay start, for the YOCO
    # consumer layers; only in steps where the floor hides some key (kv/replay.py).
    bounded_windows: dict[str, list[WindowPlan]] = field(default_factory=dict)
    compact: CompactPlan | None = None
    # Image-span rows, when the step has any.
    images: StepImages | None = None
    # A decode-graph step's ring and compressed plans; then `sequences`, `windows`,
    # `compressed` and `tails` stay empty.
    fixed: FixedDecodePlans | None = None

    @property
    def fixed_size(self) -> bool:
        """A decode-graph step in fixed-size form: shapes set by its row count alone."""
        return isinstance(self.paged, FixedDecodeMetadata) or self.fixed is not None

    def consumer_windows(self, ring: str) -> list[WindowPlan]:
        """The window plans of a YOCO consumer layer."""
        return self.bounded_windows.get(ring) or self.windows[ring]


def plan_windows(
    sequences: list[SequenceSpan], window: int, ring_rows: int, bounded: bool = False
) -> list[WindowPlan]:
    """Window plans; `bounded` hides keys before each sequence's replay start."""
    plans = []
    for seq in sequences:
        start, end = seq.start, seq.start + seq.num_rows
        floor = seq.replay_start if bounded else 0
        before = torch.arange(min(start, max(0, start - window + 1, floor)), start)
        keys = torch.cat((before, torch.arange(start, end))).unsqueeze(0)
        queries = torch.arange(start, end).unsqueeze(1)
        kept = min(seq.num_rows, ring_rows)
        visible = (keys <= queries) & (keys > queries - window)
        if floor:
            visible &= keys >= floor
        plans.append(
            WindowPlan(
                ring_rows=before % ring_rows,
                visible=visible,
                write_rows=torch.arange(end - kept, end) % ring_rows,
                write_from=seq.num_rows - kept,
            )
        )
    return plans


def plan_compressed(
    sequences: list[SequenceSpan], ratio: int, block_size: int
) -> list[CompressedPlan]:
    per_block = block_size // ratio
    plans = []
    for seq in sequences:
        start, end = seq.start, seq.start + seq.num_rows
        new = torch.arange(start // ratio, end // ratio)
        plans.append(
            CompressedPlan(
                first_new=start // ratio,
                num_entries=end // ratio,
                new_blocks=seq.block_table[new // per_block],
                new_offsets=new % per_block,
                new_positions=new * ratio,
                blocks=seq.block_table[: -(-(end // ratio) // per_block)],
                visible_counts=torch.arange(start + 1, end + 1) // ratio,
            )
        )
    return plans


def plan_tails(sequences: list[SequenceSpan], ratio: int, ring_rows: int) -> list[TailPlan]:
    plans = []
    for seq in sequences:
        start, end = seq.start, seq.start + seq.num_rows
        kept = min(seq.num_rows, ring_rows)
        plans.append(
            TailPlan(
                read_rows=torch.arange(start - start % ratio, start) % ring_rows,
                write_rows=torch.arange(end - kept, end) % ring_rows,
                write_from=seq.num_rows - kept,
            )
        )
    return plans


def split_at_replay_start(
    sequences: list[SequenceSpan],
) -> tuple[list[SequenceSpan], list[SequenceSpan], torch.Tensor, torch.Tensor]:
    """The step's sequences cut at their replay starts: (kept spans, dropped spans, each
    renumbered from row 0 over their own rows; the step's kept rows, its dropped rows)."""
    kept, dropped, kept_rows, dropped_rows = [], [], [], []
    for seq in sequences:
        end = seq.start + seq.num_rows
        cut = min(max(seq.start, seq.replay_start), end)
        if cut > seq.start:
            dropped.append(
                SequenceSpan(
                    len(dropped_rows),
                    cut - seq.start,
                    seq.start,
                    seq.slot,
                    seq.block_table,
                    seq.replay_start,
                )
            )
            dropped_rows += range(seq.row, seq.row + cut - seq.start)
        if end > cut:
            kept.append(
                SequenceSpan(
                    len(kept_rows), end - cut, cut, seq.slot, seq.block_table, seq.replay_start
                )
            )
            kept_rows += range(seq.row + cut - seq.start, seq.row + seq.num_rows)
    return (
        kept,
        dropped,
        torch.tensor(kept_rows, dtype=torch.long),
        torch.tensor(dropped_rows, dtype=torch.long),
    )
