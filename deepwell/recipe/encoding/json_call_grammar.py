"""Forced tool calls of chat-template models as llguidance Lark grammars (Hermes, Llama-3 JSON).

Text only: the engine compiles it. Each call is spelled as the model's template writes one,
arguments by the tool's JSON schema, so a forced call always parses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from deepwell.recipe.conversation import ToolDefinition
from deepwell.recipe.stream.json_calls import HERMES, HERMES_CLOSE, HERMES_OPEN

# Arguments spelled as the templates' `tojson` writes them (json.dumps: `, ` and `: `); no
# free whitespace, so a small model cannot pad forever.
_JSON_SPELLING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_call_grammar(
    tools: Sequence[ToolDefinition], tool_call_format: str, token_id: Callable[[str], int | None]
) -> str:
    """A grammar for a forced call of one of `tools`, continuing the generation prompt.

    Hermes: one or more `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` blocks, a
    newline apart. Llama-3 JSON: one `{"name": …, "parameters": …}` object. A marker that is
    an added token (`token_id` gives its id) is matched by id, as the stream parser reads it.
    """
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    lines = ["%llguidance {}"]
    if tool_call_format == HERMES:
        lines += [
            'start: call ("\\n" call)*',
            'call: open "\\n{" body "}\\n" close',
            f"open: {_marker(HERMES_OPEN, token_id)}",
            f"close: {_marker(HERMES_CLOSE, token_id)}",
        ]
        arguments_key = "arguments"
    else:
        lines.append('start: "{" body "}"')
        arguments_key = "parameters"
    lines.append("body: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = f'"name": {json.dumps(tool.name, ensure_ascii=False)}, "{arguments_key}": '
        lines.append(f"call_{i}: {_lit(head)} args_{i}")
        lines.append(f"args_{i}: %json {json.dumps(_schema(tool), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _schema(tool: ToolDefinition) -> dict:
    schema = tool.parameters if isinstance(tool.parameters, dict) else {"type": "object"}
    schema = {**schema, "x-guidance": _JSON_SPELLING}
    # Only the declared parameters, as the DSML grammar allows: JSON Schema's default admits
    # any extra key, and a model may then write keys and values without end.
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _marker(spelling: str, token_id: Callable[[str], int | None]) -> str:
    found = token_id(spelling)
    return _lit(spelling) if found is None else f"<[{found}]>"


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
