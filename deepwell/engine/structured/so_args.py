"""DeepInfer's `so_args` (spec/deepinfer.md §1.5) read into a StructuredOutput, its
xgrammar-style EBNF translated to the Lark grammar llguidance compiles, or refused by name."""

import json
import re
from collections.abc import Mapping
from typing import Any

from llguidance.gbnf_to_lark import any_to_lark

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.structured.spec import StructuredOutput

# so_args' schema_type → StructuredOutput's kind.
SCHEMA_TYPES = {"json": "json_schema", "regex": "regex", "ebnf": "ebnf"}
_KEYS = {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}
# Keys DeepInfer itself refuses offline (a grammar compiled elsewhere, several bounds).
_OFFLINE_REFUSED = {
    "serialized": "pre-compiled grammars are refused offline, as DeepInfer does; send `schema`",
    "bound_token_ids": "only one bound token is supported, as in DeepInfer; use `bound_token_id`",
}
# Strings, character classes and comments: where "(=" or a name is text, not syntax.
_LITERALS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*')
# xgrammar constructs the Lark dialect has no counterpart for.
_UNSUPPORTED = (
    (re.compile(r"\(\s*="), "the lookahead assertion `(= ...)`"),
    (re.compile(r"\bTagDispatch\s*\("), "the builtin `TagDispatch(...)`"),
)


def structured_output_from_so_args(so_args: Mapping[str, Any]) -> StructuredOutput:
    """The constraint DeepInfer's `so_args` dict asks for; InvalidRequestError (param
    "so_args") naming what is wrong."""
    if not isinstance(so_args, Mapping):
        raise _bad(f"so_args must be a dict, got {type(so_args).__name__}")
    for key, why in _OFFLINE_REFUSED.items():
        if key in so_args:
            raise _bad(f"so_args[{key!r}]: {why}")
    unknown = sorted(set(so_args) - _KEYS)
    if unknown:
        raise _bad(f"so_args has unknown key(s) {unknown}; it takes {sorted(_KEYS)}")
    schema_type = so_args.get("schema_type")
    if schema_type not in SCHEMA_TYPES:
        raise _bad(
            f"so_args['schema_type'] must be one of {list(SCHEMA_TYPES)}, got {schema_type!r}"
        )
    schema = so_args.get("schema")
    if schema_type == "json" and isinstance(schema, dict):
        schema = json.dumps(schema)
    if not isinstance(schema, str) or not schema:
        raise _bad(f"so_args['schema'] must be a non-empty string, got {schema!r}")
    if schema_type == "ebnf":
        schema = ebnf_to_lark(schema)
    trigger = so_args.get("trigger_token_ids") or ()
    if not isinstance(trigger, list | tuple):
        raise _bad(f"so_args['trigger_token_ids'] must be a list of token ids, got {trigger!r}")
    try:
        return StructuredOutput(
            SCHEMA_TYPES[schema_type], schema, tuple(trigger), so_args.get("bound_token_id")
        )
    except InvalidRequestError as error:
        raise _bad(str(error)) from None


def ebnf_to_lark(grammar: str) -> str:
    """An xgrammar (GBNF-style: `root ::= ...`) grammar as Lark; Lark text passes as it is."""
    syntax = _LITERALS.sub(" ", grammar)
    for pattern, construct in _UNSUPPORTED:
        if pattern.search(syntax):
            raise _bad(f"so_args EBNF uses {construct}, which deepwell's grammars do not support")
    try:
        return any_to_lark(grammar)
    # The converter raises its own GbnfToLarkError, and plain Exception for a missing rule.
    except Exception as error:
        raise _bad(f"so_args EBNF does not parse: {error}") from None


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid sampling parameter: {message}", "so_args")
