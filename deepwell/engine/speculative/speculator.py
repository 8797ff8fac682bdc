"""Speculator: drafts for the running requests, their verify lengths, and the statistics.

Before a step it proposes drafts, estimates each position's survival and plans how many
positions each request verifies (`Request.draft_token_ids`); after the step it learns from
what was accepted and how long the step took. Without variable-length verification
(DeepInfer's ENABLE_MTP_VARLEN off, the default) a request's verify length is a function of
its own survival estimates: a fixed cost model (planner.py) gives it, and the step's token
budget caps it only through the configured maximum, never through what else runs. In
batch-invariant mode the survival itself comes from the request's own acceptance history
(or its drafter) too.
"""

import logging
import time
from dataclasses import dataclass

from deepwell.engine.request import Request
from deepwell.engine.speculative.confidence import ConfidenceTable
from deepwell.engine.speculative.drafter import Draft, Drafter
from deepwell.engine.speculative.planner import plan_own_verify_length, plan_verify_lengths
from deepwell.engine.speculative.step_time import StepTimeCurve
from deepwell.engine.stats import SpecStats

logger = logging.getLogger(__name__)
# The stats line goes to the log at most this often.
_LOG_INTERVAL_S = 60.0


@dataclass
class _Planned:
    bucket: int
    survival: list[float]
    # The drafter supplied survival itself: not the table's to learn from.
    native: bool


class Speculator:
    def __init__(
        self,
        num_speculative_tokens: int,
        drafter: Drafter,
        batch_invariant: bool = False,
        variable_length: bool = True,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter = drafter
        self.batch_invariant = batch_invariant
        # Verify lengths planned per request alone, not across the step's requests.
        self.own_lengths = batch_invariant or not variable_length
        # Learned from every request's verifications (the statistics, and the batch
        # planner's estimates)...
        self.confidence = ConfidenceTable(num_speculative_tokens)
        # ...and, in batch-invariant mode, per request from its own only.
        self._own_confidence: dict[str, ConfidenceTable] = {}
        self.curve = StepTimeCurve()
        self._planned: dict[str, _Planned] = {}
        self._decode_steps = 0
        self._verify_steps = 0
        self._verified = [0] * num_speculative_tokens
        self._accepted = [0] * num_speculative_tokens
        self._logged_at = time.monotonic()

    def propose(self, running: list[Request], budget: int) -> None:
        """Set every running request's `draft_token_ids` for the next step."""
        base_rows = 0
        num_decodes = 0
        candidates: list[Request] = []
        rooms: list[int] = []
        for request in running:
            request.draft_token_ids = []
            request.draft_probs = None
            pending = request.num_tokens - request.num_computed_tokens
            base_rows += pending
            if pending != 1:
                continue
            num_decodes += 1
            params = request.params
            # Penalties, bias, min_tokens, logprobs and teacher forcing are applied by the
            # sampler only; the verify rows would sample without them.
            if params.adjusts_logits or params.logprobs or params.golden_token_ids:
                continue
            room = min(
                self.num_speculative_tokens, params.max_tokens - request.num_output_tokens - 1
            )
            if self.own_lengths:
                # A draft must fit a step whole (in batch-invariant mode the scheduler
                # defers, never cuts, it).
                room = min(room, budget - 1)
            if room > 0:
                candidates.append(request)
                rooms.append(room)
        drafting: list[tuple[Request, Draft, _Planned]] = []
        if candidates:
            drafts = self.drafter.propose(candidates, rooms)
            for request, draft in zip(candidates, drafts, strict=True):
                if draft is None or not draft.tokens:
                    continue
                native = draft.survival is not None
                survival = (
                    draft.survival[: len(draft.tokens)]
                    if native
                    else self._table(request.request_id).survival(draft.bucket, len(draft.tokens))
                )
                drafting.append((request, draft, _Planned(draft.bucket, survival, native)))
        if not drafting:
            return
        if self.own_lengths:
            for request, draft, planned in drafting:
                self._set_draft(request, draft, planned, plan_own_verify_length(planned.survival))
            return
        lengths = plan_verify_lengths(
            [planned.survival for _, _, planned in drafting],
            num_decodes,
            base_rows,
            max(0, budget - base_rows),
            self.curve,
        )
        for (request, draft, planned), length in zip(drafting, lengths, strict=True):
            self._set_draft(request, draft, planned, length)

    def _set_draft(self, request: Request, draft: Draft, planned: _Planned, length: int):
        if length:
            request.draft_token_ids = draft.tokens[:length]
            if draft.probs is not None:
                request.draft_probs = draft.probs[:length]
            planned.survival = planned.survival[:length]
            self._planned[request.request_id] = planned

    def _table(self, request_id: str) -> ConfidenceTable:
        """The confidence table a request's survival estimates come from."""
        if not self.batch_invariant:
            return self.confidence
        table = self._own_confidence.get(request_id)
        if table is None:
            table = self._own_confidence[request_id] = ConfidenceTable(self.num_speculative_tokens)
        return table

    def observe(self, request: Request, num_verified: int, num_accepted: int) -> None:
        """A decode step of `request` verified `num_verified` positions, accepting `num_accepted`."""
        self._decode_steps += 1
        planned = self._planned.pop(request.request_id, None)
        if not num_verified or planned is None:
            return
        self._verify_steps += 1
        for position in range(num_verified):
            self._verified[position] += 1
            self._accepted[position] += position < num_accepted
        predicted = planned.survival[:num_verified]
        if planned.native:
            self.confidence.record_error(predicted, num_accepted)
            return
        self.confidence.observe(planned.bucket, predicted, num_accepted)
        if self.batch_invariant:
            self._table(request.request_id).observe(planned.bucket, predicted, num_accepted)

    def record_step(self, rows: int, seconds: float) -> None:
        self.curve.record(rows, seconds)
        now = time.monotonic()
        if now - self._logged_at >= _LOG_INTERVAL_S and self._verify_steps:
            self._logged_at = now
            stats = self.stats()
            logger.info(
                "speculative: accept rate %.2f (per position %s), %.2f verified per drafting "
                "step, %.2f tokens per decode step, confidence error %.3f",
                stats.accept_rate,
                " ".join(f"{rate:.2f}" for rate in stats.position_accept_rates),
                stats.avg_verified_len,
                stats.tokens_per_decode,
                stats.confidence_error,
            )

    def forget(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self._own_confidence.pop(request_id, None)
        self.drafter.forget(request_id)

    def stats(self) -> SpecStats:
        return SpecStats(
            decode_steps=self._decode_steps,
            verify_steps=self._verify_steps,
            verified_tokens=sum(self._verified),
            accepted_tokens=sum(self._accepted),
            position_accept_rates=tuple(
                a / v if v else 0.0 for a, v in zip(self._accepted, self._verified, strict=True)
            ),
            confidence_error=self.confidence.mean_error,
        )
