"""Structured output: typed constraints, grammars compiled off the step loop, token masks.

Names load on first use, so that `StructuredOutput` (spec.py) imports without torch: it
travels inside `SamplingParams` through the HTTP process.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepwell.engine.structured.compiler import GrammarCompiler, GrammarError, PendingGrammar
    from deepwell.engine.structured.matcher import GrammarMatcher, apply_masks
    from deepwell.engine.structured.spec import StructuredOutput
    from deepwell.engine.structured.vocab import grammar_tokenizer

# Public name → the module that defines it.
_EXPORTS = {
    "GrammarCompiler": "deepwell.engine.structured.compiler",
    "GrammarError": "deepwell.engine.structured.compiler",
    "PendingGrammar": "deepwell.engine.structured.compiler",
    "GrammarMatcher": "deepwell.engine.structured.matcher",
    "apply_masks": "deepwell.engine.structured.matcher",
    "StructuredOutput": "deepwell.engine.structured.spec",
    "grammar_tokenizer": "deepwell.engine.structured.vocab",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepwell.engine.structured' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
