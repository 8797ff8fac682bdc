"""Gateway basics (spec/deepinfer.md §5): per-API-key token accounting and a tokens-per-minute limit.

Keys never appear in metrics or logs: they are shown as a short SHA-256 prefix.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from deepwell.serve.errors import ApiError

# The label of requests made without a key (a server with no --api-key).
ANONYMOUS = "anonymous"


def key_label(key: str | None) -> str:
    """How a key is shown: enough of its hash to tell keys apart, nothing to reuse it."""
    if key is None:
        return ANONYMOUS
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class KeyUsage:
    """One key's tokens since the server started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rate_limited: int = 0
    # Token bucket: up to a minute's allowance, refilled continuously, spent after the fact
    # (a request's size is known only once it ends), so it may go below zero.
    allowance: float = 0.0
    refilled_at: float = 0.0


class Gateway:
    """Admits requests per key against `tokens_per_minute` (None: no limit) and bills them."""

    def __init__(
        self, tokens_per_minute: int | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._limit = tokens_per_minute
        self._clock = clock
        self._usage: dict[str, KeyUsage] = {}

    def _entry(self, key: str | None) -> KeyUsage:
        label = key_label(key)
        usage = self._usage.get(label)
        if usage is None:
            usage = KeyUsage(allowance=float(self._limit or 0), refilled_at=self._clock())
            self._usage[label] = usage
        return usage

    def admit(self, key: str | None) -> None:
        """Raise a 429 `ApiError` with Retry-After while the key has spent its minute."""
        usage = self._entry(key)
        if self._limit is None:
            return
        now = self._clock()
        rate = self._limit / 60.0
        usage.allowance = min(self._limit, usage.allowance + (now - usage.refilled_at) * rate)
        usage.refilled_at = now
        if usage.allowance <= 0:
            usage.rate_limited += 1
            wait = max(1, math.ceil((1 - usage.allowance) / rate))
            raise ApiError(
                429,
                f"This API key has used its {self._limit} tokens per minute; retry in {wait} s.",
                {"Retry-After": str(wait)},
            )

    def charge(self, key: str | None, prompt: int, cached: int, completion: int) -> None:
        usage = self._entry(key)
        usage.requests += 1
        usage.prompt_tokens += prompt
        usage.cached_tokens += cached
        usage.completion_tokens += completion
        if self._limit is not None:
            usage.allowance -= prompt + completion

    def usage(self) -> dict[str, KeyUsage]:
        """Per key label, its usage so far."""
        return dict(self._usage)


class GatewayCollector(Collector):
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[Metric]:
        families = {
            "requests": "Finished requests",
            "prompt_tokens": "Prompt tokens",
            "cached_tokens": "Prompt tokens supplied by the prefix cache",
            "completion_tokens": "Output tokens",
            "rate_limited": "Requests refused by the tokens-per-minute limit",
        }
        for field_name, what in families.items():
            family = CounterMetricFamily(
                f"deepwell_api_key_{field_name}", f"{what}, per API key (hashed).", labels=["key"]
            )
            for label, usage in sorted(self._gateway.usage().items()):
                family.add_metric([label], getattr(usage, field_name))
            yield family
