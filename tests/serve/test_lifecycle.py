"""Process lifecycle of `deepwell serve`: clean shutdown on signals, a worker that dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from servers import (
    DEEPWELL,
    MODEL_ARGS,
    MODEL_LOAD_TIMEOUT_S,
    REPO,
    Server,
    children_of,
    free_port,
    is_running,
    processes_carrying,
    start_server,
)

from deepwell.engine.layers.kernel_build_lock import LOCK_NAME, TORCH_LOCK_NAME
from deepwell.serve.worker_processes import WORKER_EXIT_TIMEOUT_S


def test_sigint_stops_a_mock_server(tmp_path):
    server = start_server(tmp_path, "--mock")
    assert "curl http://127.0.0.1:" in server.output()
    assert server.stop(signal.SIGINT) == 0


def test_sigterm_lets_an_in_flight_stream_finish(tmp_path):
    # A grace far above the stream's length: on a loaded box eight tokens can take over
    # the default 10 s, and this test is about finishing, not about the grace's length.
    server = start_server(tmp_path, *MODEL_ARGS, "--shutdown-timeout", "120")
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 8,
        "stream": True,
    }
    lines: list[str] = []
    first_frame = threading.Event()

    def stream() -> None:
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(line)
                first_frame.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_frame.wait(120)
    assert server.stop(signal.SIGTERM) == 0
    reader.join(60)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


def _stream_lines(url: str, body: dict, lines: list[str], opened: threading.Event) -> None:
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        assert response.status_code == 200
        opened.set()
        for line in response.iter_lines():
            lines.append(line)


def _last_event(lines: list[str]) -> str:
    """The last frame of an SSE stream: its `event:` name, else its `data:` text."""
    frames = [line for line in lines if line]
    last = frames[-1]
    if last.startswith("data: ") and len(frames) > 1 and frames[-2].startswith("event: "):
        return frames[-2].removeprefix("event: ")
    return last.removeprefix("data: ")


def test_ready_is_503_until_the_worker_is_up_and_503_again_once_it_dies(tmp_path):
    # One server for both ends of the worker's life: a model load is most of each test here.
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [DEEPWELL, "serve", "--port", str(port), *MODEL_ARGS],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    server = Server(process, f"http://127.0.0.1:{port}", log)
    base = server.base_url
    try:
        statuses = []
        deadline = time.monotonic() + MODEL_LOAD_TIMEOUT_S
        while not statuses or statuses[-1] != 200:
            assert time.monotonic() < deadline, log.read_text()
            assert process.poll() is None, log.read_text()
            try:
                statuses.append(httpx.get(f"{base}/ready", timeout=5).status_code)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if statuses[-1] == 503 and len(statuses) == 1:
                # While the model loads: alive, not ready, and requests are refused in
                # their dialect's shape with a time to retry.
                assert httpx.get(f"{base}/health", timeout=5).status_code == 200
                refused = httpx.post(f"{base}/v1/messages", json={}, timeout=5)
                assert refused.status_code == 503
                assert refused.json()["error"]["type"] == "overloaded_error"
                assert refused.headers["retry-after"]
            time.sleep(0.1)
        # The server listens well before its model is up: the first answer is "not ready".
        assert statuses[0] == 503
        assert set(statuses) == {503, 200}

        # A dead worker turns health and requests into 503s.
        model = server.model
        (worker,) = children_of(process.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The refusal can take the front end a few seconds on a loaded machine: past httpx's
        # default 5 s timeout.
        response = httpx.post(
            f"{base}/v1/messages",
            json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=30,
        )
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "overloaded_error"
    finally:
        assert server.stop() == 0
    assert not is_running(worker)


@contextlib.contextmanager
def server_compiling(tmp_path):
    """A server whose worker compiles its C++ kernels as it loads (an empty kernel cache), so
    never reads its inbox (and so its Shutdown) until the model is up: yields the server's
    process and the environment variable every process it starts carries, once a compiler
    runs; kills whatever is left on the way out."""
    cache = tmp_path / "kernels"
    marker = f"TORCH_EXTENSIONS_DIR={cache}"
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [DEEPWELL, "serve", "--port", str(free_port()), *MODEL_ARGS],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(cache)},
        )
    try:
        deadline = time.monotonic() + MODEL_LOAD_TIMEOUT_S
        while "cc1plus" not in processes_carrying(marker).values():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield process, marker
    finally:
        process.kill()
        for pid in processes_carrying(marker):
            os.kill(pid, signal.SIGKILL)


def assert_build_cut_short(tmp_path):
    """No kernel in the cache, and no lock for the next start to wait on or take over."""
    cache = tmp_path / "kernels"
    assert not list(cache.glob("*/*.so"))
    assert not list(cache.glob(f"*/{LOCK_NAME}"))
    assert not list(cache.glob(f"*/{TORCH_LOCK_NAME}"))


# SIGHUP: a closed terminal's, which reaches the server alone.
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_a_stop_signal_while_the_worker_compiles_ends_it_and_its_compiler_at_once(
    tmp_path, stop_signal
):
    if signal.getsignal(stop_signal) is signal.SIG_IGN:
        pytest.skip("this run ignores SIGHUP (nohup), and so would the server it starts")
    with server_compiling(tmp_path) as (process, marker):
        signalled = time.monotonic()
        process.send_signal(stop_signal)
        code = process.wait(60)
        stopped_in = time.monotonic() - signalled
        left = processes_carrying(marker)
    log = (tmp_path / "serve.log").read_text()
    assert code == 0, log
    assert stopped_in < WORKER_EXIT_TIMEOUT_S / 2, log
    assert not left, f"processes left behind: {left}"
    assert_build_cut_short(tmp_path)


def test_a_server_killed_while_its_worker_compiles_takes_the_worker_and_compiler_with_it(
    tmp_path,
):
    """SIGKILL leaves the server no say: Linux's parent-death signal ends the worker, which
    ends its build."""
    with server_compiling(tmp_path) as (process, marker):
        process.kill()
        process.wait(60)
        deadline = time.monotonic() + WORKER_EXIT_TIMEOUT_S / 2
        while processes_carrying(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = processes_carrying(marker)
    assert not left, f"processes left behind: {left}"
    assert_build_cut_short(tmp_path)


def test_sigterm_during_sixteen_streams_drains_them_and_exits_clean(tmp_path):
    timeout = 5
    server = start_server(tmp_path, *MODEL_ARGS, "--shutdown-timeout", str(timeout))
    model = server.model
    streams = []
    for index in range(16):
        messages = [{"role": "user", "content": f"Count from {index} to a thousand."}]
        if index % 2:
            path, body = "/v1/messages", {"messages": messages, "max_tokens": 400}
        else:
            path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 400}
        lines: list[str] = []
        opened = threading.Event()
        body = {**body, "model": model, "stream": True}
        reader = threading.Thread(
            target=_stream_lines, args=(f"{server.base_url}{path}", body, lines, opened)
        )
        reader.start()
        streams.append((path, lines, opened, reader))
    for _, _, opened, _ in streams:
        assert opened.wait(120)
    workers = children_of(server.process.pid)
    signalled = time.monotonic()
    # One signal only: a second would cut the drain short.
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "service_unavailable"
    assert int(refused.headers["retry-after"]) >= 1
    assert httpx.get(f"{server.base_url}/ready", timeout=30).status_code == 503
    assert server.process.wait(90) == 0
    # The drain, then bounded waits: error events sent (5 s), blocks reported free (15 s),
    # the worker's exit (10 s). A loaded 2-core machine can need them all: one engine step
    # of 16 prompts there has taken over 10 s, and an abort lands between steps.
    assert time.monotonic() - signalled < timeout + 40
    time.sleep(1)
    assert not [pid for pid in workers if is_running(pid)]
    for path, lines, _, reader in streams:
        reader.join(30)
        assert not reader.is_alive()
        last = _last_event(lines)
        if path == "/v1/messages":
            assert last in ("message_stop", "error"), lines[-6:]
        else:
            assert last == "[DONE]" or '"error"' in last, lines[-6:]
    # The worker handles the front end's aborts before its Shutdown: this is its own count.
    assert "engine worker 0 stopped: 0 requests unfinished, KV blocks held: 0" in server.output()


def test_sigint_ends_a_messages_stream_with_its_final_event_and_no_traceback(tmp_path):
    server = start_server(tmp_path, *MODEL_ARGS, "--shutdown-timeout", "120")
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 8,
        "stream": True,
    }
    lines: list[str] = []
    opened = threading.Event()
    url = f"{server.base_url}/v1/messages"
    reader = threading.Thread(target=_stream_lines, args=(url, body, lines, opened))
    reader.start()
    assert opened.wait(120)
    assert server.stop(signal.SIGINT) == 0
    reader.join(60)
    assert _last_event(lines) == "message_stop"
    log = server.output()
    assert "Traceback" not in log
    assert "CancelledError" not in log
