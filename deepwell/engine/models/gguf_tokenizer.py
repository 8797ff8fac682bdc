"""Build a HF `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (no network).

Byte-level BPE only (`tokenizer.ggml.model == "gpt2"`), with the pre-tokenizer the file
names in `tokenizer.ggml.pre`.
"""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from deepwell.engine.errors import ModelLoadError

# llama.cpp's token types (gguf TokenType): 3 = control, 4 = user-defined.
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name == "smollm":
        # SmolLM2's own tokenizer.json: every digit on its own, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {name!r}")


def build_tokenizer(
    model: str, pre: str, tokens: list[str], merges: list[str], token_types: list[int]
) -> Tokenizer:
    if model != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE)")
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == USER_DEFINED
        ]
    )
    return tokenizer
