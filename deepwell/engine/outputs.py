"""What the engine hands back: per-step token deltas and finished completions.

These cross the engine boundary (to offline callers, and as they are to the HTTP process:
serve/messages.py), so they are typed and import no torch.
"""

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The request failed on its own (e.g. its grammar did not compile); `error` says why.
    ERROR = "error"
    # The engine's watchdog ended a request the step loop stopped making progress on
    # (watchdog.py); `error` says why. Not the request's fault.
    STUCK = "stuck"


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution (before temperature/filters)."""

    token_id: int
    logprob: float
    # (token id, logprob) of the most likely tokens, best first; empty unless asked for.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step: the tokens it gained, and whether it ended.

    The engine decides the stop once: `stop_token_id` names the stop id that ended the
    request, which is the last of `new_token_ids` (sampled, so `num_output_tokens` counts it)
    but not part of the output's text; `text_token_ids` and `text_logprobs` leave it out.
    """

    request_id: str
    new_token_ids: list[int]
    # One entry per new token when the request asked for logprobs, else empty.
    new_logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens taken from the prefix cache (memory or KV store) instead of computed.
    num_cached_tokens: int = 0
    error: str | None = None
    # The request's sampling seed: its own, or the random one drawn when it gave none.
    seed: int = 0
    stop_token_id: int | None = None
    # With SamplingParams.prompt_logprobs, once, in the request's first output: one entry
    # per prompt token after the first (the first has no context to be predicted from).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With DEEPWELL_COMPUTE_SUM_SMALLER_PROBS (DeepInfer's COMPUTE_SUM_SMALLER_PROBS), one
    # per new token: the sum of the probabilities at most the token's own, itself included,
    # under the distribution it was chosen from (engine/sampling.py, token_distribution).
    new_sum_smaller_probs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # msgpack carries the reason as its string value (serve/messages.py).
        if self.finish_reason is not None and not isinstance(self.finish_reason, FinishReason):
            object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_token_ids(self) -> list[int]:
        """The new tokens that are output text: all but the stop id that ended the request."""
        if self.stop_token_id is None:
            return self.new_token_ids
        return self.new_token_ids[:-1]

    @property
    def text_logprobs(self) -> list[TokenLogprobs]:
        """The logprobs of `text_token_ids` (empty unless the request asked for them)."""
        return self.new_logprobs[: len(self.text_token_ids)]


@dataclass(frozen=True)
class Completion:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    # Every sampled token, the stop id that ended it included; `text` leaves that id out.
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs]
    # The sampling seed used (the request's, or a random one when it gave none).
    seed: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With DEEPWELL_COMPUTE_SUM_SMALLER_PROBS: one per token of `token_ids` (RequestOutput).
    sum_smaller_probs: list[float] = field(default_factory=list)

    @property
    def token_id(self) -> list[int]:
        """DeepInfer's name for the output's token ids (its RequestOutput.token_id)."""
        return self.token_ids

    @property
    def finished(self) -> bool:
        """Always True: `LLM.generate` returns finished requests (DeepInfer's `.finished`)."""
        return True
