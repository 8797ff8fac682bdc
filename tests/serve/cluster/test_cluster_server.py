"""`deepwell serve --workers 2` with the embedded model: routing, SIGKILL failover through the
official SDKs (seeded text equal to an undisturbed run), rejoin, and PD disaggregation."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import anthropic
import httpx
import openai
import pytest
from servers import DEEPWELL, MODEL_ARGS, REPO, children_of, free_port, start_server

# Batch invariance makes a re-admitted request's prefill produce the logits its decode
# steps would have, so seeded samples continue identically after a failover.
# A SIGKILL is noticed from the process exit within 0.1 s; the heartbeat timeout is raised
# because on a shared 2-core machine a busy worker's heartbeat thread can stall past 1 s.
CLUSTER_ARGS = (
    *MODEL_ARGS,
    *("--threads", "1", "--batch-invariant", "--workers", "2", "--heartbeat-timeout", "10"),
)
MAX_TOKENS = 12


def metric(server, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:{{(.*)}})? (\S+)", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def openai_stream(client, model: str, index: int) -> str:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me one fact about the number {index}."}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=1000 + index,
        stream=True,
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            _progress.add(index)
    return "".join(parts)


async def anthropic_stream(client, model: str, index: int) -> str:
    parts = []
    async with client.messages.stream(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": f"Name an animal for the letter {index}."}],
        extra_body={"temperature": 1.0},
        extra_headers={"x-deepwell-seed": str(2000 + index)},
    ) as stream:
        async for text in stream.text_stream:
            parts.append(text)
            _progress.add(index)
    return "".join(parts)


# Indices of the streams that have produced text so far.
_progress: set[int] = set()


async def run_streams(server, count: int, kill_after: int | None = None) -> list[str]:
    """`count` concurrent streams, half per SDK; with `kill_after`, SIGKILL one worker once
    that many streams have produced text."""
    _progress.clear()
    model = server.model
    oa = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tasks = [
        asyncio.create_task(
            openai_stream(oa, model, i) if i % 2 == 0 else anthropic_stream(an, model, i)
        )
        for i in range(count)
    ]
    if kill_after is not None:
        while len(_progress) < kill_after:
            assert not all(t.done() for t in tasks), "every stream ended before the kill"
            await asyncio.sleep(0.01)
        victim = children_of(server.process.pid)[0]
        os.kill(victim, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    await oa.close()
    await an.close()
    return results


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    join = f"tcp://127.0.0.1:{free_port()}"
    server = start_server(
        tmp_path_factory.mktemp("cluster"), *CLUSTER_ARGS, "--worker-address", join
    )
    server.join_address = join
    yield server
    assert server.stop() == 0


def failover(server, count: int, rejoin: bool) -> None:
    undisturbed = asyncio.run(run_streams(server, count))
    assert all(undisturbed), undisturbed
    rerouted = metric(server, "deepwell_rerouted_requests_total")
    disturbed = asyncio.run(run_streams(server, count, kill_after=count // 4))
    assert disturbed == undisturbed
    assert metric(server, "deepwell_rerouted_requests_total") > rerouted
    if rejoin:
        # The killed worker is restarted and rejoins.
        wait_for_workers(server, 2)


def wait_for_workers(server, count: int) -> None:
    deadline = time.monotonic() + 600
    while metric(server, "deepwell_worker_up") < count:
        assert time.monotonic() < deadline, "the killed worker did not rejoin"
        time.sleep(0.5)


def test_requests_are_routed_over_both_workers(cluster):
    asyncio.run(run_streams(cluster, 4))
    for worker in ("0", "1"):
        assert metric(cluster, "deepwell_routed_requests_total", worker=worker, role="mixed") >= 1
    assert metric(cluster, "deepwell_worker_up") == 2


def test_sigkill_mid_stream_loses_no_request_and_changes_no_text(cluster):
    failover(cluster, 8, rejoin=True)


@pytest.mark.slow
def test_sigkill_with_64_streams_through_both_sdks(cluster):
    failover(cluster, 64, rejoin=False)


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    args = (*MODEL_ARGS, "--batch-invariant", "--heartbeat-timeout", "10")
    args += ("--kv-store", str(root / "kv"))
    server = start_server(root, *args, "--prefill-workers", "1", "--decode-workers", "1")
    yield server
    assert server.stop() == 0


def greedy(server, index: int) -> str:
    # Past one 128-token block, so the prompt's KV has a full block to pass through the store.
    story = " ".join(f"Step {n}: the traveller walked on." for n in range(40))
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": f"{story} Summarise story {index}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def test_pd_gives_the_greedy_tokens_of_one_worker(cluster, pd_cluster):
    for index in range(3):
        assert greedy(pd_cluster, index) == greedy(cluster, index)
    assert metric(pd_cluster, "deepwell_pd_handoffs_total") == 3
    for role in ("prefill", "decode"):
        count = metric(pd_cluster, "deepwell_worker_time_to_first_token_seconds_count", role=role)
        assert count == 3
    assert metric(pd_cluster, "deepwell_worker_inter_token_latency_seconds_count", role="decode")
    assert metric(pd_cluster, "deepwell_kv_store_written_bytes_total") > 0


def start_joining_worker(cluster, tmp_path, *args: str) -> subprocess.Popen:
    command = [DEEPWELL, "worker", "--connect", cluster.join_address, *MODEL_ARGS, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (tmp_path / f"worker-{len(list(tmp_path.iterdir()))}.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def joined_workers(cluster) -> list[dict]:
    workers = httpx.get(f"{cluster.base_url}/admin/workers").json()["workers"]
    return [w for w in workers if w["worker_id"] > 1]


# Two more SmolLM2 workers start and join: minutes on a 2-core machine.
@pytest.mark.slow
def test_a_worker_joins_over_tcp_and_a_foreign_one_is_refused(cluster, tmp_path):
    wait_for_workers(cluster, 2)
    good = start_joining_worker(cluster, tmp_path, "--threads", "1")
    # The block size is part of the fingerprint: the KV this worker writes is not the cluster's.
    foreign = start_joining_worker(cluster, tmp_path, "--threads", "1", "--block-size", "64")
    try:
        assert foreign.wait(600) == 1
        refusal = (tmp_path / "worker-1.log").read_text()
        assert "deepwell worker: the front end refused this worker: refused: it serves" in refusal
        wait_for_workers(cluster, 3)
        (joined,) = [w for w in joined_workers(cluster) if w["live"]]
        assert asyncio.run(run_streams(cluster, 6))
        routed = metric(cluster, "deepwell_routed_requests_total", worker=str(joined["worker_id"]))
        assert routed >= 1
    finally:
        good.kill()
        good.wait()
    # Gone without a word: its silence removes it.
    deadline = time.monotonic() + 60
    while any(w["live"] for w in joined_workers(cluster)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    silent, refused = sorted(w["failure"].split(":")[0] for w in joined_workers(cluster))
    assert silent.startswith("no heartbeat for") and refused == "refused"


def test_drain_command_removes_a_worker_but_never_the_last(cluster):
    def drain(worker: str) -> subprocess.CompletedProcess:
        command = [DEEPWELL, "drain", worker, "--url", cluster.base_url]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)

    wait_for_workers(cluster, 2)
    drained = drain("1")
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.startswith("worker 1 drained: 0 requests finished on it, 0 moved")
    workers = httpx.get(f"{cluster.base_url}/admin/workers").json()["workers"]
    assert [(w["worker_id"], w["live"], w["failure"]) for w in workers[:2]] == [
        (0, True, None),
        (1, False, "drained"),
    ]
    refused = drain("0")
    assert refused.returncode == 1
    assert "would leave the others at inf% utilisation, above the limit of 80%" in refused.stderr
    # The drained worker is not restarted; requests go on on the other.
    time.sleep(1)
    assert metric(cluster, "deepwell_worker_up") == 1
    assert asyncio.run(run_streams(cluster, 2))


def test_an_unusable_store_directory_stops_serve_with_a_clear_error(tmp_path):
    not_a_directory = tmp_path / "kv"
    not_a_directory.write_text("a file, not a directory")
    port = free_port()
    command = [DEEPWELL, "serve", "--port", str(port), *MODEL_ARGS, "--workers", "2"]
    command += ["--kv-store", str(not_a_directory)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 1
    assert "engine worker failed to start: FileExistsError" in done.stderr
