"""GrammarMatcher: one request's grammar state: the next-token mask, advance, rollback.

Before the trigger sequence (if any) the output is free; after it the llguidance matcher
decides. Every token is recorded so that a rollback (rejected speculative tokens) can
undo the trigger as well as the grammar.
"""

import llguidance
import numpy as np
import torch

from deepwell.engine.device import place


class GrammarMatcher:
    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        trigger_token_ids: tuple[int, ...],
        bound_token_id: int | None,
        stop_token_ids: frozenset[int],
    ) -> None:
        self._matcher = matcher
        self._trigger = list(trigger_token_ids)
        self._bound = bound_token_id
        self._stop = np.array(sorted(stop_token_ids), dtype=np.int64)
        self._stop_bits = np.left_shift(np.uint32(1), (self._stop & 31).astype(np.uint32))
        self._tokens: list[int] = []
        # Per recorded token: did the llguidance matcher consume it?
        self._consumed: list[bool] = []
        # Index into _tokens where the grammar starts (None: the trigger has not appeared)
        # and where the bound token fired (None: it has not).
        self._grammar_start: int | None = None if self._trigger else 0
        self._bound_at: int | None = None

    @property
    def constrains_next(self) -> bool:
        """False while the next token is free (before the trigger, bound not fired)."""
        return self._grammar_start is not None or self._bound_at is not None

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (uint32 words, bit t = token t)."""
        if self._grammar_start is None:
            # The bound token fired: only the next trigger token may follow.
            forced = self._trigger[len(self._tokens) - self._bound_at - 1]
            row[:] = 0
            row[forced >> 5] = 1 << (forced & 31)
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._matcher.is_accepting():
            # The request's own stop tokens end the output wherever the grammar may end.
            np.bitwise_or.at(row, self._stop >> 5, self._stop_bits)

    def advance(self, token_id: int) -> bool:
        """Record a sampled token; False when the grammar rejects it (the matcher is then in error)."""
        consume = self._grammar_start is not None and not (
            token_id in self._stop and self._matcher.is_accepting()
        )
        self._tokens.append(token_id)
        self._consumed.append(consume)
        if consume:
            return self._matcher.consume_token(token_id)
        self._update_trigger()
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` recorded tokens, grammar state included."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._tokens)} tokens")
        consumed = sum(self._consumed[-num_tokens:])
        if consumed:
            self._matcher.rollback(consumed)
        del self._tokens[-num_tokens:]
        del self._consumed[-num_tokens:]
        if self._grammar_start is not None and self._grammar_start > len(self._tokens):
            self._grammar_start = None
        if self._bound_at is not None and self._bound_at >= len(self._tokens):
            self._bound_at = None

    def _update_trigger(self) -> None:
        if self._grammar_start is not None:
            return
        n = len(self._tokens)
        if self._bound_at is None and self._tokens[-1] == self._bound:
            self._bound_at = n - 1
        elif self._tokens[-len(self._trigger) :] == self._trigger or (
            self._bound_at is not None and n - self._bound_at - 1 == len(self._trigger)
        ):
            self._grammar_start = n
            self._bound_at = None


def apply_masks(logits: torch.Tensor, rows: list[int], masks: np.ndarray) -> None:
    """Set disallowed logits to -inf in place; `masks[i]` (uint32 words) belongs to `rows[i]`."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    # The bits are unpacked on the host, then cross once (pinned, not waited for) to the logits.
    disallowed = place(torch.from_numpy(bits) == 0, logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
