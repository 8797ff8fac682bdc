"""The fixed prompt texts DeepSeek V4 and V4.1 were trained on: tool prompt, effort, formats.

Recorded from the reference renderings (tests/data/recipe_vectors.json `template_literals`).
"""

from __future__ import annotations

import re

from deepwell.recipe.encoding.prompt import PromptBuilder

# `{DSML}`, `{THINK}` and `{END_THINK}` are special tokens; `{CALLS}`, `{INVOKE}`,
# `{PARAMETER}` are the version's tag names; `{TOOL_SCHEMAS}` is plain text ending in a newline
# (spec/recipe.md §4.1).
TOOL_PROMPT = (
    "## Tools\n"
    "\n"
    'You have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<{DSML}{CALLS}>" block like the following:\n'
    "\n"
    "<{DSML}{CALLS}>\n"
    '<{DSML}{INVOKE} name="$TOOL_NAME">\n'
    '<{DSML}{PARAMETER} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}{PARAMETER}>\n'
    "...\n"
    "</{DSML}{INVOKE}>\n"
    '<{DSML}{INVOKE} name="$TOOL_NAME2">\n'
    "...\n"
    "</{DSML}{INVOKE}>\n"
    "</{DSML}{CALLS}>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after {END_THINK} with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    "{TOOL_SCHEMAS}\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

_SLOT = re.compile(r"\{(DSML|THINK|END_THINK|CALLS|INVOKE|PARAMETER|TOOL_SCHEMAS)\}")

V4_EFFORT_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n"
    "\n"
)
V4_EFFORT_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n"
    "\n"
)


def v4_effort_text(thinking_mode: bool, effort: str | None) -> str:
    # spec/recipe.md §4.1, §14: unspecified, high and xhigh all get "Absolute maximum".
    if not thinking_mode or effort == "low":
        return ""
    return V4_EFFORT_BEYOND_MAXIMUM if effort == "max" else V4_EFFORT_ABSOLUTE_MAXIMUM


_V41_EFFORT_LEVEL = {None: 75, "low": 50, "high": 75, "xhigh": 75, "max": 100}


def v41_effort_text(thinking_mode: bool, effort: str | None) -> str:
    if not thinking_mode:
        return ""
    level = _V41_EFFORT_LEVEL[effort]
    return (
        f"Reasoning Effort: {level} (range 1-100, the higher the value, "
        "the more thorough the reasoning)\n\n"
    )


RESPONSE_FORMAT_HEADER = (
    "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
V4_JSON_OBJECT_SUFFIX = (
    "\n\nYou are a helpful assistant designed to output JSON.\n"
    "## Response Format:\n\nReply with JSON object ONLY."
)
V41_JSON_OBJECT_SUFFIX = RESPONSE_FORMAT_HEADER + '{"type": "json_object"}'
UPDATED_TOOL_SCHEMAS_HEADER = "\n\n### Updated Tool Schemas\n\n"


def emit_tool_prompt(
    out: PromptBuilder,
    schemas: str,
    *,
    dsml: str,
    think: str,
    end_think: str,
    tag_names: tuple[str, str, str],
) -> None:
    """Append TOOL_PROMPT with `schemas` in its slot and the version's tag names."""
    calls, invoke, parameter = tag_names
    plain = {"CALLS": calls, "INVOKE": invoke, "PARAMETER": parameter, "TOOL_SCHEMAS": schemas}
    special = {"DSML": dsml, "THINK": think, "END_THINK": end_think}
    at = 0
    for match in _SLOT.finditer(TOOL_PROMPT):
        out.text(TOOL_PROMPT[at : match.start()])
        slot = match.group(1)
        if slot in special:
            out.special(special[slot])
        else:
            out.text(plain[slot])
        at = match.end()
    out.text(TOOL_PROMPT[at:])
