"""Mutated bodies over the five endpoint families, streaming and not, eight at a time,
against a two-worker server: no 5xx, no hang, every error in its dialect's shape, healthy
after, no KV block held."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from fuzz_bodies import fuzz_cases  # noqa: E402
from fuzz_harness import FUZZ_SERVER_ARGS, run_fuzz  # noqa: E402
from servers import MODEL_ARGS, start_server  # noqa: E402


@pytest.fixture(scope="module")
def two_worker_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("fuzz"), *MODEL_ARGS, *FUZZ_SERVER_ARGS)
    yield server
    assert server.stop() == 0


def _assert_clean(report) -> None:
    assert not report.server_errors, report.server_errors
    assert not report.hangs, report.hangs
    assert not report.bad_shapes, report.bad_shapes
    assert report.healthy_after
    assert report.blocks_held_after == 0


def test_fuzzed_bodies_get_no_5xx_and_dialect_shaped_errors(two_worker_server):
    cases = fuzz_cases(seed=1, count=150, model=two_worker_server.model)
    report = asyncio.run(run_fuzz(two_worker_server.base_url, cases, concurrency=8))
    _assert_clean(report)
    assert report.by_class.get("4xx", 0) > 0 and report.by_class.get("2xx", 0) > 0


@pytest.mark.slow
def test_ten_thousand_fuzzed_bodies(two_worker_server):
    cases = fuzz_cases(seed=0, count=10_000, model=two_worker_server.model)
    report = asyncio.run(run_fuzz(two_worker_server.base_url, cases, concurrency=8))
    _assert_clean(report)
