"""A byte-level tokenizer for the tiny random Llama: specials, then one token per byte."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<unk>", "<s>", "</s>", "</think>"]
EOS_ID = 2
THINK_END_ID = 3


def tiny_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(alphabet):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer
