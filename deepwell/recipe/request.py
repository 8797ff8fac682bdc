"""The result of converting a protocol request: conversation plus everything it implies.

`ConversationRequest.resolve_max_tokens` follows spec/recipe.md §7.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepwell.recipe.conversation import Conversation
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue
from deepwell.recipe.options import InferenceOptions, ModelVersion, ParsingOptions

DEFAULT_MAX_TOKENS_NON_THINKING = 8192
DEFAULT_MAX_TOKENS_THINKING = 65536
DEFAULT_MAX_TOKENS_THINKING_MAX_EFFORT = 131072


@dataclass
class ResponsesEcho:
    """Request settings the Responses API echoes back in its response object (spec §9.2).

    The first six are the reference's public properties. The rest are JSON values ready to
    be written into the response object: `reasoning` is `{"effort", "summary"}` as requested
    (None when absent), `text` is `{"format", "verbosity"}` (format defaults to
    `{"type": "text"}`), `tool_choice` is the request's choice (default `"auto"`), and
    `tools` lists the declared tools in their re-serialised form (namespaces, custom and
    server tools included).
    """

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int = 0
    user: str | None = None
    reasoning: dict[str, JsonValue] = field(
        default_factory=lambda: {"effort": None, "summary": None}
    )
    text: dict[str, JsonValue] = field(
        default_factory=lambda: {"format": {"type": "text"}, "verbosity": None}
    )
    tool_choice: JsonValue = "auto"
    tools: list[JsonValue] = field(default_factory=list)


class ConversationRequest:
    """A converted request: what to render, how to sample, how to parse the output."""

    def __init__(
        self,
        conversation: Conversation,
        model_version: ModelVersion,
        *,
        inference_options: InferenceOptions | None = None,
        parsing_options: ParsingOptions | None = None,
        stream: bool = False,
        include_usage: bool = False,
        namespace_tool_map: dict[str, tuple[str, str]] | None = None,
        echo: ResponsesEcho | None = None,
        output_schema: JsonValue = None,
    ) -> None:
        self.conversation = conversation
        self.model_version = model_version
        self.inference_options = inference_options or InferenceOptions()
        self._parsing_options = parsing_options or ParsingOptions()
        self.stream = stream
        # Chat only: `stream_options.include_usage`, which decides whether streamed chunks
        # before the last one carry `"usage":null` (docs/recipe.md "Stream usage and accumulation").
        self.include_usage = include_usage
        # Responses only: streamed `ns::name` tool calls are split back with this map; None
        # (a request built directly, not converted) splits every name at its first `::`.
        self.namespace_tool_map = None if namespace_tool_map is None else dict(namespace_tool_map)
        self.echo = echo or ResponsesEcho()
        # deepwell's addition: the validated JSON schema the output must match, as the user
        # wrote it (strict mode closes its objects). The output constraint's text is the
        # reference's normalised subset, which drops minItems, maxLength, $defs and more.
        self.output_schema = output_schema

    @property
    def parsing_options(self) -> ParsingOptions:
        # The reference hands out a copy (spec/recipe.md §15.13).
        return self._parsing_options.copy()

    def resolve_max_tokens(self, prompt_tokens: int, context_limit: int) -> int:
        if prompt_tokens < 0 or context_limit < 0:
            raise OverflowError("out of range integral type conversion attempted")
        requested = self.inference_options.max_tokens
        if requested is not None:
            if prompt_tokens + requested > context_limit:
                raise _context_error(context_limit, prompt_tokens, requested)
            return requested
        conversation = self.conversation
        if not conversation.thinking_mode:
            default = DEFAULT_MAX_TOKENS_NON_THINKING
        elif conversation.reasoning_effort == "max":
            default = DEFAULT_MAX_TOKENS_THINKING_MAX_EFFORT
        else:
            default = DEFAULT_MAX_TOKENS_THINKING
        if prompt_tokens > context_limit:
            raise _context_error(context_limit, prompt_tokens, 0)
        return max(1, min(default, context_limit - prompt_tokens))


def _context_error(limit: int, prompt: int, completion: int) -> ConversionError:
    return ConversionError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the "
        "completion). Please reduce the length of the messages or completion."
    )
