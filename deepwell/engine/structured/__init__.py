"""Structured output: typed constraints, grammars compiled off the step loop, token masks."""

from deepwell.engine.structured.compiler import GrammarCompiler, GrammarError, PendingGrammar
from deepwell.engine.structured.matcher import GrammarMatcher, apply_masks
from deepwell.engine.structured.spec import StructuredOutput
from deepwell.engine.structured.vocab import grammar_tokenizer

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "PendingGrammar",
    "StructuredOutput",
    "apply_masks",
    "grammar_tokenizer",
]
