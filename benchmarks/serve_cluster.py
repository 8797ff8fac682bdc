"""Cluster benchmark: 1 vs 2 workers, routing policies, with and without PD, on a shared-prefix workload.

Requests come in groups that share a long system prompt (a few 128-token KV blocks), as
agent and multi-turn traffic does; a router that sends a group to the worker holding its
prefix computes less. Per configuration: throughput (requests/s, output tokens/s), TTFT
p50/p99 as the streaming client sees it, and the prefix-cache hit rate the workers report.

    .venv/bin/python benchmarks/serve_cluster.py                  # every configuration, short
    .venv/bin/python benchmarks/serve_cluster.py --configs 1,2:least-outstanding,pd \\
        --requests 64 --concurrency 16
    .venv/bin/python benchmarks/serve_cluster.py --pressure       # eviction reports on vs off

A configuration is WORKERS[:POLICY][:no-reports] (the router ignores the prefix blocks the
workers report evicted), or pd. `--pressure` gives every worker a KV pool of `--kv-blocks`
blocks, fewer than the groups' prefixes need, and compares the router with and without
eviction reports on the same workload, each server its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CONFIGS = "1,2:least-outstanding,2:cache-aware,2:round-robin,pd"
PRESSURE_CONFIGS = "2:cache-aware,2:cache-aware:no-reports"
NO_REPORTS = "no-reports"
TOPICS = ["astronomy", "cooking", "chess", "gardening", "sailing", "music"]


@dataclass(frozen=True)
class Result:
    config: str
    seconds: float
    requests: int
    errors: int
    output_tokens: int
    ttft: list[float]
    hit_rate: float


def system_prompt(topic: str) -> str:
    rules = " ".join(
        f"Rule {n}: answer questions about {topic} briefly and kindly." for n in range(30)
    )
    return f"You are an expert on {topic}. {rules}"


def body(model: str, index: int, groups: int, max_tokens: int) -> dict:
    topic = TOPICS[index % groups]
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system_prompt(topic)},
            {"role": "user", "content": f"Question {index}: tell me one thing about {topic}."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def server_args(config: str, store: str) -> list[str]:
    if config == "pd":
        return ["--prefill-workers", "1", "--decode-workers", "1", "--kv-store", store]
    workers, *rest = config.split(":")
    args = ["--workers", workers]
    if NO_REPORTS in rest:
        rest.remove(NO_REPORTS)
        args.append("--no-eviction-reports")
    return args + (["--routing-policy", rest[0]] if rest else [])


def pressure_args(kv_blocks: int) -> list[str]:
    """A pool of `kv_blocks` 128-token blocks per worker, and a context it can hold."""
    return ["--num-kv-blocks", str(kv_blocks), "--max-model-len", str(kv_blocks * 128)]


def start_server(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "deepwell.cli", "serve", "--port", str(port)]
    command += ["--memory-gib", str(args.memory_gib), "--threads", "1", "--log-level", "warning"]
    command += ["--heartbeat-timeout", "10", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"deepwell serve exited with {server.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return server, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.kill()
    raise SystemExit("deepwell serve did not become ready")


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


async def one_request(http, url, payload, ttfts, totals) -> None:
    start = time.perf_counter()
    first = True
    try:
        async with http.stream("POST", url, json=payload) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first and '"content":"' in line:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                match = re.search(r'"completion_tokens":(\d+)', line)
                if match:
                    totals["tokens"] += int(match.group(1))
    except httpx.HTTPError:
        totals["errors"] += 1


async def load(base_url: str, model: str, args: argparse.Namespace) -> tuple[float, list, dict]:
    url = f"{base_url}/v1/chat/completions"
    ttfts: list[float] = []
    totals = {"tokens": 0, "errors": 0}
    gate = asyncio.Semaphore(args.concurrency)

    async def limited(index: int) -> None:
        async with gate:
            payload = body(model, index, args.groups, args.max_tokens)
            await one_request(http, url, payload, ttfts, totals)

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(limited(i) for i in range(args.requests)))
        return time.perf_counter() - start, ttfts, totals


def run_config(config: str, args: argparse.Namespace) -> Result:
    with tempfile.TemporaryDirectory(prefix="deepwell-kv-") as store:
        extra = server_args(config, store)
        if args.pressure:
            extra += pressure_args(args.kv_blocks)
        server, base_url = start_server(args, extra)
        try:
            model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            seconds, ttfts, totals = asyncio.run(load(base_url, model, args))
            metrics = httpx.get(f"{base_url}/metrics").text
        finally:
            server.terminate()
            server.wait(60)
    queried = counter(metrics, "deepwell_prefix_cache_queried_tokens_total")
    hits = counter(metrics, "deepwell_prefix_cache_hit_tokens_total")
    return Result(
        config,
        seconds,
        args.requests,
        totals["errors"],
        totals["tokens"],
        ttfts,
        hits / queried if queried else 0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        help=f"comma-separated (default {CONFIGS}; with --pressure {PRESSURE_CONFIGS})",
    )
    parser.add_argument(
        "--pressure",
        action="store_true",
        help="memory pressure: --kv-blocks per worker; eviction reports on, then off",
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=12, help="--pressure: KV blocks per worker (default 12)"
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--memory-gib", type=float, default=1.0)
    args = parser.parse_args()
    args.configs = args.configs or (PRESSURE_CONFIGS if args.pressure else CONFIGS)
    if args.pressure:
        print(f"memory pressure: {args.kv_blocks} KV blocks of 128 tokens per worker")
    print(
        f"{args.requests} requests, {args.concurrency} at a time, {args.groups} shared "
        f"prefixes, {args.max_tokens} output tokens each"
    )
    print(f"{'config':22} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'hit':>6} err")
    for config in args.configs.split(","):
        r = run_config(config, args)
        print(
            f"{r.config:22} {r.requests / r.seconds:7.2f} {r.output_tokens / r.seconds:7.1f} "
            f"{percentile(r.ttft, 0.5) * 1000:7.0f}ms {percentile(r.ttft, 0.99) * 1000:7.0f}ms "
            f"{r.hit_rate:6.1%} {r.errors}",
            flush=True,
        )


if __name__ == "__main__":
    main()
