"""Load test of `deepwell serve`: N concurrent streaming clients for a fixed time.

Reports requests/s, output tokens/s, TTFT and inter-token latency (p50/p99), errors, and the
serving overhead: output tokens/s through HTTP divided by the engine's offline figure on the
same workload (same prompts, same concurrency, greedy, same warm-up and window). Goal: >= 0.9.
Tokens/s come from the server's own counter (and the engine's steps offline) inside the
window, so requests still running at its edges count for what they produced in it.

    .venv/bin/python benchmarks/serve_load.py                 # 64 clients, 60 s warm-up, 120 s measured
    .venv/bin/python benchmarks/serve_load.py --clients 8 --warmup 5 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.recipe import ChatCompletionRequest
from deepwell.serve.messages import ModelInfo
from deepwell.serve.model import served_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers.",
    "What does a compiler do?",
    "Name a famous painter and one of their works.",
    "How many legs does a spider have?",
    "Give me a tip for learning a new language.",
]


@dataclass
class Totals:
    """What the clients saw inside the measurement window."""

    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


@dataclass
class Window:
    """The measurement window: after the warm-up, for the duration; clients run throughout."""

    start: float
    end: float

    def holds(self, moment: float) -> bool:
        return self.start <= moment < self.end


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chat_body(model: str, index: int, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


async def client_loop(
    http: httpx.AsyncClient, model: str, index: int, args, window: Window, totals: Totals
) -> None:
    request = index
    while time.perf_counter() < window.end:
        body = chat_body(model, request, args.max_tokens)
        request += args.clients
        started = time.perf_counter()
        last = None
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    totals.errors += 1
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        now = time.perf_counter()
                        if window.holds(now):
                            if last is None:
                                totals.ttft.append(now - started)
                            else:
                                totals.itl.append(now - last)
                        last = now
            if window.holds(time.perf_counter()):
                totals.requests += 1
        except httpx.HTTPError:
            totals.errors += 1


def generated_tokens(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics").text
    return float(re.search(r"^deepwell_generation_tokens_total (\S+)$", metrics, re.M).group(1))


async def http_run(base_url: str, args) -> tuple[Totals, float]:
    """Closed loop of streaming clients; output tokens/s from the server's own counter."""
    totals = Totals()
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        now = time.perf_counter()
        window = Window(now + args.warmup, now + args.warmup + args.duration)
        clients = [
            asyncio.create_task(client_loop(http, model, i, args, window, totals))
            for i in range(args.clients)
        ]
        await asyncio.sleep(window.start - time.perf_counter())
        before = await asyncio.to_thread(generated_tokens, base_url)
        await asyncio.sleep(window.end - time.perf_counter())
        after = await asyncio.to_thread(generated_tokens, base_url)
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    return totals, (after - before) / args.duration


def offline_run(args) -> tuple[int, float]:
    """The same closed loop straight on EngineCore: N requests in flight, same window."""
    core = EngineCore(
        EngineArgs(model=args.model, max_num_seqs=args.max_num_seqs, memory_gib=args.memory_gib)
    )
    info = ModelInfo(
        core.model_name,
        core.architecture,
        core.max_model_len,
        core.tokenizer.to_str(),
        core.chat_template,
        sorted(core.eos_token_ids),
    )
    model = served_model(info)
    prompts = []
    for index in range(len(PROMPTS)):
        converted = ChatCompletionRequest(chat_body(model.names[0], index, 1)).convert(
            model.conversion_options
        )
        prompts.append(model.encode(converted.conversation))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0, stop_token_ids=model.stop_token_ids
    )
    issued = 0

    def issue() -> None:
        nonlocal issued
        core.add_request(str(issued), prompts[issued % len(prompts)], params)
        issued += 1

    for _ in range(args.clients):
        issue()
    now = time.perf_counter()
    window = Window(now + args.warmup, now + args.warmup + args.duration)
    finished = tokens = 0
    while time.perf_counter() < window.end:
        outputs = core.step()
        inside = window.holds(time.perf_counter())
        for output in outputs:
            tokens += len(output.new_token_ids) if inside else 0
            if output.finished:
                finished += inside
                issue()
    return finished, tokens / args.duration


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "deepwell.cli", "serve", "--port", str(port)]
    command += ["--max-num-seqs", str(args.max_num_seqs), "--memory-gib", str(args.memory_gib)]
    command += ["--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(6000):
        if server.poll() is not None:
            raise SystemExit(f"deepwell serve exited with {server.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return server, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.kill()
    raise SystemExit("deepwell serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before measuring")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--memory-gib", type=float, default=2.0)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = parser.parse_args()

    server, base_url = start_server(args)
    try:
        totals, http_tps = asyncio.run(http_run(base_url, args))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    offline_requests, offline_tps = offline_run(args)

    print(
        f"clients={args.clients} warmup={args.warmup:.0f}s duration={args.duration:.0f}s "
        f"max_tokens={args.max_tokens}"
    )
    print(f"HTTP     requests/s   {totals.requests / args.duration:8.2f}   ({totals.requests})")
    print(f"HTTP     output tok/s {http_tps:8.1f}")
    print(
        f"TTFT     p50 {percentile(totals.ttft, 0.5) * 1000:8.1f} ms"
        f"   p99 {percentile(totals.ttft, 0.99) * 1000:8.1f} ms"
    )
    print(
        f"ITL      p50 {percentile(totals.itl, 0.5) * 1000:8.1f} ms"
        f"   p99 {percentile(totals.itl, 0.99) * 1000:8.1f} ms"
    )
    print(f"errors   {totals.errors}")
    print(f"offline  output tok/s {offline_tps:8.1f}   ({offline_requests} requests/window)")
    if offline_tps == 0:
        # A window too short for the machine's speed: no offline token to divide by.
        sys.exit("no ratio: the offline run produced no token in the window (raise --duration)")
    print(f"overhead ratio (HTTP / offline tok/s) {http_tps / offline_tps:.3f}   (goal >= 0.9)")


if __name__ == "__main__":
    main()
