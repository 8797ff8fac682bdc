"""GrammarMatcher: masks follow the grammar, advance and rollback, trigger and bound token."""

import llguidance
import numpy as np
import pytest
import torch

from deepwell.engine.structured import GrammarMatcher, apply_masks

from ..tiny_llama import TINY_CONFIG
from .tiny_tokenizer import EOS_ID, THINK_END_ID, tiny_tokenizer

VOCAB = TINY_CONFIG["vocab_size"]
TOKENIZER = tiny_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def matcher(grammar_tokenizer, regex: str, trigger=(), bound=None) -> GrammarMatcher:
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    inner = llguidance.LLMatcher(grammar_tokenizer, grammar, log_level=0)
    return GrammarMatcher(inner, tuple(trigger), bound, frozenset({EOS_ID}))


def allowed(m: GrammarMatcher) -> set[int]:
    row = np.zeros((VOCAB + 31) // 32, dtype=np.uint32)
    m.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_mask_allows_exactly_the_grammars_next_bytes(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "[ab]c")
    assert allowed(m) == set(ids("a") + ids("b"))
    assert m.advance(ids("a")[0])
    assert allowed(m) == set(ids("c"))


def test_stop_token_is_allowed_only_where_the_grammar_may_end(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "x+")
    assert EOS_ID not in allowed(m)
    m.advance(ids("x")[0])
    assert EOS_ID in allowed(m)
    assert m.advance(EOS_ID)


def test_a_token_outside_the_grammar_puts_the_matcher_in_error(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "[0-9]+")
    assert not m.advance(ids("z")[0])
    assert m.error


def test_rollback_restores_the_earlier_mask(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "(ab|cd)e")
    before = allowed(m)
    for token in ids("ab"):
        m.advance(token)
    assert allowed(m) == set(ids("e"))
    m.rollback(2)
    assert allowed(m) == before
    for token in ids("cd"):
        assert m.advance(token)


def test_output_is_free_until_the_trigger_then_constrained(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "[0-9]", trigger=[THINK_END_ID])
    assert not m.constrains_next
    for token in ids("thinking"):
        assert m.advance(token)
    assert not m.constrains_next
    m.advance(THINK_END_ID)
    assert m.constrains_next
    assert allowed(m) == set(ids("0123456789"))


def test_multi_token_trigger_needs_the_whole_sequence(grammar_tokenizer):
    trigger = ids("END")
    m = matcher(grammar_tokenizer, "[0-9]", trigger=trigger)
    for token in ids("EN") + ids("x") + ids("END"):
        assert not m.constrains_next
        m.advance(token)
    assert m.constrains_next


def test_bound_token_forces_the_trigger_sequence(grammar_tokenizer):
    trigger = ids("END")
    bound = ids("!")[0]
    m = matcher(grammar_tokenizer, "[0-9]", trigger=trigger, bound=bound)
    m.advance(ids("a")[0])
    assert not m.constrains_next
    m.advance(bound)
    for token in trigger:
        assert allowed(m) == {token}
        m.advance(token)
    assert allowed(m) == set(ids("0123456789"))


def test_rollback_across_the_trigger_frees_the_output_again(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "[0-9]+", trigger=[THINK_END_ID])
    for token in ids("hm") + [THINK_END_ID] + ids("12"):
        assert m.advance(token)
    m.rollback(2)
    assert m.constrains_next
    assert allowed(m) == set(ids("0123456789"))
    m.rollback(1)
    assert not m.constrains_next
    m.advance(THINK_END_ID)
    assert m.advance(ids("7")[0])


def test_rollback_beyond_the_recorded_tokens_is_refused(grammar_tokenizer):
    m = matcher(grammar_tokenizer, "a")
    with pytest.raises(ValueError):
        m.rollback(1)


def test_apply_masks_touches_only_the_constrained_rows():
    logits = torch.zeros(3, 40)
    masks = np.zeros((1, 2), dtype=np.uint32)
    masks[0, 0] = (1 << 5) | (1 << 31)
    masks[0, 1] = 1 << 2  # token 34
    apply_masks(logits, [1], masks)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 31, 34]
