"""The DeepSeek control-token vocabulary: which tokens exist and how each is spelled.

Spellings can be overridden per deployment (`SpecialTokens`); spec/recipe.md §3.
"""

from __future__ import annotations

import enum


class SpecialToken(enum.Enum):
    Bos = "bos"
    Eos = "eos"
    ThinkingStart = "thinking_start"
    ThinkingEnd = "thinking_end"
    System = "system"
    User = "user"
    Assistant = "assistant"
    LatestReminder = "latest_reminder"
    Dsml = "dsml"
    Image = "image"
    Ref = "ref"
    RefEnd = "ref_end"
    Box = "box"
    BoxEnd = "box_end"
    Point = "point"
    PointEnd = "point_end"
    Polygon = "polygon"
    PolygonEnd = "polygon_end"

    def default_str(self) -> str:
        return DEFAULT_SPELLINGS[self]

    def __repr__(self) -> str:
        return f"SpecialToken.{self.name}"

    __str__ = __repr__


DEFAULT_SPELLINGS: dict[SpecialToken, str] = {
    SpecialToken.Bos: "<｜begin▁of▁sentence｜>",
    SpecialToken.Eos: "<｜end▁of▁sentence｜>",
    SpecialToken.ThinkingStart: "<think>",
    SpecialToken.ThinkingEnd: "</think>",
    SpecialToken.System: "<｜System｜>",
    SpecialToken.User: "<｜User｜>",
    SpecialToken.Assistant: "<｜Assistant｜>",
    SpecialToken.LatestReminder: "<｜latest_reminder｜>",
    SpecialToken.Dsml: "｜DSML｜",
    SpecialToken.Image: "<｜image｜>",
    SpecialToken.Ref: "<｜ref｜>",
    SpecialToken.RefEnd: "<｜/ref｜>",
    SpecialToken.Box: "<｜box｜>",
    SpecialToken.BoxEnd: "<｜/box｜>",
    SpecialToken.Point: "<｜point｜>",
    SpecialToken.PointEnd: "<｜/point｜>",
    SpecialToken.Polygon: "<｜polygon｜>",
    SpecialToken.PolygonEnd: "<｜/polygon｜>",
}

# Grounding tokens are special inside assistant text (spec/recipe.md §15.5).
GROUNDING_TOKENS = (
    SpecialToken.Ref,
    SpecialToken.RefEnd,
    SpecialToken.Box,
    SpecialToken.BoxEnd,
    SpecialToken.Point,
    SpecialToken.PointEnd,
    SpecialToken.Polygon,
    SpecialToken.PolygonEnd,
)


class SpecialTokens:
    """A full set of spellings; keys left out keep their defaults."""

    __slots__ = ("_spellings",)

    def __init__(self, **spellings: str | None) -> None:
        by_key = {token.value: token for token in SpecialToken}
        self._spellings = dict(DEFAULT_SPELLINGS)
        for key, spelling in spellings.items():
            if key not in by_key:
                raise TypeError(f"SpecialTokens() got an unexpected keyword argument '{key}'")
            if spelling is not None:
                self._spellings[by_key[key]] = spelling

    def token(self, which: SpecialToken) -> str:
        return self._spellings[which]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpecialTokens) and self._spellings == other._spellings

    def __hash__(self) -> int:
        return hash(tuple(self._spellings.values()))

    def __repr__(self) -> str:
        changed = {t.value: s for t, s in self._spellings.items() if s != DEFAULT_SPELLINGS[t]}
        return f"SpecialTokens({changed})"


DEFAULT_SPECIAL_TOKENS = SpecialTokens()
