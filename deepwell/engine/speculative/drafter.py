"""The drafter interface: propose up to k next tokens for a request from its token list.

N-gram lookup works for any model; model-native drafters (MTP / DSpark layers) implement
the same interface and supply their own per-position survival probabilities.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class Draft:
    tokens: list[int]
    # What the confidence table keys on (n-gram match length); model-native drafters
    # may leave it 0 and fill `survival` themselves.
    bucket: int = 0
    # Per position: the probability that it and every position before it are accepted.
    # None: the confidence table estimates it from the bucket.
    survival: list[float] | None = None


class Drafter(ABC):
    @abstractmethod
    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft | None:
        """Up to `max_tokens` tokens likely to follow `token_ids`; None when it has no guess."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop whatever the drafter keeps for a finished request."""
