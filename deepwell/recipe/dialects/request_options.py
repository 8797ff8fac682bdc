"""What a converted request asks of the engine (sampling, output constraint) and of the
stream parser, by the common rules every dialect shares (spec/recipe.md §6.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepwell.recipe import conversion as rules
from deepwell.recipe.conversion import ConversionOptions, ToolSelection
from deepwell.recipe.json_value import JsonValue
from deepwell.recipe.options import (
    InferenceOptions,
    ModelVersion,
    ParsingOptions,
    ThinkingInitialStage,
)


@dataclass(frozen=True)
class RequestedSampling:
    """The body's sampling fields, whatever the dialect calls them; None: not given."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class RequestedFormat:
    """The output format: `kind` is text, json_object, json_schema or regex; `schema` is
    the schema the output is constrained to, `regex` the pattern."""

    kind: str
    schema: JsonValue = None
    regex: str | None = None


def response_schemas(
    kind: str, schema: JsonValue, strict: bool | None
) -> tuple[JsonValue, JsonValue]:
    """(constraint schema, output schema) of a response format; a json_schema one is
    normalised for the constraint and for the output check under `strict`."""
    if kind != "json_schema":
        return schema, schema
    return rules.response_constraint_schema(schema, strict), rules.response_output_schema(
        schema, strict
    )


def request_options(
    *,
    version: ModelVersion,
    thinking: bool,
    selection: ToolSelection,
    sampling: RequestedSampling,
    output: RequestedFormat,
    stop: Sequence[str],
    options: ConversionOptions,
    initial_stage: ThinkingInitialStage = ThinkingInitialStage.ReasoningStart,
) -> tuple[InferenceOptions, ParsingOptions]:
    """The engine's options and the stream parser's; tools are active unless tool_choice
    is `none` or none remain."""
    tools_active = bool(selection.tools) and selection.tool_choice != "none"
    inference = InferenceOptions(
        max_tokens=sampling.max_tokens,
        temperature=rules.resolve_temperature(sampling.temperature, thinking),
        top_p=rules.resolve_top_p(sampling.top_p, thinking, version, tools_active),
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        seed=sampling.seed,
        output_constraint=rules.output_constraint(
            selection.tools, selection.tool_choice, output.kind, output.schema, output.regex
        ),
    )
    parsing = rules.parsing_options(
        tools_active=tools_active,
        tool_choice=selection.tool_choice,
        response_format=output.kind,
        thinking=thinking,
        stop=stop,
        special_tokens=options.special_tokens,
        initial_stage=initial_stage,
    )
    return inference, parsing
