"""GrammarCompiler: off-loop compiles, a cache keyed by grammar, clear errors."""

import json
import time

import pytest

from deepwell.engine.structured import GrammarCompiler, GrammarError, StructuredOutput

from .schemas import heavy_schema
from .tiny_tokenizer import tiny_tokenizer


def ready(pending, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while (matcher := pending.matcher(frozenset({2}))) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return matcher


@pytest.fixture
def compiler(grammar_tokenizer):
    compiler = GrammarCompiler(lambda: grammar_tokenizer)
    yield compiler
    compiler.close()


def test_the_same_grammar_compiles_once(compiler):
    spec = StructuredOutput("regex", "[a-z]{3}")
    first, second = ready(compiler.submit(spec)), ready(compiler.submit(spec))
    assert compiler.num_compiles == 1
    # Each request gets its own matcher state.
    assert first.advance(tiny_tokenizer().encode("a").ids[0])
    assert second.constrains_next


def test_a_trigger_does_not_change_the_cache_key(compiler):
    compiler.submit(StructuredOutput("regex", "x"))
    compiler.submit(StructuredOutput("regex", "x", trigger_token_ids=(3,)))
    assert compiler.num_compiles == 1


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("regex", "[a-z", "unclosed character class"),
        ("ebnf", "start: missing_rule", "unknown name"),
        ("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}', "nope"),
    ],
)
def test_an_invalid_grammar_fails_with_a_clear_message(compiler, kind, spec, message):
    pending = compiler.submit(StructuredOutput(kind, spec))
    with pytest.raises(GrammarError, match=message):
        ready(pending)


def test_a_malformed_schema_fails_at_submit(compiler):
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        compiler.submit(StructuredOutput("json_schema", "{not json"))


def test_a_too_large_spec_fails_at_submit(grammar_tokenizer):
    compiler = GrammarCompiler(lambda: grammar_tokenizer, max_spec_bytes=100)
    with pytest.raises(GrammarError, match="the limit is 100"):
        compiler.submit(StructuredOutput("regex", "a" * 101))
    compiler.close()


def test_a_compile_past_its_timeout_fails_the_request(grammar_tokenizer):
    compiler = GrammarCompiler(lambda: grammar_tokenizer, timeout_s=0.05)
    pending = compiler.submit(StructuredOutput("json_schema", json.dumps(heavy_schema())))
    with pytest.raises(GrammarError, match="took longer than 0.05 s"):
        ready(pending)
    compiler.close()


def test_a_keyword_llguidance_cannot_express_is_skipped_not_refused(compiler):
    # The reference accepts such schemas; the server names the skipped keywords.
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "uniqueItems": True}
    matcher = ready(compiler.submit(StructuredOutput("json_schema", json.dumps(schema))))
    ids = tiny_tokenizer().encode("[1,1").ids
    assert all(matcher.advance(token) for token in ids)  # uniqueItems: not enforced


def test_min_items_is_enforced(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2}
    matcher = ready(compiler.submit(StructuredOutput("json_schema", json.dumps(schema))))
    one, close = tiny_tokenizer().encode("[1]").ids[:2], tiny_tokenizer().encode("]").ids[0]
    assert all(matcher.advance(token) for token in one)
    assert not matcher.advance(close)
