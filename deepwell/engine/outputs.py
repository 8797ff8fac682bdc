"""What the engine hands back: per-step token deltas and finished completions.

These cross the engine boundary (to `serve` and to offline callers), so they are typed.
"""

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The request failed on its own (e.g. its grammar did not compile); `error` says why.
    ERROR = "error"


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution (before temperature/filters)."""

    token_id: int
    logprob: float
    # (token id, logprob) of the most likely tokens, best first; empty unless asked for.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step: the tokens it gained, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    # One entry per new token when the request asked for logprobs, else empty.
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens taken from the prefix cache (memory or KV store) instead of computed.
    num_cached_tokens: int = 0
    error: str | None = None
    # The request's sampling seed: its own, or the random one drawn when it gave none.
    seed: int = 0


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs]
    # The sampling seed used (the request's, or a random one when it gave none).
    seed: int = 0
