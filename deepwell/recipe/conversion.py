"""Request conversion rules shared by the three dialects, and the options that steer them.

Thinking, sampling checks, tools, tool_choice, output constraint, parsing options (spec §6.1).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deepwell.recipe.conversation import AssistantMessage, Message, ToolDefinition
from deepwell.recipe.dialects.body import to_f32
from deepwell.recipe.encoding.special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens
from deepwell.recipe.errors import ConversionError
from deepwell.recipe.json_value import JsonValue, compact_json
from deepwell.recipe.options import (
    ModelVersion,
    OutputConstraint,
    ParsingOptions,
    ThinkingInitialStage,
)
from deepwell.recipe.schema import (
    check_parameters_schema,
    check_response_schema,
    normalize_strict_schema,
    strict_output_schema,
)

DEFAULT_MAX_TOKENS_UPPER_BOUND = 393216
DEFAULT_MODEL_VERSIONS = {
    "DeepSeek-V4.1-Flash": ModelVersion.DeepseekV41Flash,
    "DeepSeek-V4-Pro": ModelVersion.DeepseekV4Pro,
}
# Client effort names → the conversation's effort; `none` switches thinking off (spec §6.1).
EFFORTS = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "max": "max",
    "ultra": "max",
}
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_MAX_STOP_SEQUENCES = 16
_TOP_P_FLOOR = to_f32(0.95)


class _NamedEnum(enum.Enum):
    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    __str__ = __repr__


class WebSearchBehavior(_NamedEnum):
    """What to do with server-side web search tools the engine cannot run."""

    Drop = "drop"
    Reject = "reject"


class ReasoningContentBehavior(_NamedEnum):
    """What to do when a thinking-mode history lacks the assistant's reasoning."""

    FillEmpty = "fill_empty"
    Reject = "reject"


class ConversionOptions:
    """Options for protocol request conversion; `with_*` return changed copies."""

    def __init__(
        self,
        *,
        default_thinking_mode: bool = True,
        reasoning_content_behavior: ReasoningContentBehavior = ReasoningContentBehavior.FillEmpty,
        responses_web_search: WebSearchBehavior = WebSearchBehavior.Drop,
        messages_web_search: WebSearchBehavior = WebSearchBehavior.Reject,
        thinking_max_tokens_upper_bound: int = DEFAULT_MAX_TOKENS_UPPER_BOUND,
        non_thinking_max_tokens_upper_bound: int = DEFAULT_MAX_TOKENS_UPPER_BOUND,
    ) -> None:
        self.default_thinking_mode = default_thinking_mode
        self.reasoning_content_behavior = reasoning_content_behavior
        self.responses_web_search = responses_web_search
        self.messages_web_search = messages_web_search
        self.thinking_max_tokens_upper_bound = thinking_max_tokens_upper_bound
        self.non_thinking_max_tokens_upper_bound = non_thinking_max_tokens_upper_bound
        self.model_versions_by_name = dict(DEFAULT_MODEL_VERSIONS)
        self.special_tokens = DEFAULT_SPECIAL_TOKENS
        # deepwell's extension, off as in the reference: Messages `output_config.format`.
        self.structured_output = False
        # deepwell's extensions for serving images, as in the reference when unset: whether
        # image parts become sources (None: as the model version says; V4-Pro's become
        # "[Unsupported Image]" text), and whether `file://` URLs are accepted.
        self.images_supported: bool | None = None
        self.local_image_files = False

    def _with(self, **changes: object) -> ConversionOptions:
        copy = ConversionOptions.__new__(ConversionOptions)
        copy.__dict__.update(self.__dict__)
        copy.model_versions_by_name = dict(self.model_versions_by_name)
        copy.__dict__.update(changes)
        return copy

    def with_default_thinking_mode(self, enabled: bool) -> ConversionOptions:
        return self._with(default_thinking_mode=enabled)

    def with_reasoning_content_behavior(
        self, behavior: ReasoningContentBehavior
    ) -> ConversionOptions:
        return self._with(reasoning_content_behavior=behavior)

    def with_responses_web_search(self, behavior: WebSearchBehavior) -> ConversionOptions:
        return self._with(responses_web_search=behavior)

    def with_messages_web_search(self, behavior: WebSearchBehavior) -> ConversionOptions:
        return self._with(messages_web_search=behavior)

    def with_special_tokens(self, special_tokens: SpecialTokens) -> ConversionOptions:
        return self._with(special_tokens=special_tokens)

    def with_model_alias(self, name: str, version: ModelVersion) -> ConversionOptions:
        copy = self._with()
        copy.model_versions_by_name[name] = version
        return copy

    def with_model_versions_by_name(
        self, versions: Mapping[str, ModelVersion]
    ) -> ConversionOptions:
        return self._with(model_versions_by_name=dict(versions))

    def with_thinking_max_tokens_upper_bound(self, bound: int) -> ConversionOptions:
        return self._with(thinking_max_tokens_upper_bound=bound)

    def with_non_thinking_max_tokens_upper_bound(self, bound: int) -> ConversionOptions:
        return self._with(non_thinking_max_tokens_upper_bound=bound)

    def with_structured_output(self, enabled: bool) -> ConversionOptions:
        """Accept output constraints the reference ignores (Messages `output_config.format`)."""
        return self._with(structured_output=enabled)

    def with_images_supported(self, supported: bool | None) -> ConversionOptions:
        """Keep image parts as sources (True) or stand-in text (False) whatever the model
        version; a server that cannot see them refuses them by their source's path."""
        return self._with(images_supported=supported)

    def with_local_image_files(self, enabled: bool) -> ConversionOptions:
        """Accept `file://` image URLs (the server checks the path it may read)."""
        return self._with(local_image_files=enabled)

    def __repr__(self) -> str:
        return f"ConversionOptions(default_thinking_mode={self.default_thinking_mode})"


# -- model, thinking, sampling
def resolve_model(model: str, options: ConversionOptions) -> ModelVersion:
    versions = options.model_versions_by_name
    if model not in versions:
        names = ", ".join(sorted(versions, key=lambda name: name.encode("utf-8")))
        raise ConversionError(f"The supported API model names are {names}, but you passed {model}.")
    return versions[model]


def resolve_thinking(
    enabled: bool | None, effort: str | None, options: ConversionOptions
) -> tuple[bool, str | None]:
    """(thinking_mode, reasoning_effort) from the dialect's switch and requested effort."""
    if enabled is None:
        # A requested effort implies thinking; only `none` switches it off.
        enabled = options.default_thinking_mode if effort is None else effort != "none"
    if not enabled:
        return False, None
    return True, EFFORTS.get(effort or "", "high")


def check_range(value: float | None, low: float, high: float, name: str, spelled: str) -> None:
    if value is not None and not low <= value <= high:
        raise ConversionError(f"Invalid {name} value, the valid range of {name} is {spelled}")


def check_temperature(value: float | None) -> None:
    check_range(value, 0.0, 2.0, "temperature", "[0, 2]")


def check_top_p(value: float | None) -> None:
    if value is not None and not 0.0 < value <= 1.0:
        raise ConversionError("Invalid top_p value, the valid range of top_p is (0, 1.0]")


def resolve_temperature(value: float | None, thinking: bool) -> float:
    return 1.0 if thinking or value is None else value


def resolve_top_p(
    value: float | None, thinking: bool, version: ModelVersion, tools_active: bool
) -> float:
    if version is ModelVersion.DeepseekV41Flash:
        # V4.1-Flash floors top_p at 0.95 when thinking and ignores it otherwise (spec §6.1).
        if thinking and value is not None:
            return max(value, _TOP_P_FLOOR)
        return 1.0
    if thinking:
        # V4-Pro samples agentic (tool-using) thinking at 0.95, whatever was asked.
        return _TOP_P_FLOOR if tools_active else 1.0
    return 1.0 if value is None else value


def max_tokens_bound(thinking: bool, options: ConversionOptions) -> int:
    if thinking:
        return options.thinking_max_tokens_upper_bound
    return options.non_thinking_max_tokens_upper_bound


def check_max_tokens(value: int | None, bound: int) -> None:
    if value is not None and not 1 <= value <= bound:
        raise ConversionError(
            f"Invalid max_tokens value, the valid range of max_tokens is [1, {bound}]"
        )


def check_stop(stop: Sequence[str], *, single: bool = False) -> None:
    """`single`: the request spelled stop as one string rather than a list."""
    if len(stop) > _MAX_STOP_SEQUENCES:
        raise ConversionError(f"Stop string array too long: {len(stop)}")
    for index, item in enumerate(stop):
        if item == "":
            where = "stop" if single else f"stop[{index}]"
            raise ConversionError(
                f"Invalid '{where}': empty string. Expected a string with minimum "
                "length 1, but got an empty string instead."
            )


# -- reasoning history
def apply_reasoning_history(
    messages: list[Message],
    thinking: bool,
    options: ConversionOptions,
    reject_message: str,
    *,
    tools_declared: bool,
) -> None:
    """Fill or clear assistant reasoning; with `Reject`, insist on it in the current turn.

    The current turn is what follows the last user message. There, an assistant message
    must bring its reasoning if it calls tools or the request declares any tools.
    """
    if not thinking:
        for message in messages:
            if isinstance(message, AssistantMessage):
                message.reasoning_content = None
        return
    turn_start = 1 + max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    reject = options.reasoning_content_behavior is ReasoningContentBehavior.Reject
    for index, message in enumerate(messages):
        if not isinstance(message, AssistantMessage) or message.reasoning_content is not None:
            continue
        if reject and index >= turn_start and (message.tool_calls or tools_declared):
            raise ConversionError(reject_message)
        message.reasoning_content = ""


# -- tools
def check_tool_name(name: str, path: str) -> None:
    if name == "":
        raise ConversionError(
            f"Invalid '{path}': empty string. Expected a string with minimum length 1, "
            "but got an empty string instead."
        )
    if not _TOOL_NAME.fullmatch(name):
        raise ConversionError(
            f"Invalid '{path}': string does not match pattern. Expected a string that "
            "matches the pattern '^[a-zA-Z0-9_-]+$'."
        )


def check_unique_names(names: Sequence[str], message: str) -> None:
    if len(set(names)) != len(names):
        raise ConversionError(message)


def claim_tool_name(name: str, seen: set[str]) -> None:
    """Tools are checked one by one: a repeated name fails before that tool's schema does."""
    if name in seen:
        raise ConversionError("Tool names must be unique.")
    seen.add(name)


def check_strict_consistency(tools: Sequence[ToolDefinition]) -> None:
    flags = {bool(tool.strict) for tool in tools}
    if len(flags) > 1:
        raise ConversionError("Cannot use strict tool with non-strict tool in the same request")


def prepare_parameters(name: str, parameters: JsonValue, strict: bool | None) -> JsonValue:
    """Validate (non-strict) or normalise (strict) a function's parameter schema."""
    if strict:
        if parameters is None:
            parameters = {"type": "object"}
        return normalize_strict_schema(parameters, tool=True)
    if parameters is None:
        return {}
    check_parameters_schema(name, parameters)
    return parameters


def response_constraint_schema(schema: JsonValue, strict: bool | None) -> JsonValue:
    """The schema a `json_schema` response format constrains output to (checked first)."""
    if strict:
        return normalize_strict_schema(schema, tool=False)
    check_response_schema(schema)
    return schema


def response_output_schema(schema: JsonValue, strict: bool | None) -> JsonValue:
    """The schema the output must match: the user's own, every keyword kept (checked first
    by `response_constraint_schema`); strict mode closes its objects."""
    return strict_output_schema(schema) if strict else schema


@dataclass
class ToolSelection:
    """Tools and tool_choice after applying the request's choice (spec §6.1)."""

    tools: list[ToolDefinition]
    tool_choice: str


def apply_tool_choice(
    tools: list[ToolDefinition],
    choice: str,
    named: str | None,
    thinking: bool,
    *,
    declared: bool | None = None,
) -> ToolSelection:
    """`choice` is none/auto/required; `named` is a forced function (choice required).

    Without tools a forced choice means nothing; `declared` says whether the request named
    any tools at all (Messages counts tools it dropped), by default whether `tools` is set.
    """
    if choice == "none":
        return ToolSelection([], "none")
    if choice == "auto" or not (tools if declared is None else declared):
        return ToolSelection(tools, "auto")
    chosen = tools
    if named is not None:
        chosen = [tool for tool in tools if tool.name == named]
        if not chosen:
            raise ConversionError(
                f"Invalid value for 'tool_call': no function named '{named}' was specified "
                "in the 'tools' parameter."
            )
    if thinking:
        raise ConversionError("Thinking mode does not support this tool_choice")
    return ToolSelection(chosen, "required")


def output_constraint(
    tools: Sequence[ToolDefinition],
    tool_choice: str,
    response_format: str,
    response_schema: JsonValue,
    response_regex: str | None,
) -> OutputConstraint | None:
    if tools and tool_choice != "none":
        declared = []
        for tool in tools:
            entry: dict = {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                    "strict": tool.strict,
                },
            }
            if tool.defer_loading:
                entry["defer_loading"] = True
            declared.append(entry)
        kind = "tool_call_required" if tool_choice == "required" else "tool_call"
        return OutputConstraint(kind, compact_json(declared))
    if response_format == "json_object":
        return OutputConstraint("json", "")
    if response_format == "json_schema":
        return OutputConstraint("json", compact_json(response_schema))
    if response_format == "regex":
        return OutputConstraint("regex", response_regex or "")
    return None


def parsing_options(
    *,
    tools_active: bool,
    tool_choice: str,
    response_format: str,
    thinking: bool,
    stop: Sequence[str],
    special_tokens: SpecialTokens,
    initial_stage: ThinkingInitialStage = ThinkingInitialStage.ReasoningStart,
) -> ParsingOptions:
    return ParsingOptions(
        parse_tool_calls=tools_active,
        starts_in_tool_calls=tools_active and tool_choice == "required",
        parse_json_output=response_format == "json_object",
        thinking_initial_stage=initial_stage if thinking else None,
        stop_sequences=stop,
        special_tokens=special_tokens,
    )


def mentions_json(texts: Sequence[str]) -> bool:
    return any("json" in text.lower() for text in texts)
