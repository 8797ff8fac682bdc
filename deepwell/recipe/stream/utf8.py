"""Incremental decoding of generated token ids: ids ending mid-character wait for the rest.

Control (added) tokens decode to one private symbol each, so that only a real `</think>`
token ends reasoning, never the same spelling typed with ordinary tokens (spec/recipe.md §8.2).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

from deepwell.recipe.stream.chunks import LogprobEntry, TokenLogprob

# Control tokens become characters of Supplementary Private Use Area-B, in order of use.
_SYMBOL_BASE = 0x100000
# Deleting these from a token's bytes leaves one byte per character it begins.
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))


class TokenBytes(Protocol):
    """What the decoder needs from a tokenizer (deepwell.recipe.encoding.tokenizer.Tokenizer)."""

    def byte_table(self) -> list[bytes]: ...

    def special_token_id(self, spelling: str) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...


class DecodedText:
    """A segment of ids that decoded completely, with where each id's text lies, and logprobs."""

    __slots__ = ("text", "id_count", "starts", "ends", "logprobs")

    def __init__(
        self,
        text: str,
        id_count: int,
        starts: list[int],
        ends: list[int],
        logprobs: list[LogprobEntry] | None,
    ) -> None:
        self.text = text
        self.id_count = id_count
        # ends[i]: offset in `text` just past the character holding id i's last byte.
        self.ends = ends
        # starts[i]: offset in `text` of the character holding id i's first byte.
        self.starts = starts
        self.logprobs = logprobs


class TokenDecoder:
    """Joins the bytes of pending ids and releases them once they end on a character boundary."""

    __slots__ = (
        "_tokenizer",
        "_table",
        "_symbol_of",
        "_ordinary",
        "spelling_of",
        "_ids",
        "_logprobs",
    )

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._table = tokenizer.byte_table()
        # Ids are classified on first sight: added tokens get a symbol, the rest are ordinary.
        self._symbol_of: dict[int, str] = {}
        self._ordinary: set[int] = set()
        # symbol → spelling, for str.translate when text leaves the parser.
        self.spelling_of: dict[int, str] = {}
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None

    def _symbol(self, token_id: int) -> str | None:
        """The symbol of an added token (one the tokenizer looks up by its spelling), else None."""
        symbol = self._symbol_of.get(token_id)
        if symbol is None and token_id not in self._ordinary:
            data = self._table[token_id] if 0 <= token_id < len(self._table) else b""
            spelling = data.decode("utf-8", "replace")
            if data and self._tokenizer.special_token_id(spelling) == token_id:
                symbol = chr(_SYMBOL_BASE + len(self._symbol_of))
                self._symbol_of[token_id] = symbol
                self.spelling_of[ord(symbol)] = spelling
            else:
                self._ordinary.add(token_id)
        return symbol

    def encode(self, text: str) -> list[int]:
        """Full-vocabulary encoding of `text` (control spellings become their ids)."""
        return self._tokenizer.encode(text)

    def symbol(self, spelling: str) -> str:
        """The character a control token spelled `spelling` decodes to (itself if none)."""
        token_id = self._tokenizer.special_token_id(spelling)
        symbol = None if token_id is None else self._symbol(token_id)
        return spelling if symbol is None else symbol

    def push(
        self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None
    ) -> list[DecodedText]:
        """Decode what is complete, as segments: runs of ordinary ids and single control tokens.

        Each segment is fed to the parser as a chunk of its own, as the reference does.
        """
        if logprobs is not None and len(logprobs) != len(ids):
            raise RuntimeError(
                f"invalid log probabilities: {len(logprobs)} log probabilities "
                f"for {len(ids)} token IDs"
            )
        if logprobs is not None or self._logprobs is not None:
            old = self._logprobs if self._logprobs is not None else [None] * len(self._ids)
            self._logprobs = old + (list(logprobs) if logprobs is not None else [None] * len(ids))
        self._ids = self._ids + list(ids) if self._ids else list(ids)
        segments = self._segments(self._ids)
        last_text = segments[-1][1]
        if not last_text or last_text.endswith("\ufffd"):
            # Nothing to show yet, or a character still incomplete: that segment waits.
            self._ids = segments.pop()[0]
        else:
            self._ids = []
        pending_logprobs = self._logprobs
        if pending_logprobs is not None:
            waiting = len(self._ids)
            self._logprobs = (
                pending_logprobs[len(pending_logprobs) - waiting :] if waiting else None
            )
        out = []
        first = 0
        for segment_ids, text, starts, ends in segments:
            entries = None
            if pending_logprobs is not None:
                given = pending_logprobs[first : first + len(segment_ids)]
                first += len(segment_ids)
                # A segment whose ids came from pushes with and without log probabilities
                # has none at all, as in the reference.
                if None not in given:
                    entries = [
                        self._entry(i, lp[0], lp[1])
                        for i, lp in zip(segment_ids, given, strict=True)
                    ]
            out.append(DecodedText(text, len(segment_ids), starts, ends, entries))
        return out

    def flush(self) -> str:
        """The text of the ids still held when the stream ends: an unfinished character
        becomes U+FFFD, control tokens their symbols."""
        held, self._ids, self._logprobs = self._ids, [], None
        return "".join(text for _, text, _, _ in self._segments(held)) if held else ""

    def _segments(self, ids: list[int]) -> list[tuple[list[int], str, list[int], list[int]]]:
        """Split ids at control tokens and decode each piece: (ids, text, starts, ends).

        Ids that decode to nothing join the next segment, so no segment is empty but the last.
        """
        is_symbol = self._symbol
        if not any(is_symbol(token_id) for token_id in ids):
            # The common case: ordinary ids only, one segment.
            return [(ids, *self._decode(ids))]
        groups: list[list[int]] = []
        plain: list[int] = []
        for token_id in ids:
            if is_symbol(token_id):
                if plain:
                    groups.append(plain)
                    plain = []
                groups.append([token_id])
            else:
                plain.append(token_id)
        if plain or not groups:
            groups.append(plain)
        segments = []
        carried: list[int] = []
        for k, group in enumerate(groups):
            group = carried + group
            text, starts, ends = self._decode(group)
            if not text and k + 1 < len(groups):
                carried = group
                continue
            carried = []
            segments.append((group, text, starts, ends))
        return segments

    def _decode(self, ids: list[int]) -> tuple[str, list[int], list[int]]:
        """Text of `ids` with, per id, the offsets of its first character and past its last."""
        if len(ids) == 1 and ids[0] in self._symbol_of:
            return self._symbol_of[ids[0]], [0], [1]
        table = self._table
        size = len(table)
        starts: list[int] = []
        ends: list[int] = []
        plain = bytearray()
        # Characters begun so far: UTF-8 lead bytes.
        leads = 0
        for token_id in ids:
            data = table[token_id] if 0 <= token_id < size else b""
            # A continuation byte belongs to the character begun before it.
            starts.append(leads - 1 if data and data[0] & 0xC0 == 0x80 and leads else leads)
            plain += data
            leads += len(data.translate(None, _CONTINUATION_BYTES))
            ends.append(leads)
        text = plain.decode("utf-8", "replace")
        last = max(len(text) - 1, 0)
        return text, [min(s, last) for s in starts], ends

    def _entry(
        self, token_id: int, logprob: float, top: Sequence[tuple[int, float]]
    ) -> LogprobEntry:
        token, data = self._token_text(token_id)
        alternatives = []
        for top_id, top_logprob in top:
            top_token, top_data = self._token_text(top_id)
            alternatives.append(LogprobEntry(top_token, f32_json(top_logprob), top_data, []))
        return LogprobEntry(token, f32_json(logprob), data, alternatives)

    def _token_text(self, token_id: int) -> tuple[str, bytes]:
        symbol = self._symbol(token_id)
        if symbol is not None:
            spelling = self.spelling_of[ord(symbol)]
            return spelling, spelling.encode()
        data = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            # spec/recipe.md §15.8: part of a character → every byte as \xNN.
            return "".join(f"\\x{b:02x}" for b in data), data


def f32_json(value: float) -> str:
    """A logprob as the reference writes it: the shortest 32-bit spelling (spec/recipe.md §15.8)."""
    try:
        single = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return "null"
    if single != single or single in (float("inf"), float("-inf")):
        return "null"
    for precision in range(9):
        spelled = f"{single:.{precision}e}"
        if struct.unpack("f", struct.pack("f", float(spelled)))[0] == single:
            break
    mantissa, exponent = spelled.split("e")
    sign = "-" if mantissa.startswith("-") else ""
    digits = mantissa.lstrip("-").replace(".", "").rstrip("0") or "0"
    # Position of the decimal point relative to the digits, as in the ryu crate's layout.
    point = int(exponent) + 1
    length = len(digits)
    if length <= point <= 13:
        return f"{sign}{digits}{'0' * (point - length)}.0"
    if 0 < point <= 13:
        return f"{sign}{digits[:point]}.{digits[point:]}"
    if -6 < point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    exp = point - 1
    exp_text = f"e+{exp}" if exp >= 0 else f"e{exp}"
    if length == 1:
        return f"{sign}{digits}{exp_text}"
    return f"{sign}{digits[0]}.{digits[1:]}{exp_text}"
