"""ModelRunner: a scheduled batch → input tensors → model forward → sampled tokens.

All tokens of a step go through one forward; logits are computed only for the rows that
sample (the last token of every chunk that reaches the end of its request) and the verify
rows of a speculative draft. The three stages are separate calls so that the step loop can
prepare a step while the one before it computes (core.py).
"""

from dataclasses import dataclass, field

import torch

from deepwell.engine.decode_graphs import DecodeGraphs, padding_chunks
from deepwell.engine.device import HOST, long_tensor, on_host, place
from deepwell.engine.encoder_cache import EncoderCache
from deepwell.engine.kv.cache import KVCache
from deepwell.engine.kv.layout import CacheRole, KVLayout
from deepwell.engine.kv.replay import EXACT, BoundedReplay, TruncationMode
from deepwell.engine.kv.snapshots import RingSnapshots
from deepwell.engine.layers.step_metadata import (
    CompactPlan,
    StepMetadata,
    plan_compressed,
    plan_tails,
    plan_windows,
    split_at_replay_start,
)
from deepwell.engine.logit_filter import LogitFilter
from deepwell.engine.outputs import TokenLogprobs
from deepwell.engine.request import Request
from deepwell.engine.sampling import (
    Sampler,
    first_argmax,
    sum_smaller_probs,
    token_distribution,
    token_logprobs,
)
from deepwell.engine.scheduler import ScheduledChunk
from deepwell.engine.speculative.verify import takes_batched_argmax, verify
from deepwell.engine.step_rows import (
    PagedRows,
    StepRows,
    fixed_decode_metadata,
    fixed_decode_plans,
)


@dataclass
class SampledChunks:
    """What a step gave each completing chunk, in chunk order: its new tokens, the logprobs
    of a lone sampled token (None otherwise), and with sum_smaller_probs one sum per new
    token (else empty)."""

    tokens: list[list[int]]
    logprobs: list[TokenLogprobs | None]
    sum_smaller_probs: list[list[float]]


@dataclass
class PreparedStep:
    """A scheduled step as model inputs, built while the step before it may still compute."""

    chunks: list[ScheduledChunk]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: StepMetadata
    # Rows whose logits the step needs: the sampling rows, every verify row, then the
    # prompt rows of requests that asked for prompt logprobs. None: every row, in order (a
    # step of decodes), so the head's output is the logits as it is, not a copy of its rows.
    logit_rows: torch.Tensor | None
    # Completing chunks that sample one token, and those that verify a draft.
    sampling: list[ScheduledChunk]
    verifying: list[ScheduledChunk]
    # Input rows holding a request's pending token, known only once the step before samples.
    pending_rows: list[tuple[int, Request]]
    # (row, column) of token-history entries that are a request's pending token.
    pending_history: list[tuple[int, int, Request]]
    # (request, first position, count): prompt rows whose logits score the prompt token
    # after each (SamplingParams.prompt_logprobs), in logit-row order after the verify rows.
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # (request id, slot, block boundary) of each chunk that crosses a boundary, for layouts
    # with ring snapshots; the forward fills `snapshots` with what it took there.
    snapshot_points: list[tuple[str, int, int]] = field(default_factory=list)
    snapshots: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    # A decode step padded to this batch size for its graph (decode_graphs.py); None: eager.
    graph_size: int | None = None

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
        encoder_cache: EncoderCache | None = None,
        decode_graphs: DecodeGraphs | None = None,
        logit_filter: LogitFilter | None = None,
        sum_smaller_probs: bool = False,
        fixed_plans: bool = False,
    ) -> None:
        """`replay` bounds the YOCO consumer layers' window (kv/replay.py); with
        `snapshots`, every chunk that crosses a block boundary snapshots the rings there.
        Steps are built on the host and placed on `device` (the model's and the cache's).
        `encoder_cache` encodes the images of a model with a vision tower (intake lets an
        image in only then). With `decode_graphs`, steps of single-token decodes run padded
        through their graphs. With `sum_smaller_probs`, every new token also carries the sum
        of the probabilities at most its own (DEEPWELL_COMPUTE_SUM_SMALLER_PROBS).
        `fixed_plans`: the model reads a decode-graph step's ring and compressed plans in
        their fixed-size form (ModelHooks.fixed_decode_plans)."""
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
        # Whether a decode-graph step's metadata has a fixed-size form: paged full attention
        # alone, no per-row token history, no query tiles (decode_graphs.py).
        self.fixed_decode = (
            all(s.role is CacheRole.FULL_ATTENTION for s in layout.paged)
            and self.full_attention
            and not layout.rings
            and not self.token_history
            and not batch_invariant
        )
        # The same for ring and compressed caches (FixedDecodePlans), where the model
        # reads them; query tiles have no such form.
        self.fixed_plans = fixed_plans and bool(layout.rings) and not batch_invariant
        # The graph key's model part.
        self.model_kind = type(model).__name__
        self.device = device
        self.sampler = sampler or Sampler()
        self.encoder_cache = encoder_cache
        self.decode_graphs = decode_graphs
        self.logit_filter = logit_filter
        self.sum_smaller_probs = sum_smaller_probs

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedStep:
        graph_size = None if self.decode_graphs is None else self.decode_graphs.size_for(chunks)
        # Padding rows follow the real ones and are decode-shaped like them.
        padding = [] if graph_size is None else padding_chunks(chunks, graph_size)
        # Decode-shaped chunks first: they share one batched attention call. A verify chunk
        # joins them, a row per query, when other requests decode too: at batch 1 one SDPA
        # over its rows is cheaper, in a batch one call beats an SDPA per drafting request.
        decoding = sum(1 for c in chunks if c.num_rows == 1 or c.draft)
        shaped = [c.num_rows == 1 or (decoding > 1 and bool(c.draft)) for c in chunks]
        ordered = [c for c, d in zip(chunks, shaped, strict=True) if d]
        num_decode_chunks = len(ordered)
        ordered += [c for c, d in zip(chunks, shaped, strict=True) if not d]
        num_decode_chunks += len(padding)
        # Built from Python lists on the host (explicitly: whatever the default device is),
        # then placed on the engine's device in one pass below.
        fixed = graph_size is not None and (
            self.fixed_decode or (self.fixed_plans and all(map(_plain_decode, chunks)))
        )
        with on_host():
            rows, meta = self._prepare(ordered + padding, num_decode_chunks, fixed)
        snapshot_points = []
        if self.snapshots is not None:
            bs = self.block_size
            for c in ordered:
                boundary = (c.start + c.num_tokens) // bs * bs
                if boundary > c.start and c.request.slot is not None:
                    snapshot_points.append((c.request.request_id, c.request.slot, boundary))
        completing = [
            (row, c)
            for row, c in zip(rows.last_rows, ordered + padding, strict=True)
            if c.completes
        ]
        sampling = [(row, c) for row, c in completing if not c.draft]
        verifying = [(row, c) for row, c in completing if c.draft]
        logit_rows = [row for row, _ in sampling] + [
            r for row, c in verifying for r in range(row - len(c.draft), row + 1)
        ]
        prompt_rows = []
        # The padding rows (decode graphs) come after the real ones and score no prompt.
        for last_row, c in zip(rows.last_rows[: len(ordered)], ordered, strict=True):
            if c.request.params.wants_prompt_logprobs:
                # Positions whose next token is still a prompt token.
                end = min(c.start + c.num_tokens, c.request.num_prompt_tokens - 1)
                if end > c.start:
                    first_row = last_row - (c.num_tokens - 1)
                    logit_rows += range(first_row, first_row + end - c.start)
                    prompt_rows.append((c.request, c.start, end - c.start))
        input_ids = long_tensor(rows.input_ids)
        positions = long_tensor(rows.positions)
        every_row = len(logit_rows) == len(rows.input_ids) and logit_rows == list(
            range(len(logit_rows))
        )
        logit_ids = None if every_row else long_tensor(logit_rows)
        if self.device != HOST:
            # On the host already otherwise: no walk over the metadata in the CPU hot path.
            input_ids, positions, meta, logit_ids = place(
                (input_ids, positions, meta, logit_ids), self.device
            )
        return PreparedStep(
            chunks=chunks,
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logit_rows=logit_ids,
            sampling=[c for _, c in sampling],
            verifying=[c for _, c in verifying],
            pending_rows=rows.pending_rows,
            pending_history=rows.pending_history,
            prompt_rows=prompt_rows,
            snapshot_points=snapshot_points,
            graph_size=graph_size,
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep, pending: dict[str, int]) -> torch.Tensor | None:
        """The step's forward; returns the logits of its logit rows (None if it samples
        nothing). `pending` maps a request id to its pending token, the input of its row."""
        for row, request in step.pending_rows:
            step.input_ids[row] = pending[request.request_id]
        for row, column, request in step.pending_history:
            step.meta.token_history[row, column] = pending[request.request_id]
        self.fill_image_embeddings(step.meta)
        inputs = (step.input_ids, step.positions, step.meta)
        if step.graph_size is None:
            hidden = self._forward_model(*inputs)
        else:
            hidden = self.decode_graphs.run(
                step.graph_size, self.model_kind, inputs, self._forward_model, step.meta.fixed_size
            )
        for request_id, slot, boundary in step.snapshot_points:
            # Here, on the compute thread: the next step may overwrite these ring rows.
            tensors = self.snapshots.capture(self.kv_cache, slot, boundary)
            step.snapshots[request_id] = (boundary, tensors)
        if step.logit_rows is not None and not step.logit_rows.numel():
            return None
        return self.model.compute_logits(hidden, step.logit_rows)

    def fill_image_embeddings(self, meta: StepMetadata) -> None:
        """The embeddings of the step's image rows, from the encoder cache (encoding the
        images it lacks): on the compute thread, beside the forward."""
        images = meta.images
        if images is None:
            return
        images.embeddings = torch.cat(
            [
                self.encoder_cache.embeddings(piece.image)[piece.first : piece.first + piece.count]
                for piece in images.pieces
            ]
        )

    @torch.inference_mode()
    def sample(self, step: PreparedStep, logits: torch.Tensor | None) -> SampledChunks:
        """The new tokens (and logprobs of a lone sampled token) per completing chunk, in
        chunk order. A chunk with a draft verifies it: its tokens are the accepted draft
        tokens and one more (speculative/verify.py)."""
        if logits is None:
            return SampledChunks([], [], [])
        if self.logit_filter is not None:
            logits = self.logit_filter.apply(logits)
        by_request: dict[int, tuple[list[int], TokenLogprobs | None, list[float]]] = {
            id(c.request): ([], None, []) for c in step.chunks if c.completes
        }
        # A request that ended while the step computed (asynchronous scheduling) samples
        # nothing: its grammar may be done, and nobody wants the token.
        live = [row for row, c in enumerate(step.sampling) if not c.request.finished]
        if live:
            requests = [step.sampling[row].request for row in live]
            rows = logits[: len(step.sampling)]
            if len(live) < len(step.sampling):
                rows = rows[torch.tensor(live, device=rows.device)]
            sampled = self.sampler.sample(rows, requests, self.sum_smaller_probs)
            sums = sampled.sum_smaller_probs or [None] * len(requests)
            for request, token, token_logprobs, token_sum in zip(
                requests, sampled.token_ids, sampled.logprobs, sums, strict=True
            ):
                by_request[id(request)] = (
                    [token],
                    token_logprobs,
                    [] if token_sum is None else [token_sum],
                )
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
            tokens = verify(block, chunk.draft, request, probs, own)
            sums = []
            if self.sum_smaller_probs:
                # Row i of the block is the distribution the i-th new token was chosen from.
                rows = block[: len(tokens)]
                sums = sum_smaller_probs(token_distribution(rows, [request] * len(tokens)), tokens)
            by_request[id(request)] = (tokens, None, sums)
            offset += num_rows
        for request, first, count in step.prompt_rows:
            score_prompt(logits[offset : offset + count], request, first)
            offset += count
        results = [by_request[id(c.request)] for c in step.chunks if c.completes]
        return SampledChunks(
            [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]
        )

    def _forward_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.kv_cache)

    def _prepare(
        self, chunks: list[ScheduledChunk], num_decode_chunks: int, fixed: bool = False
    ) -> tuple[StepRows, StepMetadata]:
        """The rows and metadata of a step whose first `num_decode_chunks` chunks are
        decode-shaped; `fixed`: a decode-graph step of single-token decodes, whose metadata
        is the fixed-size form (no sequence spans: the models it applies to read none)."""
        rows = StepRows(self.block_size, self.token_history)
        if fixed:
            for chunk in chunks:
                rows.add(chunk)
            width = self.decode_graphs.max_blocks_per_seq
            if self.fixed_decode:
                paged = fixed_decode_metadata(chunks, self.block_size, width)
                return rows, StepMetadata([], paged=paged)
            plans = fixed_decode_plans(
                chunks, self.layout, self.block_size, width, self.replay.bounded
            )
            meta = StepMetadata([], fixed=plans)
            if self.token_history:
                meta.token_history = rows.token_history()
            return rows, meta
        # The rest describes paged full attention (AttentionMetadata).
        paged = PagedRows(self.block_size, self.batch_invariant) if self.full_attention else None
        for chunk in chunks:
            rows.add(chunk)
        sequences = rows.sequences()
        if paged is not None:
            for index, (chunk, span) in enumerate(zip(chunks, sequences, strict=True)):
                paged.add(chunk, span, decode=index < num_decode_chunks)
        meta = StepMetadata(sequences)
        meta.images = rows.images()
        if paged is not None:
            meta.paged = paged.metadata()
        self.plan_caches(meta)
        if self.token_history:
            meta.token_history = rows.token_history()
        return rows, meta

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


def _plain_decode(chunk: ScheduledChunk) -> bool:
    """A row the fixed-size plans describe: at or past its request's replay start (compact
    replay drops rows before it) and no image position (those take span embeddings)."""
    request, position = chunk.request, chunk.start
    if position < request.replay_start:
        return False
    return not any(first <= position < last for first, last, _ in request.image_spans)


def score_prompt(logits: torch.Tensor, request: Request, first: int) -> None:
    """Append to `request.prompt_logprobs` the logprobs of the prompt tokens after positions
    `first`, `first + 1`, ... whose rows these `logits` are. The prompt is computed from
    position 0 (never taken from the prefix cache), so rows arrive in order; a recompute
    after a preemption repeats positions already scored, which are skipped."""
    skip = len(request.prompt_logprobs) - first
    if skip >= len(logits):
        return
    logprobs = torch.log_softmax(logits[skip:].float(), dim=-1)
    start = first + skip
    top = request.params.prompt_top_logprobs
    targets = request.prompt_token_ids[start + 1 : start + 1 + len(logprobs)]
    for row, token_id in zip(logprobs, targets, strict=True):
        request.prompt_logprobs.append(token_logprobs(row, token_id, top))
