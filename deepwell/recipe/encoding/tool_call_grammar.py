"""The DSML tool-call block as an llguidance Lark grammar: what a forced tool call may say.

Text only: the engine compiles it. `｜DSML｜` is matched by token id, all else as text, in
exactly the shape the encoder renders calls (spec/recipe.md §4.3, "Tool-call block").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from deepwell.recipe.conversation import ToolDefinition
from deepwell.recipe.json_value import JsonValue

# JSON values are spelled the way the encoder writes them (Python's json.dumps), so a
# rendered call is itself a valid output; no free whitespace lets a small model pad forever.
_JSON_SPELLING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A string value runs up to the first `</` (the stream parser ends it at `</｜DSML｜`). The
# lexer is greedy and does not backtrack, so the `</` belongs to the value's own lexeme.
_NO_CLOSE = r"/([^<]|<+[^<\/])*<*/"


@dataclass(frozen=True)
class DsmlTags:
    """One encoding's DSML spelling: tag names after the DSML token, and the `｜DSML｜` id."""

    calls: str
    invoke: str
    parameter: str
    # Between `<DSML invoke name="…">\n` and `</DSML invoke>` when a call has no parameters.
    empty_invoke_body: str
    dsml_token_id: int


def tool_call_grammar(tools: Sequence[ToolDefinition], tags: DsmlTags) -> str:
    """A grammar for one or more invokes of `tools`, then the closing calls tag.

    It continues a prompt that ends in the opening `<DSML calls>` line (tool_choice
    required). Parameters come in schema order, required ones always, optional ones may be
    left out; string properties are raw text (`string="true"`), others JSON.
    """
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    lines = [
        "%llguidance {}",
        f'start: call+ "</" dsml {_lit(tags.calls + ">")}',
        f"dsml: <[{tags.dsml_token_id}]>",
        f"NO_CLOSE: {_NO_CLOSE}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        lines.extend(_invoke_rules(i, tool, tags))
    return "\n".join(lines) + "\n"


def _invoke_rules(i: int, tool: ToolDefinition, tags: DsmlTags) -> list[str]:
    opening = _lit(f'{tags.invoke} name="{tool.name}">\n')
    closing = _lit(f"{tags.invoke}>\n")
    rules = [f'call_{i}: "<" dsml {opening} args_{i} "</" dsml {closing}']
    properties, required, definitions = _object_parts(tool.parameters)
    params: list[tuple[str, bool]] = []
    for j, (key, schema) in enumerate(properties.items()):
        name = f"param_{i}_{j}"
        rules.extend(_parameter_rules(name, key, schema, definitions, tags))
        params.append((name, key in required))
    empty = _lit(tags.empty_invoke_body) if tags.empty_invoke_body else '""'
    if not params:
        rules.append(f"args_{i}: {empty}")
    elif any(is_required for _, is_required in params):
        rules.append(f"args_{i}: " + " ".join(_optional(p) for p in params))
    else:
        # All optional: any non-empty subsequence in order, or the empty invoke body (the
        # encoder renders `{}` arguments as a call without parameter lines).
        names = [name for name, _ in params]
        starts = [
            " ".join([names[k]] + [f"{n}?" for n in names[k + 1 :]]) for k in range(len(names))
        ]
        rules.append(f"args_{i}: " + " | ".join([*starts, empty]))
    return rules


def _parameter_rules(
    name: str, key: str, schema: JsonValue, definitions: dict, tags: DsmlTags
) -> list[str]:
    closing = _lit(f"{tags.parameter}>\n")
    if isinstance(schema, dict) and schema.get("type") == "string":
        opening = _lit(f'{tags.parameter} name="{key}" string="true">')
        value = name.upper()
        # The value lexeme ends with the `</` before the DSML token.
        return [
            f'{name}: "<" dsml {opening} {value} dsml {closing}',
            f"{value}: {_string_value(schema)}",
        ]
    opening = _lit(f'{tags.parameter} name="{key}" string="false">')
    json_schema = dict(schema) if isinstance(schema, dict) else {}
    if schema is False:
        json_schema = {"not": {}}
    # `$ref`s point into the parameters schema's root; carry its definitions along.
    json_schema.update(definitions)
    json_schema["x-guidance"] = _JSON_SPELLING
    return [
        f'{name}: "<" dsml {opening} {name}_json "</" dsml {closing}',
        f"{name}_json: %json {json.dumps(json_schema, ensure_ascii=False)}",
    ]


def _string_value(schema: dict) -> str:
    """The terminal of a raw string value with its closing `</`: enum, const or free text."""
    choices = schema.get("enum")
    if "const" in schema:
        choices = [schema["const"]]
    if isinstance(choices, list) and any(isinstance(c, str) for c in choices):
        return "(" + " | ".join(_lit(c) for c in choices if isinstance(c, str)) + ') "</"'
    parts = ["NO_CLOSE"]
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low or high is not None:
        parts.append(f"/(?s:.{{{low},{'' if high is None else high}}})/")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        parts.append(_pattern_regex(pattern))
    return "(" + " & ".join(parts) + ') "</"'


def _pattern_regex(pattern: str) -> str:
    """A JSON-schema pattern as a Lark regex: it may match anywhere unless anchored."""
    anchored_start = pattern.startswith("^")
    anchored_end = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[1 if anchored_start else 0 : len(pattern) - 1 if anchored_end else None]
    escaped = []
    backslash = False
    for char in body:
        escaped.append("\\/" if char == "/" and not backslash else char)
        backslash = char == "\\" and not backslash
    regex = "(?:" + "".join(escaped) + ")"
    if not anchored_start:
        regex = "(?s:.*)" + regex
    if not anchored_end:
        regex += "(?s:.*)"
    return f"/{regex}/"


def _object_parts(parameters: JsonValue) -> tuple[dict, set[str], dict]:
    """(properties in order, required names, root definitions) of a parameters schema."""
    if not isinstance(parameters, dict):
        return {}, set(), {}
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    required = parameters.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    return properties, required, definitions


def _optional(param: tuple[str, bool]) -> str:
    name, is_required = param
    return name if is_required else f"{name}?"


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
