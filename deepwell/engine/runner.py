"""ModelRunner: a scheduled batch → input tensors → model forward → sampled tokens.

All tokens of a step go through one forward; logits are computed only for the rows that
sample (the last token of every chunk that reaches the end of its request) and the verify
rows of a speculative draft. The three stages are separate calls so that the step loop can
prepare a step while the one before it computes (core.py).
"""

from dataclasses import dataclass, field

import torch

from deepwell.engine.device import HOST, place
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import CacheRole, KVLayout
from deepwell.engine.kv.replay import EXACT, BoundedReplay, TruncationMode
from deepwell.engine.kv.snapshots import RingSnapshots
from deepwell.engine.layers.attention import AttentionMetadata, PrefillSpan, stack_decode_blocks
from deepwell.engine.layers.batch_invariant import tile_queries
from deepwell.engine.layers.step_metadata import (
    CompactPlan,
    SequenceSpan,
    StepMetadata,
    plan_compressed,
    plan_tails,
    plan_windows,
    split_at_replay_start,
)
from deepwell.engine.outputs import TokenLogprobs
from deepwell.engine.request import Request
from deepwell.engine.sampling import Sampler, first_argmax
from deepwell.engine.scheduler import ScheduledChunk
from deepwell.engine.speculative.verify import takes_batched_argmax, verify


@dataclass
class PreparedStep:
    """A scheduled step as model inputs, built while the step before it may still compute."""

    chunks: list[ScheduledChunk]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: StepMetadata
    # Rows whose logits the step needs: the sampling rows, then every verify row.
    logit_rows: torch.Tensor
    # Completing chunks that sample one token, and those that verify a draft.
    sampling: list[ScheduledChunk]
    verifying: list[ScheduledChunk]
    # Input rows holding a request's pending token, known only once the step before samples.
    pending_rows: list[tuple[int, Request]]
    # (row, column) of token-history entries that are a request's pending token.
    pending_history: list[tuple[int, int, Request]]
    # (request id, slot, block boundary) of each chunk that crosses a boundary, for layouts
    # with ring snapshots; the forward fills `snapshots` with what it took there.
    snapshot_points: list[tuple[str, int, int]] = field(default_factory=list)
    snapshots: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.input_ids.numel()


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        batch_invariant: bool,
        layout: KVLayout,
        replay: BoundedReplay = EXACT,
        snapshots: RingSnapshots | None = None,
        device: torch.device = HOST,
        sampler: Sampler | None = None,
    ) -> None:
        """`replay` bounds the YOCO consumer layers' window (kv/replay.py); with
        `snapshots`, every chunk that crosses a block boundary snapshots the rings there.
        Steps are built on the host and placed on `device` (the model's and the cache's)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.layout = layout
        self.replay = replay
        self.snapshots = snapshots
        # Earlier token ids each row carries (KVLayout.token_history).
        self.token_history = layout.token_history
        self.full_attention = any(s.role is CacheRole.FULL_ATTENTION for s in layout.paged)
        # Lay out query tiles instead of decodes and prefills (layers/batch_invariant.py).
        self.batch_invariant = batch_invariant
        self.device = device
        self.sampler = sampler or Sampler()

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedStep:
        # Decode-shaped chunks first: they share one batched attention call. A verify chunk
        # joins them, a row per query, when other requests decode too: at batch 1 one SDPA
        # over its rows is cheaper, in a batch one call beats an SDPA per drafting request.
        decoding = sum(1 for c in chunks if c.num_rows == 1 or c.draft)
        shaped = [c.num_rows == 1 or (decoding > 1 and bool(c.draft)) for c in chunks]
        ordered = [c for c, d in zip(chunks, shaped, strict=True) if d]
        num_decode_chunks = len(ordered)
        ordered += [c for c, d in zip(chunks, shaped, strict=True) if not d]
        # Built from Python lists on the host (explicitly: whatever the default device is),
        # then placed on the engine's device in one pass below.
        with HOST:
            input_ids, positions, meta, last_rows, pending_rows, pending_history = self._prepare(
                ordered, num_decode_chunks
            )
        snapshot_points = []
        if self.snapshots is not None:
            bs = self.block_size
            for c in ordered:
                boundary = (c.start + c.num_tokens) // bs * bs
                if boundary > c.start and c.request.slot is not None:
                    snapshot_points.append((c.request.request_id, c.request.slot, boundary))
        completing = [(row, c) for row, c in zip(last_rows, ordered, strict=True) if c.completes]
        sampling = [(row, c) for row, c in completing if not c.draft]
        verifying = [(row, c) for row, c in completing if c.draft]
        rows = [row for row, _ in sampling] + [
            r for row, c in verifying for r in range(row - len(c.draft), row + 1)
        ]
        logit_rows = torch.tensor(rows, dtype=torch.long, device=HOST)
        if self.device != HOST:
            # On the host already otherwise: no walk over the metadata in the CPU hot path.
            input_ids, positions, meta, logit_rows = place(
                (input_ids, positions, meta, logit_rows), self.device
            )
        return PreparedStep(
            chunks=chunks,
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logit_rows=logit_rows,
            sampling=[c for _, c in sampling],
            verifying=[c for _, c in verifying],
            pending_rows=pending_rows,
            pending_history=pending_history,
            snapshot_points=snapshot_points,
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep, pending: dict[str, int]) -> torch.Tensor | None:
        """The step's forward; returns the logits of its logit rows (None if it samples
        nothing). `pending` maps a request id to its pending token, the input of its row."""
        for row, request in step.pending_rows:
            step.input_ids[row] = pending[request.request_id]
        for row, column, request in step.pending_history:
            step.meta.token_history[row, column] = pending[request.request_id]
        hidden = self.model(step.input_ids, step.positions, step.meta, self.kv_cache)
        for request_id, slot, boundary in step.snapshot_points:
            # Here, on the compute thread: the next step may overwrite these ring rows.
            tensors = self.snapshots.capture(self.kv_cache, slot, boundary)
            step.snapshots[request_id] = (boundary, tensors)
        if not step.logit_rows.numel():
            return None
        return self.model.compute_logits(hidden, step.logit_rows)

    @torch.inference_mode()
    def sample(
        self, step: PreparedStep, logits: torch.Tensor | None
    ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """The new tokens (and logprobs of a lone sampled token) per completing chunk, in
        chunk order. A chunk with a draft verifies it: its tokens are the accepted draft
        tokens and one more (speculative/verify.py)."""
        if logits is None:
            return [], []
        by_request: dict[int, tuple[list[int], TokenLogprobs | None]] = {
            id(c.request): ([], None) for c in step.chunks if c.completes
        }
        # A request that ended while the step computed (asynchronous scheduling) samples
        # nothing: its grammar may be done, and nobody wants the token.
        live = [row for row, c in enumerate(step.sampling) if not c.request.finished]
        if live:
            requests = [step.sampling[row].request for row in live]
            rows = logits[: len(step.sampling)]
            if len(live) < len(step.sampling):
                rows = rows[torch.tensor(live, device=rows.device)]
            tokens, logprobs = self.sampler(rows, requests)
            for request, token, token_logprobs in zip(requests, tokens, logprobs, strict=True):
                by_request[id(request)] = ([token], token_logprobs)
        offset = len(step.sampling)
        targets = None
        if any(takes_batched_argmax(c.request) for c in step.verifying):
            targets = first_argmax(logits[offset:]).tolist()
        for chunk in step.verifying:
            num_rows = len(chunk.draft) + 1
            block = logits[offset : offset + num_rows]
            request = chunk.request
            probs = None if request.draft_probs is None else request.draft_probs[: len(chunk.draft)]
            own = None
            if targets is not None:
                start = offset - len(step.sampling)
                own = targets[start : start + num_rows]
            by_request[id(request)] = (verify(block, chunk.draft, request, probs, own), None)
            offset += num_rows
        results = [by_request[id(c.request)] for c in step.chunks if c.completes]
        return [t for t, _ in results], [lp for _, lp in results]

    def _prepare(self, chunks: list[ScheduledChunk], num_decode_chunks: int):
        """Tensors of a step whose first `num_decode_chunks` chunks are decode-shaped."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        seq_slots: list[int] = []
        seq_starts: list[int] = []
        decode_blocks: list[int] = []
        decode_rows: list[int] = []
        decode_padding: list[int] = []  # per decode block: keys past the context
        decode_lens: list[int] = []
        decode_sequence_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        spans: list[tuple[int, int, int, list[int]]] = []  # batch-invariant query spans
        pending_rows: list[tuple[int, Request]] = []
        sequences: list[SequenceSpan] = []
        history: list[list[int]] = []
        pending_history: list[tuple[int, int, Request]] = []
        for index, chunk in enumerate(chunks):
            request = chunk.request
            start = chunk.start
            end = start + chunk.num_rows
            blocks = request.block_ids
            row = len(input_ids)
            known = request.token_ids[start : start + chunk.num_tokens]
            pending_position = None
            if len(known) < chunk.num_tokens:
                # Its last input is the token the step before samples; filled in at launch.
                pending_rows.append((row + len(known), request))
                pending_position = start + len(known)
                known.append(0)
            input_ids += known + chunk.draft
            if self.token_history:
                history += self._history(
                    request, start, known + chunk.draft, pending_position, row, pending_history
                )
            positions += range(start, end)
            last_rows.append(row + chunk.num_rows - 1)
            slot = -1 if request.slot is None else request.slot
            table = torch.tensor(blocks[: -(-end // bs)], dtype=torch.long)
            sequences.append(
                SequenceSpan(row, chunk.num_rows, start, slot, table, request.replay_start)
            )
            if not self.full_attention:
                continue  # the rest describes paged full attention (AttentionMetadata)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            seq_slots += [slot] * chunk.num_rows
            seq_starts += [request.num_cached_tokens] * chunk.num_rows
            if self.batch_invariant:
                spans.append((row, start, chunk.num_rows, blocks))
                continue
            if index < num_decode_chunks:
                decode_sequence_rows.append(chunk.num_rows)
                # Each row sees the keys up to its own position.
                for query, query_end in enumerate(range(start + 1, end + 1), row):
                    n = -(-query_end // bs)
                    decode_blocks += blocks[:n]
                    decode_rows += [query] * n
                    decode_padding += [0] * (n - 1) + [n * bs - query_end]
                    decode_lens.append(query_end)
                continue
            mask = None
            if start:
                query_pos = torch.arange(start, end).unsqueeze(1)
                mask = torch.arange(end).unsqueeze(0) <= query_pos
            prefills.append(PrefillSpan(row, chunk.num_rows, end, table, mask))
        meta = StepMetadata(sequences)
        if self.full_attention:
            meta.paged = self._paged_metadata(
                slots,
                decode_blocks,
                decode_rows,
                decode_padding,
                decode_lens,
                decode_sequence_rows,
                prefills,
                seq_slots,
                seq_starts,
                spans,
            )
        self.plan_caches(meta)
        if self.token_history:
            meta.token_history = torch.tensor(history, dtype=torch.long).view(
                -1, self.token_history
            )
        return (
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            last_rows,
            pending_rows,
            pending_history,
        )

    def _paged_metadata(
        self,
        slots,
        decode_blocks,
        decode_rows,
        decode_padding,
        decode_lens,
        decode_sequence_rows,
        prefills,
        seq_slots,
        seq_starts,
        spans,
    ) -> AttentionMetadata:
        bs = self.block_size
        # Decode rows are the first rows of the step, so a row index is its decode index.
        valid = bs - torch.tensor(decode_padding, dtype=torch.long)
        padding = torch.arange(bs).unsqueeze(0) >= valid.unsqueeze(1)
        slot_tensor = torch.tensor(slots, dtype=torch.long)
        ranks, depth, span = stack_decode_blocks(decode_blocks)
        return AttentionMetadata(
            slot_blocks=slot_tensor // bs,
            slot_offsets=slot_tensor % bs,
            num_decodes=len(decode_lens),
            decode_context_lens=decode_lens,
            decode_block_ids=torch.tensor(decode_blocks, dtype=torch.long),
            decode_block_rows=torch.tensor(decode_rows, dtype=torch.long),
            decode_block_padding=padding[:, None, None],
            decode_block_ranks=ranks,
            decode_stack_depth=depth,
            decode_block_span=span,
            prefills=prefills,
            seq_slots=torch.tensor(seq_slots, dtype=torch.long),
            seq_starts=torch.tensor(seq_starts, dtype=torch.long),
            query_tiles=tile_queries(spans, bs) if self.batch_invariant else None,
            decode_sequence_rows=decode_sequence_rows,
        )

    def plan_caches(self, meta: StepMetadata) -> None:
        """Plans once per kind of ring and compressed cache the layout declares, from the
        step's sequences (layers/step_metadata.py)."""
        layout, sequences = self.layout, meta.sequences
        for ring in layout.rings:
            if ring.role is CacheRole.WINDOW:
                meta.windows[ring.name] = plan_windows(sequences, ring.window, ring.rows)
            else:
                ratio = ring.window + 1
                meta.tails[ratio] = plan_tails(sequences, ratio, ring.rows)
        ratios = {s.compress_ratio for s in layout.paged if s.role is CacheRole.COMPRESSED}
        for ratio in sorted(ratios):
            meta.compressed[ratio] = plan_compressed(sequences, ratio, self.block_size)
        if self.replay.bounded:
            self._plan_bounded(meta, sorted(ratios))

    def _plan_bounded(self, meta: StepMetadata, ratios: list[int]) -> None:
        """The YOCO consumer layers' view of a step in a truncation mode: in compact mode
        the rows they run, otherwise window plans floored at the replay start, where the
        floor hides some key."""
        windows = [r for r in self.layout.rings if r.role is CacheRole.WINDOW]
        sequences = meta.sequences
        if self.replay.mode is TruncationMode.COMPACT and any(
            s.start < s.replay_start for s in sequences
        ):
            kept, dropped, kept_rows, dropped_rows = split_at_replay_start(sequences)
            kept_meta, dropped_meta = StepMetadata(kept), StepMetadata(dropped)
            for ring in windows:
                kept_meta.windows[ring.name] = plan_windows(kept, ring.window, ring.rows, True)
            for ratio in ratios:
                kept_meta.compressed[ratio] = plan_compressed(kept, ratio, self.block_size)
                dropped_meta.compressed[ratio] = plan_compressed(dropped, ratio, self.block_size)
            meta.compact = CompactPlan(kept_rows, dropped_rows, kept_meta, dropped_meta)
            return
        for ring in windows:
            if any(s.replay_start > max(0, s.start - ring.window + 1) for s in sequences):
                meta.bounded_windows[ring.name] = plan_windows(
                    sequences, ring.window, ring.rows, bounded=True
                )

    def _history(
        self,
        request: Request,
        start: int,
        inputs: list[int],
        pending_position: int | None,
        row: int,
        pending_history: list[tuple[int, int, Request]],
    ) -> list[list[int]]:
        """Each input row's earlier token ids, newest first (-1 before position 0); entries
        that are the pending token are recorded to be filled in at launch."""
        depth = self.token_history
        earlier = request.token_ids[max(0, start - depth) : start]
        tokens = [-1] * (depth - len(earlier)) + earlier + inputs
        rows = []
        for offset in range(len(inputs)):
            position = start + offset
            rows.append(tokens[offset : offset + depth][::-1])
            if pending_position is not None and 0 < position - pending_position <= depth:
                column = position - pending_position - 1
                pending_history.append((row + offset, column, request))
        return rows
