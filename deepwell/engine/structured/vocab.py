"""The served model's vocabulary as llguidance sees it, built from its `tokenizers.Tokenizer`.

Building takes ~0.5 s for a 49k vocabulary, so an engine builds it once, at first use.
"""

import llguidance
from tokenizers import Tokenizer


def grammar_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_id: int
) -> llguidance.LLTokenizer:
    """`vocab_size` is the model's logit width (it may exceed the tokenizer's own size)."""
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)
