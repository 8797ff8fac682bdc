"""PlainTextStream: raw completions' text from token ids, cut at the first stop string."""

from __future__ import annotations

from stream_cases import tokenizer

from deepwell.recipe.stream.plain_text import PlainTextStream

EOT = 128805  # an added token: its text is its spelling, as the tokenizer decodes it


def pushed_one_by_one(ids: list[int], stop: tuple[str, ...] = ()) -> PlainTextStream:
    stream = PlainTextStream(tokenizer(), stop)
    for token_id in ids:
        stream.push([token_id])
    return stream


def test_text_pushed_id_by_id_is_the_tokenizers_decoding() -> None:
    ids = [*tokenizer().encode("Crabs 🦀 walk sideways, 蟹 too."), EOT]
    stream = pushed_one_by_one(ids)
    stream.finish()
    assert stream.text == tokenizer().decode(ids)
    assert "🦀" in stream.text and stream.text.endswith("<|EOT|>")


def test_an_unfinished_character_waits_then_ends_as_a_replacement_at_finish() -> None:
    crab = tokenizer().encode("🦀")
    assert len(crab) > 1
    stream = pushed_one_by_one(crab[:1])
    assert stream.text == ""
    stream.finish()
    assert stream.text == tokenizer().decode(crab[:1]) == "\ufffd"


def test_a_stop_string_across_pushes_ends_the_text_before_it() -> None:
    ids = tokenizer().encode("one two STOP three")
    stream = pushed_one_by_one(ids, ("STOP",))
    assert stream.stop_string == "STOP"
    assert stream.text == "one two "
    assert stream.settled == len(stream.text)
    stream.push(tokenizer().encode(" more"))
    assert stream.text == "one two "


def test_only_a_possible_start_of_a_stop_string_is_held_back() -> None:
    stream = PlainTextStream(tokenizer(), ("STOP", "xyz"))
    stream.push(tokenizer().encode("Hello ST"))
    assert stream.text == "Hello ST" and stream.settled == len("Hello ")
    stream.push(tokenizer().encode("ar"))
    assert stream.stop_string is None and stream.settled == len("Hello STar")
    stream.finish()
    assert stream.settled == len(stream.text)


def test_the_stop_string_completed_first_wins() -> None:
    stream = PlainTextStream(tokenizer(), ("abcd", "bc"))
    stream.push(tokenizer().encode("xabcd"))
    assert stream.stop_string == "bc" and stream.text == "xa"


def test_a_stop_string_may_be_spelled_by_an_added_token() -> None:
    stream = PlainTextStream(tokenizer(), ("<|EOT|>",))
    stream.push([*tokenizer().encode("done"), EOT, *tokenizer().encode("after")])
    assert stream.stop_string == "<|EOT|>" and stream.text == "done"
