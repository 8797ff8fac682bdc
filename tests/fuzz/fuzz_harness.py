"""Send fuzz cases to a running server, concurrently, and judge every answer: no 5xx, no
hang, every refusal (and every error event in a stream) in its dialect's shape; then the
server must be healthy and hold no KV blocks.

Run long: `python tests/fuzz/fuzz_harness.py --count 10000` starts a two-worker server on the
embedded model (or `--base-url` targets one already running) and prints the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_bodies import ANTHROPIC, FuzzCase, fuzz_cases  # noqa: E402

# Two workers; a body that leaves its token budget to the server's default (the context)
# is cut at a deadline, well before an answer counts as a hang.
FUZZ_SERVER_ARGS = (
    "--workers",
    "2",
    "--threads",
    "1",
    "--request-timeout",
    "30",
    # Liveness is the soak's to test: a loaded machine's slow heartbeats must not empty the pool.
    "--heartbeat-timeout",
    "10",
    "--memory-gib",
    "1",
)
HANG_S = 120.0


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    bad_shapes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    healthy_after: bool = False
    blocks_held_after: float = -1.0

    @property
    def by_class(self) -> dict[str, int]:
        classes: Counter = Counter()
        for status, count in self.statuses.items():
            classes[f"{status // 100}xx"] += count
        return dict(sorted(classes.items()))

    def summary(self) -> str:
        return (
            f"{sum(self.statuses.values())} bodies in {self.seconds:.0f} s: {self.by_class}; "
            f"5xx {len(self.server_errors)}, hangs {len(self.hangs)}, "
            f"bad error shapes {len(self.bad_shapes)}, healthy after {self.healthy_after}, "
            f"KV blocks held after {self.blocks_held_after:g}"
        )


def shape_problem(dialect: str, payload: object) -> str | None:
    """What is wrong with an error body for `dialect`, or None if it has the shape."""
    if not isinstance(payload, dict):
        return f"not an object: {payload!r:.80}"
    if dialect == ANTHROPIC:
        inner = payload.get("error")
        if payload.get("type") != "error" or not isinstance(inner, dict):
            return f"not Anthropic's error shape: {payload!r:.120}"
        if not isinstance(inner.get("type"), str) or not isinstance(inner.get("message"), str):
            return f"Anthropic error without type/message: {payload!r:.120}"
        return None
    inner = payload.get("error")
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return f"not OpenAI's error shape: {payload!r:.120}"
    if not isinstance(inner.get("type"), str):
        return f"OpenAI error without type: {payload!r:.120}"
    return None


async def _send(http: httpx.AsyncClient, case: FuzzCase, report: FuzzReport) -> None:
    label = f"{case.path} [{case.mutation}]"
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(HANG_S):
            async with http.stream("POST", case.path, content=case.body, headers=headers) as answer:
                report.statuses[answer.status_code] += 1
                kind = answer.headers.get("content-type", "")
                if answer.status_code >= 500:
                    report.server_errors.append(f"{answer.status_code} {label}")
                if kind.startswith("text/event-stream"):
                    async for line in answer.aiter_lines():
                        _check_event(case, line, label, report)
                    return
                text = await answer.aread()
                if answer.status_code >= 400:
                    try:
                        problem = shape_problem(case.dialect, json.loads(text))
                    except ValueError:
                        problem = f"not JSON: {text[:80]!r}"
                    if problem:
                        report.bad_shapes.append(f"{answer.status_code} {label}: {problem}")
    except TimeoutError:
        report.hangs.append(label)


def _check_event(case: FuzzCase, line: str, label: str, report: FuzzReport) -> None:
    if not line.startswith("data: ") or '"error"' not in line:
        return
    try:
        payload = json.loads(line[6:])
    except ValueError:
        return
    if isinstance(payload, dict) and (
        "error" in payload and payload.get("type") in (None, "error")
    ):
        problem = shape_problem(case.dialect, payload)
        if problem:
            report.bad_shapes.append(f"stream {label}: {problem}")
        status = re.search(r"\b5\d\d\b", json.dumps(payload))
        if payload.get("error", {}).get("type") in ("internal_error", "api_error") or (
            status and "Internal server error" in line
        ):
            report.server_errors.append(f"stream error event {label}: {line[:160]}")


async def run_fuzz(
    base_url: str, cases: list[FuzzCase], concurrency: int, progress: int = 0
) -> FuzzReport:
    """`progress`: print a line every this many bodies (0: none)."""
    report = FuzzReport()
    started = time.monotonic()
    queue: asyncio.Queue[FuzzCase] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)

    async def worker(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            await _send(http, queue.get_nowait(), report)
            sent = sum(report.statuses.values()) + len(report.hangs)
            if progress and sent % progress == 0:
                print(f"{sent} bodies, {time.monotonic() - started:.0f} s", file=sys.stderr)

    async with httpx.AsyncClient(base_url=base_url, timeout=HANG_S + 10) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        report.seconds = time.monotonic() - started
        report.healthy_after = (await http.get("/health")).status_code == 200
        report.blocks_held_after = await _settled_blocks(http)
    return report


async def _settled_blocks(http: httpx.AsyncClient, wait_s: float = 60.0) -> float:
    """KV blocks held once the last aborts have reached the workers (up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = (await http.get("/metrics")).text
        held = float(re.search(r"^deepwell_kv_blocks_used (\S+)$", text, re.M).group(1))
        if held == 0 or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--base-url", help="a running server (default: start one, 2 workers)")
    args = parser.parse_args()
    server = None
    base_url = args.base_url
    if base_url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
        import tempfile

        from servers import MODEL_ARGS, start_server

        server = start_server(
            Path(tempfile.mkdtemp(prefix="fuzz-")), *MODEL_ARGS, *FUZZ_SERVER_ARGS
        )
        base_url = server.base_url
    try:
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        report = asyncio.run(
            run_fuzz(base_url, fuzz_cases(args.seed, args.count, model), args.concurrency, 500)
        )
    finally:
        if server is not None:
            server.stop()
    print(report.summary())
    for line in report.server_errors + report.hangs + report.bad_shapes:
        print("  ", line)
    failed = report.server_errors or report.hangs or report.bad_shapes
    return 1 if failed or not report.healthy_after or report.blocks_held_after else 0


if __name__ == "__main__":
    raise SystemExit(main())
