"""Soak and chaos: mixed traffic against a two-worker server for N minutes while workers are
SIGKILLed and the KV store's files are corrupted and deleted underneath it.

Traffic: the three dialects and raw completions, streamed and not, with tools and JSON
schemas, and clients that leave mid-stream. Reported: requests by outcome, 5xx (must be 0),
stranded requests (client gave up, or the engine's watchdog ended them; must be 0), RSS and
KV blocks over time, blocks held at the end, and the failover identity check (seeded streams
with a worker killed mid-run read the same as undisturbed ones).

    nice .venv/bin/python benchmarks/soak.py --minutes 60 --batch-invariant
    nice .venv/bin/python benchmarks/soak.py --minutes 5 --concurrency 2 --kill-every 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# A request still unanswered after this is stranded (the server's own deadline is shorter).
CLIENT_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 240
SAMPLE_EVERY_S = 10.0
# The error types of a 5xx in each dialect's shape: a stream's error event of one of these
# is a server error, as its status code would have been before the stream began.
SERVER_ERROR_TYPES = ("internal_error", "api_error", "service_unavailable", "overloaded_error")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# About 600 tokens of system prompt, shared by the "chat-prefix" requests.
HANDBOOK = {
    "role": "system",
    "content": " ".join(
        f"Rule {n}: answer plainly, cite the handbook, and keep every reply short."
        for n in range(1, 41)
    ),
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Sample:
    at_s: float
    rss_mib: float
    kv_blocks_used: float
    running: float
    waiting: float
    workers_up: float


@dataclass
class SoakReport:
    minutes: float
    outcomes: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    kills: int = 0
    # Kills put off because a worker was still reloading.
    kills_postponed: int = 0
    store_damage: Counter = field(default_factory=Counter)
    blocks_held_at_end: float = -1
    stuck_ended: float = 0
    deadline_expiries: float = 0
    identity: str = "not run"

    def rss_growth(self) -> float:
        """Median RSS over the last fifth of the run over the median of the fifth after
        warm-up (the second), both from samples with both workers loaded: a sample taken
        while a killed worker reloads counts one process short."""
        loaded = [s for s in self.samples if s.workers_up >= 2]
        if len(loaded) < 2:
            return 0.0
        end = loaded[-1].at_s
        warm = [s.rss_mib for s in loaded if end / 5 <= s.at_s < 2 * end / 5]
        last = [s.rss_mib for s in loaded if s.at_s >= 4 * end / 5]
        if not warm or not last:
            return 0.0
        return statistics.median(last) / statistics.median(warm) - 1

    def text(self) -> str:
        lines = [
            f"soak: {self.minutes:g} min, {sum(self.outcomes.values())} requests, "
            f"{self.kills} worker SIGKILLs ({self.kills_postponed} put off while a worker "
            f"reloaded), store damage {dict(self.store_damage)}",
            f"outcomes: {dict(sorted(self.outcomes.items()))}",
            f"5xx: {len(self.server_errors)}; stranded: {len(self.stranded)}; "
            f"watchdog ends: {self.stuck_ended:g}; deadline expiries: {self.deadline_expiries:g}",
            f"RSS growth after warm-up: {self.rss_growth():+.1%}; "
            f"KV blocks held at the end: {self.blocks_held_at_end:g}",
            f"failover identity: {self.identity}",
            "t(s)  RSS(MiB)  KV used  running  waiting  workers up",
        ]
        lines += [
            f"{s.at_s:5.0f}  {s.rss_mib:8.0f}  {s.kv_blocks_used:7.0f}  {s.running:7.0f}  "
            f"{s.waiting:7.0f}  {s.workers_up:10.0f}"
            for s in self.samples
        ]
        return "\n".join(lines + [f"  {line}" for line in self.server_errors + self.stranded])


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def workers_of(pid: int) -> list[int]:
    """The engine worker processes among the server's children (not its helper pools)."""
    found = []
    for child in children_of(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"deepwell.serve.worker" in command:
            found.append(child)
    return found


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(found.group(1)) if found else 0
    return total / 1024


def start_server(store: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "deepwell.cli", "serve", "--port", str(port)]
    command += ["--workers", "2", "--threads", "1", "--memory-gib", str(args.memory_gib)]
    command += ["--kv-store", str(store), "--request-timeout", str(REQUEST_TIMEOUT_S)]
    command += ["--tool-call-parser", "hermes", "--log-level", "warning"]
    if args.batch_invariant:
        command.append("--batch-invariant")
    server = subprocess.Popen(
        command, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"deepwell serve exited with {server.returncode}")
            try:
                if httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
                    return server, base_url
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("deepwell serve did not become ready")
    except BaseException:
        # SIGTERM lets it stop its workers; a server left behind would keep them.
        server.terminate()
        server.wait(60)
        raise


def request_mix(rng: random.Random, model: str) -> tuple[str, dict, int | None]:
    """A path, a body, and the SSE frames after which the client leaves (None: it stays)."""
    topic = rng.choice(["sailing", "chess", "bread", "comets", "tea"])
    user = {"role": "user", "content": f"Tell me about {topic} in two sentences."}
    stream = rng.random() < 0.6
    leave = rng.randint(0, 5) if stream and rng.random() < 0.2 else None
    kinds = ["chat", "chat-prefix", "chat-tools", "chat-schema", "responses", "messages"]
    kind = rng.choice([*kinds, "completions"])
    if kind == "chat-prefix":
        # A shared prompt of several KV blocks: the store gets block files to damage.
        body = {"messages": [HANDBOOK, user], "max_tokens": rng.randint(4, 24)}
        path = "/v1/chat/completions"
    elif kind == "chat":
        body = {"messages": [user], "max_tokens": rng.randint(4, 48)}
        path = "/v1/chat/completions"
    elif kind == "chat-tools":
        weather = {"role": "user", "content": f"What is the weather in {topic}ville?"}
        body = {"messages": [weather], "max_tokens": 48, "tools": [WEATHER_TOOL]}
        path = "/v1/chat/completions"
    elif kind == "chat-schema":
        schema = {"name": "person", "schema": PERSON_SCHEMA, "strict": True}
        body = {
            "messages": [{"role": "user", "content": "Invent a person as JSON."}],
            "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": schema},
        }
        path = "/v1/chat/completions"
    elif kind == "responses":
        body = {"input": [user], "max_output_tokens": rng.randint(4, 48)}
        path = "/v1/responses"
    elif kind == "messages":
        body = {"messages": [user], "max_tokens": rng.randint(4, 48)}
        path = "/v1/messages"
    else:
        body = {"prompt": f"The history of {topic} begins", "max_tokens": rng.randint(4, 48)}
        path = "/v1/completions"
    return path, {**body, "model": model, "stream": stream}, leave


async def one_request(
    http: httpx.AsyncClient, path: str, body: dict, leave: int | None, report: SoakReport
) -> None:
    label = f"{path} stream={body['stream']}"
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with http.stream("POST", path, json=body) as answer:
                if answer.status_code >= 500:
                    text = (await answer.aread()).decode(errors="replace")
                    report.server_errors.append(f"{answer.status_code} {label}: {text:.200}")
                    report.outcomes[f"{answer.status_code}"] += 1
                    return
                if answer.status_code != 200:
                    report.outcomes[f"{answer.status_code}"] += 1
                    return
                if not body["stream"]:
                    await answer.aread()
                    report.outcomes["completed"] += 1
                    return
                frames = 0
                async for line in answer.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    frames += 1
                    if '"error"' in line and _error_event(line, label, report):
                        return
                    if leave is not None and frames > leave:
                        report.outcomes["client left"] += 1
                        return
                report.outcomes["completed"] += 1
    except TimeoutError:
        report.stranded.append(f"no answer in {CLIENT_TIMEOUT_S:.0f} s: {label}")
    except httpx.TransportError as error:
        report.outcomes[f"transport error ({type(error).__name__})"] += 1


def _error_event(line: str, label: str, report: SoakReport) -> bool:
    """Record an error event in a stream; False if the line was not one."""
    try:
        payload = json.loads(line[6:])
    except ValueError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return False
    kind = error.get("type", "?")
    report.outcomes[f"error event ({kind})"] += 1
    if kind in SERVER_ERROR_TYPES:
        report.server_errors.append(f"error event in {label}: {line[:200]}")
    return True


async def traffic(base_url: str, model: str, until: float, args, report: SoakReport) -> None:
    rng = random.Random(args.seed)

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            await one_request(http, *request_mix(rng, model), report)

    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S + 10) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))


def damage_store(store: Path, rng: random.Random, report: SoakReport) -> None:
    """Corrupt one block file of the KV store and delete another."""
    files = [path for path in store.rglob("*") if path.is_file()]
    rng.shuffle(files)
    for path, action in zip(files, ("corrupt", "delete"), strict=False):
        try:
            if action == "delete":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                if data:
                    for _ in range(8):
                        data[rng.randrange(len(data))] ^= 0xFF
                    path.write_bytes(bytes(data))
            report.store_damage[action] += 1
        except OSError:
            continue


async def chaos(
    server: subprocess.Popen, base_url: str, store: Path, until: float, args, report
) -> None:
    """Store damage every `--damage-every` s; a worker SIGKILLed every `--kill-every` s, but
    only while both serve: a kill while the other still reloads leaves no worker, and the
    503s of that outage would measure the machine's reload time, not failover."""
    rng = random.Random(args.seed + 1)
    next_kill = time.monotonic() + args.kill_every
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while time.monotonic() < until:
            await asyncio.sleep(min(args.damage_every, max(0.0, until - time.monotonic())))
            damage_store(store, rng, report)
            if time.monotonic() < next_kill or time.monotonic() >= until:
                continue
            if metric((await http.get("/metrics")).text, "deepwell_worker_up") < 2:
                report.kills_postponed += 1
                continue
            next_kill = time.monotonic() + args.kill_every
            workers = workers_of(server.pid)
            if workers:
                os.kill(rng.choice(workers), signal.SIGKILL)
                report.kills += 1


async def sampler(server: subprocess.Popen, base_url: str, until: float, report) -> None:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while time.monotonic() < until:
            text = (await http.get("/metrics")).text
            report.samples.append(
                Sample(
                    time.monotonic() - started,
                    rss_mib([server.pid, *children_of(server.pid)]),
                    metric(text, "deepwell_kv_blocks_used"),
                    metric(text, "deepwell_requests_running"),
                    metric(text, "deepwell_requests_waiting"),
                    metric(text, "deepwell_worker_up"),
                )
            )
            await asyncio.sleep(SAMPLE_EVERY_S)


async def seeded_streams(base_url: str, model: str, kill_pid: int | None) -> list[str]:
    """Eight seeded chat streams at once; with `kill_pid`, that worker dies mid-run."""

    async def one(http: httpx.AsyncClient, index: int) -> str:
        body = {
            "model": model,
            "stream": True,
            "seed": 100 + index,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": f"Write line {index} of a poem."}],
        }
        text = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        text.append(choice.get("delta", {}).get("content") or "")
        return "".join(text)

    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as http:
        runs = [asyncio.ensure_future(one(http, index)) for index in range(8)]
        if kill_pid is not None:
            await asyncio.sleep(1.0)
            os.kill(kill_pid, signal.SIGKILL)
        return await asyncio.gather(*runs)


async def settle(base_url: str, wait_s: float = 120.0) -> tuple[float, str]:
    """Blocks held once the last requests have ended (up to `wait_s`), and the metrics."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while True:
            text = (await http.get("/metrics")).text
            held = metric(text, "deepwell_kv_blocks_used")
            if held == 0 or time.monotonic() > deadline:
                return held, text
            await asyncio.sleep(0.5)


async def soak(
    server: subprocess.Popen, base_url: str, store: Path, args, report: SoakReport
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    until = time.monotonic() + args.minutes * 60
    await asyncio.gather(
        traffic(base_url, model, until, args, report),
        chaos(server, base_url, store, until, args, report),
        sampler(server, base_url, until, report),
    )
    await _wait_for_workers(base_url)
    report.blocks_held_at_end, text = await settle(base_url)
    report.stuck_ended = metric(text, "deepwell_stuck_requests_ended_total")
    report.deadline_expiries = metric(text, "deepwell_deadline_expiries_total")
    calm = await seeded_streams(base_url, model, None)
    workers = workers_of(server.pid)
    disturbed = await seeded_streams(base_url, model, workers[0] if workers else None)
    same = sum(a == b for a, b in zip(calm, disturbed, strict=True))
    report.identity = f"{same} of {len(calm)} seeded streams identical with a worker SIGKILLed"


async def _wait_for_workers(base_url: str, wait_s: float = 600.0) -> None:
    """Until both workers serve again (a restarted one reloads its model)."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while time.monotonic() < deadline:
            if metric((await http.get("/metrics")).text, "deepwell_worker_up") >= 2:
                return
            await asyncio.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds between kills")
    parser.add_argument(
        "--damage-every", type=float, default=30.0, help="seconds between store damage"
    )
    parser.add_argument("--memory-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serve batch-invariant, so the failover identity check must read 8 of 8",
    )
    parser.add_argument("--json", help="also write the report here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepwell-soak-") as scratch:
        store = Path(scratch) / "kv-store"
        server, base_url = start_server(store, args)
        report = SoakReport(args.minutes)
        try:
            asyncio.run(soak(server, base_url, store, args, report))
        except KeyboardInterrupt:
            print("interrupted: the figures so far")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    print(report.text())
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "minutes": report.minutes,
                    "outcomes": report.outcomes,
                    "server_errors": report.server_errors,
                    "stranded": report.stranded,
                    "kills": report.kills,
                    "kills_postponed": report.kills_postponed,
                    "store_damage": report.store_damage,
                    "rss_growth": report.rss_growth(),
                    "blocks_held_at_end": report.blocks_held_at_end,
                    "identity": report.identity,
                    "samples": [s.__dict__ for s in report.samples],
                },
                indent=1,
            )
        )
    clean = not report.server_errors and not report.stranded and not report.blocks_held_at_end
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
