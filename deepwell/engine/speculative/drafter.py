"""The drafter interface: propose up to k next tokens for each of a step's requests.

N-gram lookup works for any model; model-native drafters (DSpark) implement the same
interface, supply their own per-position survival probabilities and the distributions
their tokens were drawn from.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from deepwell.engine.request import Request


@dataclass
class Draft:
    tokens: list[int]
    # What the confidence table keys on (n-gram match length); model-native drafters
    # may leave it 0 and fill `survival` themselves.
    bucket: int = 0
    # Per position: the probability that it and every position before it are accepted.
    # None: the confidence table estimates it from the bucket.
    survival: list[float] | None = None
    # [len(tokens), vocab] float32: the distribution each token was drawn from, verified
    # with the speculative-sampling rule. None: point masses (n-gram lookup, greedy
    # drafts), verified by matching the target's own draw.
    probs: torch.Tensor | None = None


class Drafter(ABC):
    # The most tokens one draft can hold; None: only the caller's limit.
    max_tokens: int | None = None

    @abstractmethod
    def propose(self, requests: list[Request], rooms: list[int]) -> list[Draft | None]:
        """Per request, up to `rooms[i]` tokens likely to follow its token list; None
        where there is no guess. Every request has exactly one token not yet computed."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop whatever the drafter keeps for a finished request."""
