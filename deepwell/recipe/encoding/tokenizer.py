"""A HF `tokenizer.json` seen the way the recipe needs it: full encode, plain encode, decode.

Special tokens map to fixed ids by spelling; plain text is tokenized with the added
vocabulary emptied, so user-typed control spellings stay ordinary text (spec/recipe.md §5).
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from functools import cached_property
from pathlib import Path

import tokenizers

# Plain runs at least this long are remembered: chat clients resend the whole history each
# turn, so most of a long prompt's text was tokenized for the previous request.
CACHE_MIN_CHARS = 256
CACHE_MAX_TOKENS = 4_000_000  # ~16 MB of ids


class _RunCache:
    """Least-recently-used plain runs and their ids (4 bytes per id), bounded in tokens."""

    def __init__(self, max_tokens: int) -> None:
        self._max_tokens = max_tokens
        self._tokens = 0
        self._runs: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._runs.get(text)
            if ids is None:
                return None
            self._runs.move_to_end(text)
        return ids.tolist()

    def put(self, text: str, ids: list[int]) -> None:
        if len(ids) > self._max_tokens:
            return
        packed = array("I", ids)
        with self._lock:
            previous = self._runs.pop(text, None)
            if previous is not None:
                self._tokens -= len(previous)
            self._runs[text] = packed
            self._tokens += len(packed)
            while self._tokens > self._max_tokens:
                _, evicted = self._runs.popitem(last=False)
                self._tokens -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._runs.clear()
            self._tokens = 0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte↔printable-character table used by ByteLevel BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """One tokenizer file, loaded twice: with and without its added vocabulary.

    Decoding API (for the stream processor): `decode(ids)` is HF's decode with special
    tokens kept; `token_bytes(id)` is the exact byte string a token stands for (a token may
    hold part of a UTF-8 character), and `byte_table()` lists them all by id, so an
    incremental decoder can join bytes and cut at character boundaries itself.
    """

    def __init__(self, full: tokenizers.Tokenizer, json_text: str) -> None:
        self._full = full
        self._json_text = json_text
        self._runs = _RunCache(CACHE_MAX_TOKENS)
        self._special_ids = {
            added.content: token_id for token_id, added in full.get_added_tokens_decoder().items()
        }

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            json_text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise RuntimeError(f"{error.strerror} (os error {error.errno})") from None
        return cls.from_str(json_text)

    @classmethod
    def from_str(cls, json_text: str) -> Tokenizer:
        try:
            full = tokenizers.Tokenizer.from_str(json_text)
        # HF `tokenizers` raises a bare Exception carrying serde's message, which the
        # reference reports as a RuntimeError with the same text (spec/recipe.md §1).
        except Exception as error:  # noqa: BLE001
            raise RuntimeError(str(error)) from None
        return cls(full, json_text)

    @cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        data = json.loads(self._json_text)
        data["added_tokens"] = []
        return tokenizers.Tokenizer.from_str(json.dumps(data, ensure_ascii=False))

    @property
    def vocab_size(self) -> int:
        return self._full.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Full-vocabulary encode: control spellings anywhere become their ids; adds nothing."""
        return self._full.encode(text, add_special_tokens=False).ids

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        """Tokenize each text with no added vocabulary; long runs seen lately come from a cache,
        the rest go to the Rust tokenizer as one batch, encoded in parallel."""
        out: list[list[int] | None] = [None] * len(texts)
        missing: list[int] = []
        for i, text in enumerate(texts):
            if len(text) >= CACHE_MIN_CHARS:
                out[i] = self._runs.get(text)
            if out[i] is None:
                missing.append(i)
        batch = [texts[i] for i in missing]
        for i, encoding in zip(
            missing, self._plain.encode_batch_fast(batch, add_special_tokens=False), strict=True
        ):
            ids = encoding.ids
            out[i] = ids
            if len(texts[i]) >= CACHE_MIN_CHARS:
                self._runs.put(texts[i], ids)
        return out

    def clear_cache(self) -> None:
        """Forget remembered plain runs (for cold-start measurements)."""
        self._runs.clear()

    def special_token_id(self, spelling: str) -> int | None:
        """The id of the added token spelled exactly `spelling`, if there is one."""
        return self._special_ids.get(spelling)

    def added_spellings(self) -> list[str]:
        """Every added token's spelling: the text a full-vocabulary encode maps to one id."""
        return list(self._special_ids)

    def decode(self, ids: list[int]) -> str:
        return self._full.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.byte_table()[token_id]

    def byte_table(self) -> list[bytes]:
        """`table[id]` = the bytes of token `id` (empty for ids the file does not define)."""
        return self._byte_table

    @cached_property
    def _byte_table(self) -> list[bytes]:
        decoder = json.loads(self._json_text).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
        table = [b""] * self.vocab_size
        added = set()
        for token_id, token in self._full.get_added_tokens_decoder().items():
            table[token_id] = token.content.encode("utf-8")
            added.add(token_id)
        alphabet = _byte_level_alphabet()
        for piece, token_id in self._full.get_vocab(with_added_tokens=False).items():
            if token_id in added:
                continue
            if "ByteLevel" in kinds:
                table[token_id] = bytes(alphabet[ch] for ch in piece)
            elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x"):
                table[token_id] = bytes([int(piece[3:5], 16)])
            else:
                # SentencePiece-style vocabularies spell a space as "▁".
                table[token_id] = piece.replace("\u2581", " ").encode("utf-8")
        return table
