"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
request's last n tokens (longest n first), for any model.

Each request keeps an index from n-gram to the end of its latest occurrence, extended as
tokens arrive, so a proposal costs a few dict lookups rather than a scan.
"""

from deepwell.engine.request import Request
from deepwell.engine.speculative.drafter import Draft, Drafter


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # request id → (per n: n-gram → end index of its latest occurrence, tokens indexed)
        self._indexes: dict[str, tuple[dict[int, dict[tuple[int, ...], int]], int]] = {}

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Draft | None]:
        return [
            self.lookup(request.request_id, request.token_ids, room)
            for request, room in zip(requests, rooms, strict=True)
        ]

    def lookup(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft | None:
        """Up to `max_tokens` tokens that followed the longest matching suffix."""
        grams, indexed = self._indexes.get(request_id) or (
            {n: {} for n in range(self.min_n, self.max_n + 1)},
            0,
        )
        # An occurrence ending at e is usable once token e (its continuation) exists, so
        # the index covers grams ending before the last token; the suffix itself is not in it.
        last = len(token_ids) - 1
        for end in range(max(indexed, self.min_n), last + 1):
            for n, index in grams.items():
                if end >= n:
                    index[tuple(token_ids[end - n : end])] = end
        self._indexes[request_id] = (grams, max(indexed, last + 1))
        for n in range(self.max_n, self.min_n - 1, -1):
            end = grams[n].get(tuple(token_ids[len(token_ids) - n :]))
            if end is not None:
                return Draft(token_ids[end : end + max_tokens], bucket=n)
        return None

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
