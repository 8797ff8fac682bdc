"""Cluster metrics: per-worker routing decisions, load and hit rates; per-role latency.

Read from the engine client at scrape time, like the load gauges of serve/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RoleLatency:
    """Time to first token and between tokens, per worker role (mixed, prefill, decode).

    A prefill worker's first token is the request's; a decode worker's first token is
    the first after the hand-off, so the two show where PD spends its time.
    """

    def __init__(self) -> None:
        # Unregistered: `ClusterCollector` yields them with the rest of the cluster view.
        self.first_token = Histogram(
            "deepwell_worker_time_to_first_token_seconds",
            "Time from sending a request to a worker to its first token there, by role.",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.inter_token = Histogram(
            "deepwell_worker_inter_token_latency_seconds",
            "Time between a request's outputs on a worker, per token, by role.",
            ["role"],
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=None,
        )
        self.rerouted = 0
        self.handed_off = 0
        # Requests failed for crashing too many workers (`RequestCrashedWorkers`).
        self.quarantined = 0


class ClusterCollector(Collector):
    """`workers` returns the client's `WorkerView`s; `latency` is its `RoleLatency`;
    `deadline_expiries` counts requests stopped at their deadline."""

    def __init__(
        self,
        workers: Callable[[], list],
        latency: RoleLatency,
        deadline_expiries: Callable[[], int] = lambda: 0,
    ) -> None:
        self._workers = workers
        self._latency = latency
        self._deadline_expiries = deadline_expiries

    def collect(self) -> Iterator[Metric]:
        views = self._workers()
        labels = ["worker", "role"]
        up = GaugeMetricFamily("deepwell_worker_up", "1 while the worker serves.", labels=labels)
        outstanding = GaugeMetricFamily(
            "deepwell_worker_outstanding_tokens",
            "Prompt tokens to compute plus output tokens to produce on the worker.",
            labels=labels,
        )
        routed = CounterMetricFamily(
            "deepwell_routed_requests", "Requests the router sent to the worker.", labels=labels
        )
        routed_prompt = CounterMetricFamily(
            "deepwell_routed_prompt_tokens",
            "Prompt tokens of the requests sent to the worker.",
            labels=labels,
        )
        routed_hit = CounterMetricFamily(
            "deepwell_routed_hit_tokens",
            "Prompt tokens the router expected the worker's cache (or the store) to supply.",
            labels=labels,
        )
        hit_ratio = GaugeMetricFamily(
            "deepwell_worker_prefix_cache_hit_ratio",
            "The worker's prefix-cache hit tokens over tokens looked up, since it started.",
            labels=labels,
        )
        for view in views:
            key = [str(view.worker_id), view.role]
            up.add_metric(key, 1.0 if view.live else 0.0)
            outstanding.add_metric(key, view.outstanding_tokens)
            routed.add_metric(key, view.routed_requests)
            routed_prompt.add_metric(key, view.routed_prompt_tokens)
            routed_hit.add_metric(key, view.routed_hit_tokens)
            queried = view.stats.prefix_queried_tokens
            hit_ratio.add_metric(key, view.stats.prefix_hit_tokens / queried if queried else 0.0)
        yield from (up, outstanding, routed, routed_prompt, routed_hit, hit_ratio)
        yield from _reliability_metrics(views)
        yield CounterMetricFamily(
            "deepwell_deadline_expiries",
            "Requests stopped at their deadline (--request-timeout), their KV blocks freed.",
            self._deadline_expiries(),
        )
        yield CounterMetricFamily(
            "deepwell_rerouted_requests",
            "Requests re-admitted on another worker after theirs was lost.",
            self._latency.rerouted,
        )
        yield CounterMetricFamily(
            "deepwell_quarantined_requests",
            "Requests failed instead of rerouted: in flight at --worker-crashes-per-request "
            "worker crashes.",
            self._latency.quarantined,
        )
        yield CounterMetricFamily(
            "deepwell_pd_handoffs",
            "Requests handed from a prefill worker to a decode worker.",
            self._latency.handed_off,
        )
        yield from self._latency.first_token.collect()
        yield from self._latency.inter_token.collect()


def _reliability_metrics(views: list) -> Iterator[Metric]:
    """Worker restarts, and each worker's native kernel builds (1 for its current state)."""
    labels = ["worker", "role"]
    restarts = CounterMetricFamily(
        "deepwell_worker_restarts",
        "Times the worker's process was started again after it was lost.",
        labels=labels,
    )
    kernels = GaugeMetricFamily(
        "deepwell_kernel_build_state",
        "1 for each native kernel's build state on the worker: building, loaded, or "
        "unavailable (the torch path runs).",
        labels=[*labels, "kernel", "state"],
    )
    for view in views:
        key = [str(view.worker_id), view.role]
        restarts.add_metric(key, view.restarts)
        for kernel, state in sorted(view.kernels.items()):
            kernels.add_metric([*key, kernel, state], 1.0)
    yield from (restarts, kernels)
