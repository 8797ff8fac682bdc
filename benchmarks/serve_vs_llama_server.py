"""Serving under load: `deepwell serve` against `llama-server -np 16` through their HTTP APIs,
workload W (benchmarks/workload.py) all at t = 0 and as Poisson arrivals at a few rates.

Both serve the embedded model: llama-server its Q4_1 GGUF (benchmarks/llama_cpp_peer.py: the
weights repacked as llama.cpp does by default, continuous batching, no prompt cache), deepwell the same file with
`--quantization int4` (speculation off and no prefix cache unless asked), with the same threads.
Each server is its own process, started fresh for each round and stopped after it; the
rounds alternate which goes first. A request streams W's prompt ids, greedy, EOS ignored,
exactly its output length: deepwell's `/v1/completions` (`return_token_ids`: each chunk's
new ids), llama-server's `/completion` (each chunk's running `tokens_predicted`).

Per engine and arrival pattern: output tok/s (W's output tokens over the time from the first
request sent to the last token received), TTFT (first token received - request sent),
inter-token latency p50 / p99, and the server's CPU milliseconds per output token (its
process and its children, from /proc: on a shared machine the figure the load moves least). A chunk of k tokens k gaps after the one before it counts as
k gaps of gap / k. The round with the most output tok/s is kept, with its latencies. The
goal (issue 33 item 5): W at t = 0 at >= 3x llama-server's output tok/s at no worse p99 TTFT.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_vs_llama_server.py [--rates 0.5,1,2]
        [--rounds 1] [--threads 2] [--requests 64] [--speculative-tokens 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import llama_cpp_peer as llama_cpp
from workload import make_workload

ROOT = Path(__file__).resolve().parents[1]
DEEPWELL = "deepwell"
LLAMA_SERVER = "llama-server"
ENGINES = (DEEPWELL, LLAMA_SERVER)
SERVED_NAME = "w"
# Arrival schedules are drawn from their own seed, so every engine sees the same one.
ARRIVAL_SEED = 33
# The goal for W at t = 0.
GOAL_RATIO = 3.0


@dataclass
class RequestTrace:
    """What one client saw of one request, in perf_counter seconds."""

    sent: float = 0.0
    # One (arrival time, tokens in that chunk) per chunk that carried tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    def inter_token_gaps(self) -> list[float]:
        gaps = []
        for (before, _), (after, count) in zip(self.chunks, self.chunks[1:], strict=False):
            gaps += [(after - before) / count] * count
        return gaps


@dataclass(frozen=True)
class LoadResult:
    """One engine under one arrival pattern."""

    engine: str
    # None: every request at t = 0; else Poisson arrivals at this many requests a second.
    rate: float | None
    requests: int
    output_tokens: int
    seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    load_average: float
    # CPU seconds the server's processes used while the pattern ran; None off Linux.
    server_cpu_s: float | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float | None:
        if self.server_cpu_s is None:
            return None
        return 1000 * self.server_cpu_s / self.output_tokens


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (the value at rank ceil(q n))."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def arrival_offsets(count: int, rate: float | None, seed: int = ARRIVAL_SEED) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0, or a Poisson process
    of `rate` requests a second whose first arrival is at 0."""
    if rate is None:
        return [0.0] * count
    rng = random.Random(seed)
    offsets, moment = [], 0.0
    for _ in range(count):
        offsets.append(moment)
        moment += rng.expovariate(rate)
    return offsets


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds (user + system) used so far by process `root` and its live descendants,
    from /proc; None where there is no /proc."""
    proc = Path("/proc")
    if not (proc / str(root) / "stat").exists():
        return None
    parents, ticks = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # After "(comm) ": state, ppid, ... utime and stime are stat(5)'s fields 14 and 15.
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    tree, grown = {root}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def summarise(
    engine: str,
    rate: float | None,
    traces: list[RequestTrace],
    start: float,
    server_cpu_s: float | None = None,
):
    end = max(trace.chunks[-1][0] for trace in traces)
    ttft = [trace.ttft() for trace in traces]
    gaps = [gap for trace in traces for gap in trace.inter_token_gaps()]
    return LoadResult(
        engine=engine,
        rate=rate,
        requests=len(traces),
        output_tokens=sum(trace.tokens for trace in traces),
        seconds=end - start,
        ttft_p50_ms=percentile(ttft, 0.5) * 1000,
        ttft_p99_ms=percentile(ttft, 0.99) * 1000,
        itl_p50_ms=percentile(gaps, 0.5) * 1000,
        itl_p99_ms=percentile(gaps, 0.99) * 1000,
        load_average=os.getloadavg()[0],
        server_cpu_s=server_cpu_s,
    )


# ---- each server's HTTP API ----


def deepwell_body(request: dict) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": request["prompt_ids"],
        "max_tokens": request["output_len"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def llama_server_body(request: dict) -> dict:
    body = llama_cpp.completion_body(request["prompt_ids"], request["output_len"])
    return body | {"stream": True}


def deepwell_tokens(chunk: dict, so_far: int) -> int:
    """Tokens received so far: deepwell's chunks carry the ids that arrived since the last."""
    choices = chunk.get("choices") or [{}]
    return so_far + len(choices[0].get("token_ids", ()))


def llama_server_tokens(chunk: dict, so_far: int) -> int:
    """Tokens received so far: llama-server's chunks carry its running count (a token that
    ends inside a UTF-8 character arrives with the next chunk)."""
    return chunk.get("tokens_predicted", so_far)


@dataclass(frozen=True)
class HttpApi:
    """Where a server takes a streamed completion, its body for a W request, and how many
    tokens have arrived once a chunk is in (the chunk, the count before it)."""

    path: str
    body: Callable[[dict], dict]
    tokens: Callable[[dict, int], int]


APIS = {
    DEEPWELL: HttpApi("/v1/completions", deepwell_body, deepwell_tokens),
    LLAMA_SERVER: HttpApi("/completion", llama_server_body, llama_server_tokens),
}


async def stream_one(
    http: httpx.AsyncClient, api: HttpApi, request: dict, trace: RequestTrace
) -> None:
    trace.sent = time.perf_counter()
    received = 0
    async with http.stream("POST", api.path, json=api.body(request)) as response:
        if response.status_code != 200:
            text = (await response.aread())[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {text!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            total = api.tokens(json.loads(line[6:]), received)
            if total > received:
                trace.chunks.append((now, total - received))
                received = total
    if received != request["output_len"]:
        raise RuntimeError(f"{received} tokens streamed for a request of {request['output_len']}")


async def drive(
    base_url: str,
    api: HttpApi,
    workload: list[dict],
    offsets: list[float],
    cpu_seconds: Callable[[], float | None] = lambda: None,
):
    """Sends each request at its offset; returns the traces, the start time and the CPU
    seconds `cpu_seconds` (the server's clock) counted from the start to the last token."""
    # A connection per request: a kept-alive one idle between Poisson arrivals may be
    # closed by the server as the next request goes out on it (llama-server closes idle
    # connections after 5 s: "Server disconnected without sending a response").
    limits = httpx.Limits(max_connections=len(workload) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as http:
        warm = {"prompt_ids": workload[0]["prompt_ids"][:64], "output_len": 8}
        await stream_one(http, api, warm, RequestTrace())
        traces = [RequestTrace() for _ in workload]
        cpu_before = cpu_seconds()
        start = time.perf_counter()

        async def at_offset(index: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
            await stream_one(http, api, workload[index], traces[index])

        await asyncio.gather(*(at_offset(i) for i in range(len(workload))))
        cpu_after = cpu_seconds()
    cpu_used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return traces, start, cpu_used


# ---- the servers ----


class DeepwellServer(llama_cpp.LlamaServer):
    name = "deepwell serve"
    # /health answers while the model loads; /ready once a worker is up.
    ready_path = "/ready"
    ready_timeout = 600.0
    # Killed, its HTTP process would leave its engine workers behind: let it drain them.
    stop_timeout = 120.0


def deepwell_command(args) -> list[str]:
    return [
        sys.executable,
        *("-m", "deepwell.cli", "serve", str(llama_cpp.model_path())),
        *("--served-model-name", SERVED_NAME, "--quantization", "int4"),
        *("--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)),
        *("--num-speculative-tokens", str(args.speculative_tokens)),
        # W's prompts share no prefix, and llama-server runs without its prompt cache.
        "--no-enable-prefix-caching",
        *("--memory-gib", str(args.memory_gib), "--log-level", "warning", "--no-playground"),
    ]


def start_server(engine: str, args, workload: list[dict], log: Path) -> llama_cpp.LlamaServer:
    if engine == DEEPWELL:
        return DeepwellServer(deepwell_command(args), log)
    llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
    context = args.parallel * llama_cpp.slot_context(workload)
    command = llama_cpp.llama_server_command(
        llama, llama_cpp.model_path(), args.threads, args.parallel, context
    )
    return llama_cpp.LlamaServer(command, log)


def run_engine(engine: str, args, workload: list[dict], rates: list) -> list[LoadResult]:
    """One server process, every arrival pattern through it in turn."""
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / f"{engine}.log"
        with start_server(engine, args, workload, log) as server:
            for rate in rates:
                offsets = arrival_offsets(len(workload), rate)
                traces, start, cpu_s = asyncio.run(
                    drive(
                        server.url,
                        APIS[engine],
                        workload,
                        offsets,
                        lambda: tree_cpu_seconds(server.process.pid),
                    )
                )
                result = summarise(engine, rate, traces, start, cpu_s)
                results.append(result)
                print(f"  {describe(result)}", flush=True)
    return results


# ---- report ----


def pattern(rate: float | None) -> str:
    return "W at t = 0" if rate is None else f"Poisson {rate:g} req/s"


def describe(result: LoadResult) -> str:
    cpu = result.cpu_ms_per_token
    return (
        f"{result.engine:12s} {pattern(result.rate):20s} {result.output_tok_s:7.1f} output tok/s"
        f" ({result.seconds:.1f} s), TTFT p50/p99 {result.ttft_p50_ms:.0f}/"
        f"{result.ttft_p99_ms:.0f} ms, inter-token p50/p99 {result.itl_p50_ms:.1f}/"
        f"{result.itl_p99_ms:.1f} ms"
        + ("" if cpu is None else f", server CPU {cpu:.1f} ms/token")
        + f" (load {result.load_average:.2f})"
    )


@dataclass(frozen=True)
class Verdict:
    rate: float | None
    ratio: float
    ttft_p99_ratio: float

    @property
    def met(self) -> bool:
        """The goal is W at t = 0's; under Poisson arrivals there is none."""
        return self.rate is None and self.ratio >= GOAL_RATIO and self.ttft_p99_ratio <= 1.0

    def line(self) -> str:
        if self.rate is None:
            goal = "goal met" if self.met else "goal missed"
            goal += f": >= {GOAL_RATIO:g}x at no worse p99 TTFT"
        else:
            # Both servers keeping up, output tok/s is the arrival rate's, whoever serves.
            goal = "no goal: the arrival rate bounds output tok/s"
        return (
            f"serve ratio, {pattern(self.rate)} (deepwell/llama-server output tok/s):"
            f" {self.ratio:.2f}; p99 TTFT deepwell/llama-server {self.ttft_p99_ratio:.2f}"
            f" ({goal})"
        )


def best_of_rounds(rounds: list[list[LoadResult]]) -> dict[tuple[str, float | None], LoadResult]:
    best: dict[tuple[str, float | None], LoadResult] = {}
    for results in rounds:
        for result in results:
            key = (result.engine, result.rate)
            if key not in best or result.output_tok_s > best[key].output_tok_s:
                best[key] = result
    return best


def verdicts(best: dict[tuple[str, float | None], LoadResult], rates: list) -> list[Verdict]:
    found = []
    for rate in rates:
        ours, theirs = best.get((DEEPWELL, rate)), best.get((LLAMA_SERVER, rate))
        if ours and theirs:
            ratio = ours.output_tok_s / theirs.output_tok_s
            found.append(Verdict(rate, ratio, ours.ttft_p99_ms / theirs.ttft_p99_ms))
    return found


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part]
    if any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 requests a second: {text}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--rates",
        type=parse_rates,
        default=[0.5, 1.0, 2.0],
        help="Poisson arrival rates in requests a second, comma-separated, after W at t = 0",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds; best kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="both servers")
    parser.add_argument("--requests", type=int, default=64, help="W's first N requests only")
    parser.add_argument("--parallel", type=int, default=16, help="llama-server -np")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="deepwell's batch limit")
    parser.add_argument(
        "--speculative-tokens", type=int, default=0, help="deepwell's draft tokens (0: off)"
    )
    parser.add_argument("--memory-gib", type=float, default=2.0, help="deepwell's budget")
    parser.add_argument(
        "--engines",
        type=lambda text: text.split(","),
        default=list(ENGINES),
        help=f"which servers, comma-separated ({', '.join(ENGINES)})",
    )
    parser.add_argument(
        "--llama-cpp-cache", type=Path, default=llama_cpp.CACHE_DIR, help="llama.cpp's build"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if LLAMA_SERVER in args.engines:
        llama = llama_cpp.find_llama_cpp(args.llama_cpp_cache)
        if llama is None:
            sys.exit(llama_cpp.missing_build(args.llama_cpp_cache))
        print(f"llama-server: {llama_cpp.describe(llama)}, weights repacked", flush=True)
    # Stopped with SIGTERM, the servers still stop (their `with` exits).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))
    # deepwell serve runs from this tree, offline.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    os.environ["HF_HUB_OFFLINE"] = "1"
    workload = make_workload()[: args.requests]
    rates: list = [None, *args.rates]
    print(
        f"W: {len(workload)} requests, {sum(r['output_len'] for r in workload)} output tokens;"
        f" {args.threads} threads; llama-server -np {args.parallel}; deepwell int4,"
        f" speculation {args.speculative_tokens or 'off'}; SIMD flags:"
        f" {' '.join(llama_cpp.simd_flags())}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rounds = []
    for index in range(args.rounds):
        order = args.engines if index % 2 == 0 else args.engines[::-1]
        results = []
        for engine in order:
            print(f"round {index + 1}/{args.rounds}: {engine}", flush=True)
            results += run_engine(engine, args, workload, rates)
        rounds.append(results)
    best = best_of_rounds(rounds)
    print(f"best of {args.rounds} round(s):")
    for result in best.values():
        print(f"  {describe(result)}")
    found = verdicts(best, rates)
    for verdict in found:
        print(verdict.line())
    if args.json:
        summary = {
            "threads": args.threads,
            "requests": len(workload),
            "simd_flags": llama_cpp.simd_flags(),
            "results": [
                asdict(r) | {"output_tok_s": r.output_tok_s, "cpu_ms_per_token": r.cpu_ms_per_token}
                for r in best.values()
            ],
            "rounds": [[asdict(r) for r in results] for results in rounds],
            "ratios": [asdict(v) | {"met": v.met} for v in found],
        }
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
