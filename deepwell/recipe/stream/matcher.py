"""Marker matching that survives chunk boundaries: one KMP state per pattern, kept between pushes.

A `PatternSet` is the ordered pattern list of one parser stage (spec/recipe.md §8.3).
"""

from __future__ import annotations

import re


class Pattern:
    """An exact string; with `newlines`, any run of `\\n` right before it joins the match."""

    __slots__ = ("text", "newlines", "fail")

    def __init__(self, text: str, newlines: bool = False) -> None:
        if not text or (newlines and text[0] == "\n"):
            raise ValueError(f"unusable marker pattern {text!r}")
        self.text = text
        self.newlines = newlines
        self.fail = _failure(text)


def _failure(text: str) -> list[int]:
    """KMP failure function: fail[i] = longest proper border of text[: i + 1]."""
    fail = [0] * len(text)
    k = 0
    for i in range(1, len(text)):
        while k and text[i] != text[k]:
            k = fail[k - 1]
        if text[i] == text[k]:
            k += 1
        fail[i] = k
    return fail


class PatternSet:
    """A stage's patterns in priority order, plus a regex that finds where a match could start."""

    __slots__ = ("patterns", "trigger")

    def __init__(self, patterns: list[Pattern]) -> None:
        self.patterns = patterns
        starts = {p.text[0] for p in patterns} | {"\n" for p in patterns if p.newlines}
        # With no pattern, nothing can ever start a match.
        self.trigger = re.compile(
            "[" + "".join(re.escape(c) for c in sorted(starts)) + "]" if starts else "(?!)"
        )


class Matcher:
    """The running match state of one PatternSet: matched length and newline run per pattern."""

    __slots__ = ("patterns", "matched", "newlines")

    def __init__(self, pattern_set: PatternSet) -> None:
        self.patterns = pattern_set.patterns
        self.matched = [0] * len(self.patterns)
        self.newlines = [0] * len(self.patterns)

    def step(self, c: str) -> tuple[int, int]:
        """Advance every pattern by one character.

        Returns (index of the first pattern completed by `c`, its match length) or
        (-1, pending) where pending is the longest suffix that may still become a match.
        """
        matched = self.matched
        newlines = self.newlines
        pending = 0
        for i, pattern in enumerate(self.patterns):
            text = pattern.text
            j = matched[i]
            if pattern.newlines:
                if j == 0:
                    if c == "\n":
                        newlines[i] += 1
                    elif c == text[0]:
                        j = 1
                    else:
                        newlines[i] = 0
                elif text[j] == c:
                    j += 1
                else:
                    j = _fall_back(pattern, j, c)
                    # The newline run no longer touches the partial match; as in the
                    # reference, the failing character does not start a new run.
                    newlines[i] = 0
                if j == len(text):
                    return i, j + newlines[i]
                matched[i] = j
                length = j + newlines[i]
            else:
                if text[j] == c:
                    j += 1
                elif j:
                    j = _fall_back(pattern, j, c)
                if j == len(text):
                    return i, j
                matched[i] = j
                length = j
            if length > pending:
                pending = length
        return -1, pending


def _fall_back(pattern: Pattern, j: int, c: str) -> int:
    text = pattern.text
    fail = pattern.fail
    while j:
        j = fail[j - 1]
        if text[j] == c:
            return j + 1
    return 1 if text[0] == c else 0
