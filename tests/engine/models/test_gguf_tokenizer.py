"""The tokenizer built from the embedded GGUF's metadata (no network)."""

import os

import pytest

from deepwell.engine.models.loader import embedded_model_path, load_checkpoint

from .hf_gguf import fast_gguf_reads

TEXTS = [
    "Hello, how are you?",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🎉!",
    "def f(x):\n    return x  # comment\n\n\n",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_checkpoint(None).tokenizer


def test_matches_transformers_gguf_tokenizer_on_text_without_digits(tokenizer):
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    with fast_gguf_reads():
        reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text


def test_digits_are_split_one_by_one_as_in_smollm2(tokenizer):
    ids = tokenizer.encode("12345").ids
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_control_tokens_stay_whole_and_decode_round_trips(tokenizer):
    ids = tokenizer.encode("<|im_start|>user").ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") == 1
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
