"""Which keywords of a JSON schema the engine's grammar does not enforce.

llguidance compiles schemas leniently in the engine (spec.py): a keyword it cannot express
is skipped with a warning. The HTTP process reads the same warnings (no tokenizer needed,
~0.2 ms) so the response can name what the output was not held to.
"""

from __future__ import annotations

import json

import llguidance

_UNIMPLEMENTED = "Unimplemented keys: "
_UNKNOWN_FORMAT = "Unknown format: "
_ONE_OF = "oneOf not fully supported"


def unenforced_keywords(schema_text: str) -> list[str]:
    """Keywords of the schema the grammar skips, in order: `uniqueItems`, `format:iri`, …

    `oneOf` is listed because llguidance enforces it as `anyOf` (not exactly one match).
    """
    schema = json.loads(schema_text)
    if not isinstance(schema, dict):
        return []  # the engine refuses it (a 400), and says why
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"lenient": True})
    failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        return []
    keywords: list[str] = []
    for warning in warnings:
        if warning.startswith(_UNIMPLEMENTED):
            found = json.loads(warning[len(_UNIMPLEMENTED) :])
        elif warning.startswith(_UNKNOWN_FORMAT):
            found = ["format:" + warning[len(_UNKNOWN_FORMAT) :]]
        elif warning.startswith(_ONE_OF):
            found = ["oneOf"]
        else:
            found = [warning]
        for keyword in found:
            # Header-safe and comma-separable: ASCII, control characters and commas escaped.
            spelled = json.dumps(keyword)[1:-1].replace(",", "\\u002c")
            if spelled not in keywords:
                keywords.append(spelled)
    return keywords
