"""StructuredOutput: the typed constraint a request's output must match, and its grammar.

Kinds follow DeepInfer's `so_args` (spec/deepinfer.md §1.5) plus `json_object`; the
optional trigger and bound token delay the grammar until a token sequence has appeared.
"""

import json
from dataclasses import dataclass

import llguidance

from deepwell.engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "ebnf")
# Compact JSON: no free whitespace between tokens, so small models cannot pad forever.
# Lenient: a keyword llguidance cannot express (uniqueItems, contains, some formats, …) is
# skipped, not refused, as the reference accepts such schemas; the server names them in a
# response header (docs/serve.md, "Structured output").
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}


@dataclass(frozen=True)
class StructuredOutput:
    """`spec` is the JSON schema text (json_schema), a regex, or a Lark-style EBNF grammar.

    With `trigger_token_ids` the output is free until that exact sequence has been
    generated, then the grammar applies (DeepSeek thinking: the grammar starts after
    `</think>`). With `bound_token_id`, sampling that token while still free forces the
    trigger sequence next, token by token.
    """

    kind: str
    spec: str = ""
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid structured output: {message}")

        # A message decoded from the wire holds a list here.
        object.__setattr__(self, "trigger_token_ids", tuple(self.trigger_token_ids))

        if self.kind not in KINDS:
            raise bad(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise bad(f"spec must be a string, got {type(self.spec).__name__}")
        if self.kind in ("regex", "ebnf") and not self.spec:
            raise bad(f"a {self.kind} constraint needs a non-empty spec")
        if self.bound_token_id is not None and (
            not self.trigger_token_ids or self.bound_token_id < 0
        ):
            raise bad("bound_token_id must be >= 0 and needs a non-empty trigger")
        if any(not isinstance(t, int) or t < 0 for t in self.trigger_token_ids):
            raise bad("trigger_token_ids must be non-negative token ids")

    def grammar(self) -> str:
        """The llguidance grammar text; the compile cache is keyed by it."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as error:
                raise InvalidRequestError(f"invalid JSON schema: {error}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("invalid JSON schema: the schema must be an object")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            except ValueError as error:
                raise InvalidRequestError(f"invalid JSON schema: {error}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        return llguidance.LLMatcher.grammar_from_lark(self.spec)
