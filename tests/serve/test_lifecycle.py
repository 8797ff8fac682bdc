"""Process lifecycle of `deepwell serve`: clean shutdown on signals, a worker that dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from servers import MODEL_ARGS, children_of, is_running, start_server


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


def test_a_dead_worker_turns_health_and_requests_into_503s(tmp_path):
    server = start_server(tmp_path, *MODEL_ARGS)
    model = server.model
    (worker,) = children_of(server.process.pid)
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    response = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "overloaded_error"
    assert server.stop() == 0
    assert not is_running(worker)
