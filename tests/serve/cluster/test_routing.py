"""Routing policies and the front end's prefix index (keys as the engine computes them)."""

from deepwell.engine.kv.prefix_hash import prompt_block_keys
from deepwell.serve.cluster.prefix_index import WorkerPrefixes
from deepwell.serve.cluster.routing import (
    WorkerLoad,
    cache_aware,
    least_outstanding_tokens,
    round_robin,
)


def test_default_policy_picks_the_least_outstanding_tokens():
    workers = [WorkerLoad(0, 500, 256), WorkerLoad(1, 100, 0), WorkerLoad(2, 300, 128)]
    assert least_outstanding_tokens(300, workers) == 1


def test_default_policy_breaks_a_load_tie_by_the_longest_hit():
    workers = [WorkerLoad(0, 100, 0), WorkerLoad(1, 100, 256), WorkerLoad(2, 100, 128)]
    assert least_outstanding_tokens(300, workers) == 1
    tied = [WorkerLoad(3, 0, 0), WorkerLoad(2, 0, 0)]
    assert least_outstanding_tokens(300, tied) == 2


def test_cache_aware_policy_weighs_the_prompt_left_to_compute():
    # Worker 0 is busier but holds 900 of the 1000 prompt tokens: 200 + 100 < 0 + 1000.
    workers = [WorkerLoad(0, 200, 900), WorkerLoad(1, 0, 0)]
    assert cache_aware(1000, workers) == 0
    # With the prefix in the shared store, both compute 100: load decides.
    shared = [WorkerLoad(0, 200, 900, 900), WorkerLoad(1, 0, 0, 900)]
    assert cache_aware(1000, shared) == 1


def test_round_robin_takes_turns():
    choose = round_robin()
    workers = [WorkerLoad(0, 0, 0), WorkerLoad(1, 0, 0)]
    assert [choose(1, workers) for _ in range(4)] == [1, 0, 1, 0]


def test_worker_prefixes_count_leading_hits_and_forget_the_oldest():
    keys = prompt_block_keys(b"", list(range(512)), 128)
    other = prompt_block_keys(b"", list(range(1, 513)), 128)
    held = WorkerPrefixes()
    held.record(keys[:3], capacity=8)
    assert held.hit_blocks(keys) == 3
    assert held.hit_blocks(other) == 0
    held.record(other, capacity=4)
    assert len(held) == 4 and held.hit_blocks(keys) == 0


def test_worker_prefixes_forget_the_blocks_a_worker_reports_evicted():
    keys = prompt_block_keys(b"", list(range(512)), 128)
    held = WorkerPrefixes()
    held.record(keys, capacity=8)
    held.forget([keys[2], b"never recorded"])
    assert held.hit_blocks(keys) == 2 and len(held) == 3
