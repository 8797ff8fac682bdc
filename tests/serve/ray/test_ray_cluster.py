"""`deepwell serve --cluster ray=ADDRESS` on a two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`): workers as actors on both nodes and requests routed over
them; an actor SIGKILLed mid-stream (the text of an undisturbed seeded run, no error,
through the openai SDK) and restarted by Ray; an expert-parallel group of two ranks on two
nodes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
import ray
from ray.cluster_utils import Cluster
from servers import (
    DEEPWELL,
    MODEL_ARGS,
    REPO,
    V41_ARGS,
    is_running,
    start_server,
    write_v41_checkpoint,
)

from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG, write_tiny_checkpoint

# One CPU a node, so that a worker's bundle fills a node and two workers span both.
NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
# Batch invariance makes a continuation's prefill give the logits its decode steps would
# have: a seeded stream moved off a killed worker keeps its text.
RAY_ARGS = (
    *MODEL_ARGS,
    *("--threads", "1", "--batch-invariant", "--heartbeat-timeout", "10"),
    *("--ray-placement", "STRICT_SPREAD"),
)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    assert not _processes("raylet"), "a raylet outlived the cluster"


def _processes(name: str) -> list[int]:
    """Processes of this machine whose command line contains `name`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                text = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if name in text and is_running(int(entry)):
            found.append(int(entry))
    return found


def worker_actors() -> list[int]:
    """The engine workers' actor processes (Ray titles them by class and method)."""
    return _processes("ray::EngineWorkerActor")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def metric(server, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def serve_on_ray(tmp_path, cluster: Cluster, *args: str):
    return start_server(tmp_path, "--cluster", f"ray={cluster.address}", *args)


async def seeded_streams(server, count: int, kill_after: int | None = None) -> list[str]:
    """`count` seeded streams at once; with `kill_after`, SIGKILL one worker's actor once
    that many have produced text."""
    progress: set[int] = set()
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    model = server.model

    async def stream(index: int) -> str:
        chunks = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell me one fact about the number {index}."}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=1000 + index,
            stream=True,
        )
        parts = []
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                progress.add(index)
        return "".join(parts)

    tasks = [asyncio.create_task(stream(i)) for i in range(count)]
    if kill_after is not None:
        while len(progress) < kill_after:
            assert not all(t.done() for t in tasks), "every stream ended before the kill"
            await asyncio.sleep(0.01)
        os.kill(worker_actors()[0], signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    await client.close()
    return results


def wait_for_workers(server, count: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "deepwell_worker_up") < count:
        assert time.monotonic() < deadline, "the killed worker did not rejoin"
        time.sleep(0.5)


def stop(server) -> None:
    """Stop the server; its actors end with it."""
    assert server.stop() == 0
    deadline = time.monotonic() + 30
    while worker_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not worker_actors(), "an engine worker's actor outlived its serve"


def on_two_nodes() -> bool:
    """Whether the engine workers are two actors started by two nodes' raylets."""
    actors = worker_actors()
    return len(actors) == 2 and len({parent_of(pid) for pid in actors}) == 2


def test_workers_are_actors_on_both_nodes_and_requests_go_to_both(ray_cluster, tmp_path):
    checkpoint = write_v41_checkpoint(tmp_path)
    server = serve_on_ray(
        tmp_path, ray_cluster, "--model", str(checkpoint), *V41_ARGS, "--workers", "2"
    )
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    try:
        assert on_two_nodes()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: complete(client, server.model, i), range(4)))
        assert all(replies)
        for worker in ("0", "1"):
            assert metric(server, "deepwell_routed_requests_total", worker=worker) >= 1
        assert "Ray actor on node" in server.output()
    finally:
        stop(server)


def complete(client: openai.OpenAI, model: str, index: int) -> str:
    reply = client.completions.create(model=model, prompt=f"hello {index}", max_tokens=4)
    return reply.choices[0].text


@pytest.mark.slow
def test_a_sigkilled_actor_mid_stream_changes_no_text_and_is_restarted(ray_cluster, tmp_path):
    server = serve_on_ray(tmp_path, ray_cluster, *RAY_ARGS, "--workers", "2")
    try:
        undisturbed = asyncio.run(seeded_streams(server, 8))
        assert all(undisturbed), undisturbed
        rerouted = metric(server, "deepwell_rerouted_requests_total")
        disturbed = asyncio.run(seeded_streams(server, 8, kill_after=2))
        assert disturbed == undisturbed
        assert metric(server, "deepwell_rerouted_requests_total") > rerouted
        # Ray restarts the actor on its node; it loads the model again and rejoins.
        wait_for_workers(server, 2)
        assert "restarting engine worker(s)" in server.output()
        assert on_two_nodes()
    finally:
        stop(server)


@pytest.mark.slow
def test_an_expert_parallel_group_of_two_ranks_on_two_nodes(ray_cluster, tmp_path):
    model = write_tiny_checkpoint(
        tmp_path / "v41", seed=0, text_config=TINY_TEXT_CONFIG | dict(n_routed_experts=16)
    ).path
    server = serve_on_ray(
        tmp_path,
        ray_cluster,
        *("--model", str(model), "--data-parallel-size", "2", "--expert-parallel"),
        *("--batch-invariant", "--dtype", "float32", "--threads", "1", "--memory-gib", "0.5"),
        *("--max-model-len", "512", "--num-speculative-tokens", "0"),
        *("--ray-placement", "STRICT_SPREAD"),
    )
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    try:
        assert on_two_nodes()
        # Requests spread over both ranks, whose steps meet in every MoE layer's all-to-all.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: complete(client, server.model, i), range(4)))
        assert all(replies)
        for worker in ("0", "1"):
            assert metric(server, "deepwell_routed_requests_total", worker=worker) >= 1
    finally:
        stop(server)


def test_ranks_over_machines_are_placed_by_ray_not_given_by_node(tmp_path):
    command = [DEEPWELL, "serve", "--cluster", "ray", "--data-parallel-size", "2", "--nnodes", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "give --data-parallel-size alone, not --nnodes" in done.stderr + done.stdout
