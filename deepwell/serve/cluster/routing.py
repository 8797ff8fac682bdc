"""Routing policies: which worker takes a request, given each worker's load and prefix hit.

A policy is a plain function, so a deployment can pass its own to `assemble_cluster`; the
default follows DeepSeek's entrypoint (spec/deepinfer.md §5): balance load first, and
among equally loaded workers prefer the one that already holds the prompt's prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    """One candidate worker as a policy sees it when a request arrives."""

    worker_id: int
    # Prompt tokens still to compute plus output tokens still to produce, over the
    # requests this front end has in flight on the worker.
    outstanding_tokens: int
    # Leading prompt tokens whose KV blocks the worker holds in memory (its prefix hit).
    hit_tokens: int
    # The same through the shared KV store, which every worker reads: locality is a
    # preference, not a constraint. Equal for every worker; 0 without a store.
    store_hit_tokens: int = 0


RoutingPolicy = Callable[[int, list[WorkerLoad]], int]
"""(prompt tokens, candidate workers, never empty) → the chosen worker's id."""


def least_outstanding_tokens(prompt_tokens: int, workers: list[WorkerLoad]) -> int:
    """The default: fewest outstanding tokens; ties go to the longest prefix hit, then the
    lowest id."""
    best = min(workers, key=lambda w: (w.outstanding_tokens, -w.hit_tokens, w.worker_id))
    return best.worker_id


def cache_aware(prompt_tokens: int, workers: list[WorkerLoad]) -> int:
    """Cost model: a worker's cost is its outstanding tokens plus the prompt tokens it would
    have to compute (those neither its memory nor the store supplies); the cheapest wins."""

    def cost(w: WorkerLoad) -> tuple[int, int]:
        to_compute = prompt_tokens - max(w.hit_tokens, w.store_hit_tokens)
        return (w.outstanding_tokens + to_compute, w.worker_id)

    return min(workers, key=cost).worker_id


def round_robin() -> RoutingPolicy:
    """Ignores load and cache: the baseline the benchmark compares against."""
    turn = 0

    def choose(prompt_tokens: int, workers: list[WorkerLoad]) -> int:
        nonlocal turn
        turn += 1
        return workers[turn % len(workers)].worker_id

    return choose


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "least-outstanding": lambda: least_outstanding_tokens,
    "cache-aware": lambda: cache_aware,
    "round-robin": round_robin,
}
