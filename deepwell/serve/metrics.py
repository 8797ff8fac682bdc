"""Prometheus metrics of the service: latency histograms, token counters, load and KV gauges.

Load and KV occupancy are read from the engine at scrape time, so `/metrics` shows the
workers' state after their latest step rather than a sampled copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepwell.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class _LoadCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily(
            "deepwell_requests_running", "Requests the engine is computing.", stats.running
        )
        yield GaugeMetricFamily(
            "deepwell_requests_waiting", "Requests queued for the engine.", stats.waiting
        )
        yield GaugeMetricFamily(
            "deepwell_kv_blocks_used", "KV cache blocks held by requests.", stats.kv_blocks_used
        )
        yield GaugeMetricFamily(
            "deepwell_kv_blocks_total", "KV cache blocks in the pool.", stats.kv_blocks_total
        )
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        yield GaugeMetricFamily(
            "deepwell_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", usage
        )
        yield from _kv_reuse_metrics(stats)
        yield from _speculative_metrics(stats)
        yield CounterMetricFamily(
            "deepwell_stuck_requests_ended",
            "Requests the engine's watchdog ended because the step loop had stopped advancing "
            "them, since each live worker started.",
            stats.stuck_requests_ended,
        )


class AdmissionCollector(Collector):
    """Requests refused at the door, by the limit that refused them: `pending` (429, over
    --max-pending-requests) or `waiting` (503, over --max-waiting-requests)."""

    def __init__(self, rejected: Callable[[], dict[str, int]]) -> None:
        self._rejected = rejected

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "deepwell_queue_rejections",
            "Requests refused because a queue limit was reached, by limit.",
            labels=["limit"],
        )
        for limit, count in self._rejected().items():
            family.add_metric([limit], count)
        yield family


def _kv_reuse_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Prefix-cache hit rate in tokens, and the KV store's traffic."""
    counters = (
        (
            "deepwell_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_queried_tokens,
        ),
        (
            "deepwell_prefix_cache_hit_tokens",
            "Prompt tokens the prefix cache supplied (memory or KV store).",
            stats.prefix_hit_tokens,
        ),
        ("deepwell_kv_store_hits", "KV blocks read from the KV store.", stats.store_hits),
        (
            "deepwell_kv_store_misses",
            "KV store lookups that found no usable block.",
            stats.store_misses,
        ),
        ("deepwell_kv_store_read_bytes", "Bytes read from the KV store.", stats.store_read_bytes),
        (
            "deepwell_kv_store_written_bytes",
            "Bytes written to the KV store.",
            stats.store_written_bytes,
        ),
        (
            "deepwell_kv_store_errors",
            "Corrupt, truncated, foreign or unreadable KV store files, and dropped writes.",
            stats.store_errors,
        ),
    )
    for name, documentation, value in counters:
        yield CounterMetricFamily(name, documentation, value)
    queried = stats.prefix_queried_tokens
    yield GaugeMetricFamily(
        "deepwell_prefix_cache_hit_ratio",
        "Prompt tokens supplied by the prefix cache over those looked up, since start.",
        stats.prefix_hit_tokens / queried if queried else 0.0,
    )


def _speculative_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding: verified and accepted draft tokens, acceptance per position,
    tokens per decode step and the confidence error (spec/deepinfer.md §1.6)."""
    spec = stats.spec
    yield CounterMetricFamily(
        "deepwell_spec_verified_tokens", "Draft tokens verified.", spec.verified_tokens
    )
    yield CounterMetricFamily(
        "deepwell_spec_accepted_tokens", "Draft tokens accepted.", spec.accepted_tokens
    )
    yield GaugeMetricFamily(
        "deepwell_spec_accept_ratio",
        "Draft tokens accepted over those verified, since start.",
        spec.accept_rate,
    )
    per_position = GaugeMetricFamily(
        "deepwell_spec_position_accept_ratio",
        "Acceptance of draft tokens by position in the draft (1 = first), since start.",
        labels=["position"],
    )
    for position, rate in enumerate(spec.position_accept_rates, start=1):
        per_position.add_metric([str(position)], rate)
    yield per_position
    yield GaugeMetricFamily(
        "deepwell_spec_tokens_per_decode_step",
        "Tokens a request gains per step it decodes in (1 without speculation), since start.",
        spec.tokens_per_decode,
    )
    yield GaugeMetricFamily(
        "deepwell_spec_confidence_error",
        "Mean absolute error of the draft survival estimates, since start.",
        spec.confidence_error,
    )


class ServeMetrics:
    """The service's metrics registry; `RequestTimer` feeds it per request."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "deepwell_time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "deepwell_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "deepwell_e2e_request_latency_seconds",
            "Time from request arrival to its last output.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "deepwell_prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "deepwell_generation_tokens", "Output tokens generated.", registry=self.registry
        )
        self.requests = Counter(
            "deepwell_requests",
            "Finished requests by route and outcome.",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.registry.register(_LoadCollector(stats))
        self.compute_dtype = Info(
            "deepwell_compute_dtype",
            "The dtype the engine computes in and the --dtype that chose it.",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one request, from arrival to its last output."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._first: float | None = None
        self._last = self._arrival
        self._tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def prompt(self, tokens: int, cached: int = 0) -> None:
        self._metrics.prompt_tokens.inc(tokens)
        self.prompt_tokens += tokens
        self.cached_tokens += cached

    def output(self, tokens: int) -> None:
        if tokens <= 0:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            self._metrics.time_to_first_token.observe(now - self._arrival)
        self._last = now
        self._tokens += tokens
        self._metrics.generation_tokens.inc(tokens)

    @property
    def output_tokens(self) -> int:
        return self._tokens

    @property
    def time_to_first_token(self) -> float | None:
        return None if self._first is None else self._first - self._arrival

    def finish(self, route: str, outcome: str) -> None:
        self._metrics.requests.labels(route, outcome).inc()
        if outcome != "completed":
            return
        self._metrics.e2e_latency.observe(time.perf_counter() - self._arrival)
        if self._first is not None and self._tokens > 1:
            per_token = (self._last - self._first) / (self._tokens - 1)
            self._metrics.time_per_output_token.observe(per_token)
