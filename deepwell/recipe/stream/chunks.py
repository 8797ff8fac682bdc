"""What an inference backend hands the stream processor, and what the processor hands a dialect.

`InferenceChunk` and friends mirror deepseek_recipe 0.2.0 (spec/recipe.md §1, §8.1).
"""

from __future__ import annotations

import enum
import random
import string
from collections.abc import Sequence
from typing import Protocol

# One log probability per token id: (logprob, [(top id, top logprob), ...]).
TokenLogprob = tuple[float, Sequence[tuple[int, float]]]


class InferenceFinishReason(enum.Enum):
    Stop = "stop"
    Length = "length"
    ContentFilter = "content_filter"

    def __repr__(self) -> str:
        return f"InferenceFinishReason.{self.name}"

    __str__ = __repr__


class PromptUsage:
    """Prompt-side token counts supplied by the inference backend."""

    __slots__ = ("prompt_tokens", "prompt_cache_hit_tokens")

    def __init__(self, *, prompt_tokens: int = 0, prompt_cache_hit_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.prompt_cache_hit_tokens = prompt_cache_hit_tokens

    def __repr__(self) -> str:
        return (
            f"PromptUsage(prompt_tokens={self.prompt_tokens}, "
            f"prompt_cache_hit_tokens={self.prompt_cache_hit_tokens})"
        )


class InferenceChunk:
    """One backend chunk: `ready`, `text`, `tokens` or `finish` (build with the static methods)."""

    __slots__ = (
        "kind",
        "content",
        "token_count",
        "token_ids",
        "logprobs",
        "finish_reason",
        "prompt_usage",
        "system_fingerprint",
    )

    def __init__(
        self,
        kind: str,
        content: str | None = None,
        token_count: int | None = None,
        token_ids: list[int] | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        finish_reason: InferenceFinishReason | None = None,
        prompt_usage: PromptUsage | None = None,
        system_fingerprint: str | None = None,
    ) -> None:
        self.kind = kind
        self.content = content
        self.token_count = token_count
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.prompt_usage = prompt_usage
        self.system_fingerprint = system_fingerprint

    @staticmethod
    def ready(
        *, prompt_usage: PromptUsage | None = None, system_fingerprint: str | None = None
    ) -> InferenceChunk:
        return InferenceChunk(
            "ready",
            prompt_usage=prompt_usage if prompt_usage is not None else PromptUsage(),
            system_fingerprint=system_fingerprint,
        )

    @staticmethod
    def text(content: str, token_count: int = 0) -> InferenceChunk:
        return InferenceChunk("text", content, token_count)

    @staticmethod
    def tokens(
        token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None
    ) -> InferenceChunk:
        return InferenceChunk("tokens", token_ids=list(token_ids), logprobs=logprobs)

    @staticmethod
    def finish(reason: InferenceFinishReason) -> InferenceChunk:
        return InferenceChunk("finish", finish_reason=reason)

    def __repr__(self) -> str:
        return f"InferenceChunk.{self.kind}(...)"


class CompletionUsage:
    """Token counts of a finished stream, as every dialect reports them (spec/recipe.md §8.4)."""

    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")

    def __init__(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        reasoning_tokens: int | None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = completion_tokens
        # None when the stream has no thinking stage or saw no token chunk.
        self.reasoning_tokens = reasoning_tokens


class LogprobEntry:
    """One token's log probability, ready for the dialects: token text, bytes, top choices.

    `logprob` is already JSON text: the reference writes 32-bit values (spec/recipe.md §15.8).
    """

    __slots__ = ("token", "logprob", "token_bytes", "top")

    def __init__(
        self, token: str, logprob: str, token_bytes: bytes, top: list[LogprobEntry]
    ) -> None:
        self.token = token
        self.logprob = logprob
        self.token_bytes = token_bytes
        self.top = top


class ChunkGenerator(Protocol):
    """A dialect's side of the stream: parser output in, protocol events appended to `out`.

    Argument pieces arrive as JSON text, except string values, which arrive raw
    (`is_string_value`): the dialect escapes them, or streams a custom tool's input
    unescaped (spec/recipe.md §9.2).

    `thinking_mode` is the request's (its conversation's), not the parsing options': the
    reference marks tool-call ids `ET_` and counts Chat's reasoning tokens by it, so parsing
    options built apart from the request change neither (spec/recipe.md §15.2).
    """

    thinking_mode: bool

    def start(
        self, prompt_usage: PromptUsage, system_fingerprint: str | None, out: list
    ) -> None: ...

    def reasoning(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None: ...

    def content(self, text: str, logprobs: list[LogprobEntry] | None, out: list) -> None: ...

    def tool_call(self, index: int, call_id: str, name: str, out: list) -> None: ...

    def arguments(self, index: int, piece: str, is_string_value: bool, out: list) -> None: ...

    def finish(
        self, reason: str, stop_sequence: str | None, usage: CompletionUsage, out: list
    ) -> None: ...


_ID_ALPHABET = string.ascii_letters + string.digits
_random = random.Random()


def new_tool_call_id(index: int, before_reasoning: bool) -> str:
    """`call_NN_` + 20 alphanumerics + 4 digits; `ET_` after NN when flagged (spec §8.4, §15.2)."""
    marker = "ET_" if before_reasoning else ""
    tail = "".join(_random.choices(_ID_ALPHABET, k=20)) + "".join(
        _random.choices(string.digits, k=4)
    )
    return f"call_{index:02d}_{marker}{tail}"
