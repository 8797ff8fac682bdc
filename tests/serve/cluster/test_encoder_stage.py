"""`deepwell serve --encoder-workers N` on a tiny DeepSeek-V4.1 with a vision tower: images go
to an encoder worker, then the prompt to a prefill worker, then decoding to a decode worker,
with the greedy tokens of one whole worker; an encoder worker SIGKILLed with requests queued
on it is replaced, and its requests are rerouted and answered unchanged.

Float32 and the non-thinking mode (greedy), as in tests/serve/images/test_vision_model_sdks.py.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image
from servers import V41_ARGS, children_of, start_server, write_v41_checkpoint
from test_cluster_server import metric

from deepwell.serve.messages import decode_message

# Two servers of a V4.1 checkpoint, one with four workers: minutes on a shared CPU.
pytestmark = pytest.mark.slow

MAX_TOKENS = 6
SPLIT_ARGS = ("--encoder-workers", "2", "--prefill-workers", "1", "--decode-workers", "1")
# On a shared 2-core machine a busy worker's heartbeat thread can stall past 1 s.
ARGS = (*V41_ARGS, "--dtype", "float32", "--heartbeat-timeout", "10")


def picture(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41-vision"), vision=True)


@pytest.fixture(scope="module")
def whole(checkpoint):
    server = start_server(checkpoint.parent, "--model", str(checkpoint), *ARGS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def split(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("epd")
    store = ("--kv-store", str(root / "kv"))
    server = start_server(root, "--model", str(checkpoint), *ARGS, *SPLIT_ARGS, *store)
    yield server
    assert server.stop() == 0


def greedy_tokens(server, seed: int) -> list[int]:
    image = "data:image/png;base64," + base64.b64encode(picture(seed)).decode()
    body = {
        "model": server.model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def encoder_pids(server) -> list[int]:
    """The server's encoder worker processes, by the role in their command line's config."""
    pids = []
    for pid in children_of(server.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        if b"deepwell.serve.worker" in argv:
            config = decode_message(
                bytes.fromhex(argv[argv.index(b"deepwell.serve.worker") + 1].decode())
            )
            if config.role == "encoder":
                pids.append(pid)
    return pids


def in_flight(server, worker_id: int) -> int:
    workers = httpx.get(f"{server.base_url}/admin/workers").json()["workers"]
    return next(w["in_flight"] for w in workers if w["worker_id"] == worker_id)


def test_encoder_then_prefill_then_decode_give_one_workers_greedy_tokens(whole, split):
    for seed in (1, 2):
        assert greedy_tokens(split, seed) == greedy_tokens(whole, seed)
    assert metric(split, "deepwell_routed_requests_total", role="encoder") == 2
    assert metric(split, "deepwell_pd_handoffs_total") == 2


def test_a_sigkilled_encoder_worker_is_replaced_and_its_requests_rerouted(whole, split):
    seeds = range(10, 14)
    expected = [greedy_tokens(whole, seed) for seed in seeds]
    rerouted = metric(split, "deepwell_rerouted_requests_total")
    # Frozen first, so requests queue on it; killed once they have.
    victim = encoder_pids(split)[0]
    os.kill(victim, signal.SIGSTOP)
    # Workers 0 and 1 are prefill and decode; the encoders follow in start order.
    frozen_id = 2 if victim == min(encoder_pids(split)) else 3
    with ThreadPoolExecutor(len(seeds)) as pool:
        answers = [pool.submit(greedy_tokens, split, seed) for seed in seeds]
        deadline = time.monotonic() + 60
        while in_flight(split, frozen_id) == 0:
            assert time.monotonic() < deadline, "no request reached the frozen encoder"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        assert [answer.result(timeout=300) for answer in answers] == expected
    assert metric(split, "deepwell_rerouted_requests_total") > rerouted
    deadline = time.monotonic() + 300
    while metric(split, "deepwell_worker_up") < 4:
        assert time.monotonic() < deadline, "the killed encoder worker did not rejoin"
        time.sleep(0.5)
    assert victim not in encoder_pids(split)
    assert greedy_tokens(split, 1) == greedy_tokens(whole, 1)
