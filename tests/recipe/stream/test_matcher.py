"""KMP marker matching across chunk boundaries.

The matcher sees one character at a time; its state is what a chunk boundary carries over.
"""

from __future__ import annotations

from deepwell.recipe.stream.matcher import Matcher, Pattern, PatternSet


def feed(matcher: Matcher, text: str) -> list[tuple[int, int]]:
    return [matcher.step(c) for c in text]


def test_partial_match_survives_and_falls_back_with_the_failure_function() -> None:
    m = Matcher(PatternSet([Pattern("abab")]))
    # "aba" pending, then "c" breaks it; "abab" later completes.
    assert feed(m, "aba")[-1] == (-1, 3)
    assert m.step("c") == (-1, 0)
    assert feed(m, "ababab")[3] == (0, 4)


def test_overlapping_prefix_keeps_the_longest_pending_suffix() -> None:
    m = Matcher(PatternSet([Pattern("aab")]))
    assert feed(m, "aaa") == [(-1, 1), (-1, 2), (-1, 2)]
    assert m.step("b") == (0, 3)


def test_newline_prefixed_pattern_swallows_a_newline_run() -> None:
    m = Matcher(PatternSet([Pattern("</think>", newlines=True)]))
    steps = feed(m, "x\n\n</think>")
    assert steps[2] == (-1, 2)
    assert steps[-1] == (0, 10)


def test_a_failed_partial_match_does_not_start_a_newline_run() -> None:
    m = Matcher(PatternSet([Pattern("<X", newlines=True)]))
    assert feed(m, "<\n<X")[-1] == (0, 2)


def test_first_pattern_in_priority_order_wins_when_two_complete_together() -> None:
    m = Matcher(PatternSet([Pattern("ab"), Pattern("b")]))
    assert feed(m, "ab")[-1] == (0, 2)


def test_trigger_finds_the_first_possible_match_start() -> None:
    patterns = PatternSet([Pattern("</think>", newlines=True), Pattern("STOP")])
    assert patterns.trigger.search("hello world") is None
    assert patterns.trigger.search("abc\nde").start() == 3
    assert patterns.trigger.search("xyS").start() == 2
