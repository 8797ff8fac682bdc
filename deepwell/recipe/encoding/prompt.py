"""A rendered prompt and the builder that writes one: plain text and special tokens, in order.

Special ranges are half-open code-point spans, ascending and disjoint (spec/recipe.md §4).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepwell.recipe.conversation import ImageSource


@dataclass(frozen=True)
class RenderedPrompt:
    """Prompt text, the code-point spans that are control tokens, and the images it refers to."""

    prompt: str
    special_ranges: list[tuple[int, int]]
    image_sources: list[ImageSource] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"RenderedPrompt(prompt={self.prompt!r}, special_ranges={self.special_ranges!r})"


class PromptBuilder:
    """Appends plain text and special-token spellings, remembering which is which.

    `pieces` alternates freely between the two kinds; `is_special[i]` tells them apart, so an
    encoder can map specials to ids and tokenize the plain runs without re-scanning the text.
    """

    __slots__ = ("pieces", "is_special", "_length", "_ranges")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.is_special: list[bool] = []
        self._length = 0
        self._ranges: list[tuple[int, int]] = []

    def text(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self.is_special.append(False)
            self._length += len(text)

    def special(self, spelling: str) -> None:
        end = self._length + len(spelling)
        self._ranges.append((self._length, end))
        self.pieces.append(spelling)
        self.is_special.append(True)
        self._length = end

    def text_with_spans(self, text: str, spans: Sequence[tuple[int, int]]) -> None:
        """Plain `text` whose code-point `spans` (ascending, disjoint) are special tokens."""
        at = 0
        for start, end in spans:
            self.text(text[at:start])
            self.special(text[start:end])
            at = end
        self.text(text[at:])

    def text_with_tokens(self, text: str, pattern: re.Pattern[str] | None) -> None:
        """Plain `text` in which every match of `pattern` is a special token."""
        if pattern is None:
            self.text(text)
            return
        self.text_with_spans(text, [m.span() for m in pattern.finditer(text)])

    def plain_runs(self) -> tuple[list[str], list[str | None]]:
        """The prompt as alternating units: maximal plain runs, and specials by spelling.

        Returns `(runs, units)` where `units[i]` is a special spelling or None for the next
        entry of `runs`, so `runs` can be tokenized in one batch and stitched back in order.
        """
        runs: list[str] = []
        units: list[str | None] = []
        pending: list[str] = []
        for piece, special in zip(self.pieces, self.is_special, strict=True):
            if special:
                if pending:
                    runs.append("".join(pending))
                    units.append(None)
                    pending = []
                units.append(piece)
            else:
                pending.append(piece)
        if pending:
            runs.append("".join(pending))
            units.append(None)
        return runs, units

    def build(self, image_sources: Sequence[ImageSource] = ()) -> RenderedPrompt:
        return RenderedPrompt("".join(self.pieces), list(self._ranges), list(image_sources))


def spelling_pattern(spellings: Sequence[str]) -> re.Pattern[str] | None:
    """A regex matching any of `spellings`, longest first where one is a prefix of another."""
    unique = sorted({s for s in spellings if s}, key=len, reverse=True)
    if not unique:
        return None
    return re.compile("|".join(re.escape(s) for s in unique))
