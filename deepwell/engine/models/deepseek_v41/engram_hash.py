"""Engram's n-gram hashing: token ids to rows of each Engram layer's table (spec §3.5 steps 1-5).

The tables are built once from the tokenizer and the config; `ngram_rows` then hashes a
step's rows from their recent token history, vectorised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

# Token history slot for "no token here": before the sequence start, or a masked token.
NO_TOKEN = -1

# Hash multipliers are seeded per decoder layer with this factor (the released engram.py).
_SEED_FACTOR = 10007
# A whitespace-only token normalises to one space; this private-use character carries that
# space through the strip (the released normaliser's sentinel).
_LONE_SPACE = "\ue000"


@dataclass(frozen=True)
class EngramHashConfig:
    """The config fields the hash depends on (names as in the model's config.json)."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    # Bucket primes are the consecutive primes from here on (`engram_vocab_size`).
    min_prime: int
    pad_token_id: int

    @classmethod
    def from_text_config(cls, config: Mapping[str, Any]) -> EngramHashConfig:
        return cls(
            layer_ids=tuple(config["engram_layer_ids"]),
            max_ngram_size=config["engram_max_ngram_size"],
            n_heads=config["engram_n_heads"],
            min_prime=config["engram_vocab_size"],
            pad_token_id=config["engram_pad_token_id"],
        )


@dataclass(frozen=True)
class EngramSizes:
    """What the config must say for a tokenizer: its class count and each table's rows."""

    compressed_vocab_size: int
    num_embeddings: tuple[int, ...]


@dataclass(frozen=True)
class EngramLayerTables:
    """One Engram layer's hash constants; heads are ordered n-gram size major (2, 3, ...)."""

    layer_id: int
    multipliers: torch.Tensor  # [max_ngram_size] int64, one per history slot
    primes: torch.Tensor  # [(max_ngram_size - 1) * n_heads] int64, bucket count per head
    offsets: torch.Tensor  # [(max_ngram_size - 1) * n_heads] int64, first row per head

    @property
    def num_rows(self) -> int:
        return int(self.primes.sum())


@dataclass(frozen=True)
class EngramTables:
    token_map: torch.Tensor  # [tokenizer vocab] int64: token id -> normalised class
    compressed_vocab_size: int
    pad_class: int
    max_ngram_size: int
    n_heads: int
    layers: tuple[EngramLayerTables, ...]

    def to(self, device: torch.device | str) -> EngramTables:
        layers = tuple(
            EngramLayerTables(
                t.layer_id, t.multipliers.to(device), t.primes.to(device), t.offsets.to(device)
            )
            for t in self.layers
        )
        return EngramTables(
            self.token_map.to(device),
            self.compressed_vocab_size,
            self.pad_class,
            self.max_ngram_size,
            self.n_heads,
            layers,
        )


def _class_normalizer() -> normalizers.Normalizer:
    # spec §3.5 step 1. The tokenizers normalisers, not Python's, so the Unicode tables and
    # the whitespace set of Strip are the reference's.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE, " "),
        ]
    )


def compressed_token_map(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """Each token id's normalised class, classes numbered by first appearance in id order.

    Tokens are decoded one at a time with special tokens as they are. A token whose lone
    decoding is not valid UTF-8 (it shows U+FFFD) keeps its raw vocabulary string, and one
    that normalises to nothing keeps its decoded text.
    """
    normalizer = _class_normalizer()
    classes: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(classes.setdefault(key, len(classes)))
    return token_map, len(classes)


def layer_primes(config: EngramHashConfig) -> list[list[int]]:
    """Bucket primes per Engram layer, [(max_ngram_size - 1) * n_heads] each.

    The reference restarts its search at `min_prime` for every n-gram size but never reuses
    a prime, which hands out consecutive primes in (layer, n-gram size, head) order.
    """
    per_layer = (config.max_ngram_size - 1) * config.n_heads
    primes: list[int] = []
    candidate = config.min_prime
    while len(primes) < per_layer * len(config.layer_ids):
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return [primes[i * per_layer : (i + 1) * per_layer] for i in range(len(config.layer_ids))]


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """Odd int64 multipliers, one per history slot, from numpy's seeded generator.

    The bound keeps class * multiplier below 2^63, so products never wrap.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    draws = np.random.default_rng(_SEED_FACTOR * layer_id).integers(
        0, bound, size=(max_ngram_size,), dtype=np.int64
    )
    return [int(v) * 2 + 1 for v in draws]


def engram_sizes(tokenizer: Tokenizer, config: EngramHashConfig) -> EngramSizes:
    """`engram_compressed_vocab_size` and `engram_num_embeddings` for this tokenizer."""
    _, compressed_vocab_size = compressed_token_map(tokenizer)
    return EngramSizes(compressed_vocab_size, tuple(sum(p) for p in layer_primes(config)))


def build_engram_tables(
    tokenizer: Tokenizer,
    config: EngramHashConfig,
    *,
    compressed_vocab_size: int | None = None,
    num_embeddings: Sequence[int] | None = None,
) -> EngramTables:
    """Build every Engram layer's tables, checking the config's sizes when given.

    The multipliers depend on the class count, so a tokenizer that disagrees with the
    checkpoint's `engram_compressed_vocab_size` would silently hash to other rows.
    """
    if config.max_ngram_size < 2 or config.n_heads < 1 or config.min_prime < 2:
        raise ValueError("Engram hashing needs max_ngram_size >= 2, n_heads >= 1, min_prime >= 2")
    token_map, classes = compressed_token_map(tokenizer)
    if compressed_vocab_size is not None and classes != compressed_vocab_size:
        raise ValueError(
            f"the tokenizer normalises to {classes} Engram classes, "
            f"the config says engram_compressed_vocab_size={compressed_vocab_size}"
        )
    if not 0 <= config.pad_token_id < len(token_map):
        raise ValueError(f"engram_pad_token_id {config.pad_token_id} is not a tokenizer id")
    primes = layer_primes(config)
    if num_embeddings is not None:
        if len(num_embeddings) != len(config.layer_ids):
            raise ValueError("engram_num_embeddings needs one row count per Engram layer")
        for layer_id, rows, layer in zip(config.layer_ids, num_embeddings, primes, strict=True):
            if sum(layer) > rows:
                raise ValueError(
                    f"Engram layer {layer_id} hashes into {sum(layer)} rows, "
                    f"its table has {rows} (engram_num_embeddings)"
                )
    layers = tuple(
        EngramLayerTables(
            layer_id=layer_id,
            multipliers=torch.tensor(
                hash_multipliers(layer_id, config.max_ngram_size, classes), dtype=torch.long
            ),
            primes=torch.tensor(layer, dtype=torch.long),
            offsets=torch.tensor([0, *np.cumsum(layer[:-1]).tolist()], dtype=torch.long),
        )
        for layer_id, layer in zip(config.layer_ids, primes, strict=True)
    )
    return EngramTables(
        token_map=torch.tensor(token_map, dtype=torch.long),
        compressed_vocab_size=classes,
        pad_class=token_map[config.pad_token_id],
        max_ngram_size=config.max_ngram_size,
        n_heads=config.n_heads,
        layers=layers,
    )


def token_history(
    token_ids: torch.Tensor, positions: torch.Tensor, max_ngram_size: int
) -> torch.Tensor:
    """[rows, max_ngram_size] history of one sequence: `[:, s]` is the token at position - s.

    token_ids: [length] the sequence's tokens from position 0; positions: [rows].
    Slots before the sequence start are NO_TOKEN.
    """
    source = positions.unsqueeze(1) - torch.arange(max_ngram_size, device=positions.device)
    history = token_ids[source.clamp_min(0)]
    return history.masked_fill(source < 0, NO_TOKEN)


def ngram_rows(tables: EngramTables, layer_slot: int, history: torch.Tensor) -> torch.Tensor:
    """Table rows [rows, (max_ngram_size - 1) * n_heads] for one Engram layer.

    history: [rows, max_ngram_size] token ids, `[:, 0]` the row's own token, `[:, s]` the
    token s positions earlier, NO_TOKEN where there is none (sequence start, masked token).
    layer_slot indexes `tables.layers` (the order of `engram_layer_ids`).
    """
    layer = tables.layers[layer_slot]
    missing = history < 0
    # spec §3.5 step 2: once a slot has no token, it and every older slot are pad.
    blocked = missing.cumsum(1) > 0
    classes = tables.token_map[history.clamp_min(0)].masked_fill(blocked, tables.pad_class)
    products = classes * layer.multipliers
    hashes = []
    rolling = products[:, 0]
    for slot in range(1, tables.max_ngram_size):
        rolling = rolling ^ products[:, slot]
        hashes.append(rolling.unsqueeze(1).expand(-1, tables.n_heads))
    # Heads of n-gram size n + 1 take r_n: the primes/offsets are laid out the same way.
    return torch.cat(hashes, dim=1) % layer.primes + layer.offsets


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True
