"""Incremental decoding of generated token ids: ids ending mid-character wait for the rest.

Control tokens decode to one private symbol each, so that only a real `</think>` token
ends reasoning, never the same spelling typed with ordinary tokens (spec/recipe.md §8.2).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

from deepwell.recipe.encoding.special_tokens import SpecialToken, SpecialTokens
from deepwell.recipe.stream.chunks import LogprobEntry, TokenLogprob

# Control tokens become characters of Supplementary Private Use Area-B.
_SYMBOL_BASE = 0x10FF00


class TokenBytes(Protocol):
    """What the decoder needs from a tokenizer (deepwell.recipe.encoding.tokenizer.Tokenizer)."""

    def byte_table(self) -> list[bytes]: ...

    def special_token_id(self, spelling: str) -> int | None: ...


class DecodedText:
    """Text of ids that decoded completely, with each id's first character and logprob."""

    __slots__ = ("text", "id_count", "starts", "logprobs")

    def __init__(
        self, text: str, id_count: int, starts: list[int], logprobs: list[LogprobEntry] | None
    ) -> None:
        self.text = text
        self.id_count = id_count
        # starts[i]: offset in `text` of the character holding id i's first byte.
        self.starts = starts
        self.logprobs = logprobs


class TokenDecoder:
    """Joins the bytes of pending ids and releases them once they end on a character boundary."""

    __slots__ = ("_table", "_symbol_of", "spelling_of", "_ids", "_logprobs")

    def __init__(self, tokenizer: TokenBytes, special_tokens: SpecialTokens) -> None:
        self._table = tokenizer.byte_table()
        self._symbol_of: dict[int, str] = {}
        # symbol → spelling, for str.translate when text leaves the parser.
        self.spelling_of: dict[int, str] = {}
        for k, token in enumerate(SpecialToken):
            spelling = special_tokens.token(token)
            token_id = tokenizer.special_token_id(spelling)
            if token_id is not None and token_id not in self._symbol_of:
                self._symbol_of[token_id] = chr(_SYMBOL_BASE + k)
                self.spelling_of[_SYMBOL_BASE + k] = spelling
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None

    def symbol(self, spelling: str) -> str:
        """The character a control token spelled `spelling` decodes to (itself if none)."""
        for code, known in self.spelling_of.items():
            if known == spelling:
                return chr(code)
        return spelling

    def push(
        self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None
    ) -> DecodedText | None:
        if logprobs is not None and len(logprobs) != len(ids):
            raise RuntimeError(
                f"invalid log probabilities: {len(logprobs)} log probabilities "
                f"for {len(ids)} token IDs"
            )
        if logprobs is not None or self._logprobs is not None:
            old = self._logprobs if self._logprobs is not None else [None] * len(self._ids)
            self._logprobs = old + (list(logprobs) if logprobs is not None else [None] * len(ids))
        self._ids.extend(ids)
        text, starts = self._decode(self._ids)
        # Nothing to show yet, or a character still incomplete: wait for more ids.
        if not text or text.endswith("\ufffd"):
            return None
        last = len(text) - 1
        starts = [min(start, last) for start in starts]
        pending_ids, pending_logprobs = self._ids, self._logprobs
        self._ids, self._logprobs = [], None
        entries = None
        if pending_logprobs is not None:
            entries = [
                self._entry(i, lp[0], lp[1]) if lp is not None else None
                for i, lp in zip(pending_ids, pending_logprobs, strict=True)
            ]
        return DecodedText(text, len(pending_ids), starts, entries)

    def _decode(self, ids: list[int]) -> tuple[str, list[int]]:
        table = self._table
        symbol_of = self._symbol_of
        size = len(table)
        parts: list[str] = []
        starts: list[int] = []
        plain = bytearray()
        # Characters before the current run of plain bytes.
        done = 0
        leads = 0
        for token_id in ids:
            symbol = symbol_of.get(token_id)
            if symbol is not None:
                if plain:
                    text = plain.decode("utf-8", "replace")
                    parts.append(text)
                    done += len(text)
                    plain.clear()
                    leads = 0
                starts.append(done)
                parts.append(symbol)
                done += 1
                continue
            data = table[token_id] if 0 <= token_id < size else b""
            # A continuation byte belongs to the character begun before it.
            starts.append(done + leads - (1 if data and data[0] & 0xC0 == 0x80 and leads else 0))
            plain += data
            leads += sum(1 for b in data if b & 0xC0 != 0x80)
        if plain:
            parts.append(plain.decode("utf-8", "replace"))
        return "".join(parts), starts

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
        symbol = self._symbol_of.get(token_id)
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
