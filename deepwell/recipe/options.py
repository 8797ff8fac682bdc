"""What a converted request asks of inference and of the stream parser.

`InferenceOptions` go to the engine; `ParsingOptions` configure the StreamProcessor
(spec/recipe.md §1, §6.1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from deepwell.recipe.encoding.special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens


class _ReprEnum(enum.Enum):
    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    __str__ = __repr__


class ModelVersion(_ReprEnum):
    DeepseekV4Pro = "DeepSeek-V4-Pro"
    DeepseekV41Flash = "DeepSeek-V4.1-Flash"


class ThinkingInitialStage(_ReprEnum):
    ReasoningStart = "reasoning_start"
    ReasoningContinuation = "reasoning_continuation"
    ContentContinuation = "content_continuation"

    def starts_in_reasoning(self) -> bool:
        return self is not ThinkingInitialStage.ContentContinuation


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must match: kind `json`, `regex`, `tool_call` or `tool_call_required`."""

    kind: str
    schema: str


@dataclass(frozen=True)
class InferenceOptions:
    """Sampling settings resolved from the request; floats are f32 values widened to f64."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    output_constraint: OutputConstraint | None = None


class ParsingOptions:
    """How the stream parser splits model output (reasoning, content, tool calls, JSON)."""

    __slots__ = (
        "parse_tool_calls",
        "starts_in_tool_calls",
        "parse_json_output",
        "thinking_initial_stage",
        "stop_sequences",
        "special_tokens",
        "tool_call_format",
    )

    def __init__(
        self,
        *,
        parse_tool_calls: bool = True,
        starts_in_tool_calls: bool = False,
        parse_json_output: bool = False,
        thinking_initial_stage: ThinkingInitialStage | None = None,
        stop_sequences: Sequence[str] | None = None,
        special_tokens: SpecialTokens | None = None,
        tool_call_format: str = "dsml",
    ) -> None:
        self.parse_tool_calls = parse_tool_calls
        self.starts_in_tool_calls = starts_in_tool_calls
        self.parse_json_output = parse_json_output
        self.thinking_initial_stage = thinking_initial_stage
        self.stop_sequences = list(stop_sequences or [])
        self.special_tokens = special_tokens or DEFAULT_SPECIAL_TOKENS
        # How the model writes tool calls: DeepSeek's DSML blocks, or JSON objects
        # (`hermes`, `llama3_json`; deepwell's addition for chat-template models).
        self.tool_call_format = tool_call_format

    def copy(self) -> ParsingOptions:
        return ParsingOptions(
            parse_tool_calls=self.parse_tool_calls,
            starts_in_tool_calls=self.starts_in_tool_calls,
            parse_json_output=self.parse_json_output,
            thinking_initial_stage=self.thinking_initial_stage,
            stop_sequences=self.stop_sequences,
            special_tokens=self.special_tokens,
            tool_call_format=self.tool_call_format,
        )
