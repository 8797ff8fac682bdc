"""The request log: one line per request, under the id the client sees as `x-request-id`,
whatever became of the request; no prompt text or key unless asked."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest
from servers import start_server

SECRET_PROMPT = "the-prompt-nobody-may-log"


def _lines_with(server, request_id: str, wait: float = 30) -> list[str]:
    """The log lines naming `request_id`, once there is one (a stream logs when it ends)."""
    deadline = time.monotonic() + wait
    pattern = re.compile(rf"request_id={re.escape(request_id)}(\s|$)")
    while True:
        lines = [line for line in server.output().splitlines() if pattern.search(line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def _new_id(kind: str) -> str:
    return f"test-{kind}-{uuid.uuid4().hex[:8]}"


def test_every_request_leaves_one_line_with_its_id(model_server):
    base, model = model_server.base_url, model_server.model
    messages = [{"role": "user", "content": SECRET_PROMPT}]
    ids = {kind: _new_id(kind) for kind in ("ok", "bad", "streamed", "left")}

    answer = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 4},
        headers={"x-request-id": ids["ok"]},
        timeout=120,
    )
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == ids["ok"]

    bad = httpx.post(
        f"{base}/v1/chat/completions",
        content=b"{not json",
        headers={"x-request-id": ids["bad"], "content-type": "application/json"},
    )
    assert bad.status_code == 400
    assert bad.headers["x-request-id"] == ids["bad"]

    body = {"model": model, "messages": messages, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST",
        f"{base}/v1/messages",
        json=body,
        headers={"x-request-id": ids["streamed"]},
        timeout=120,
    ) as streamed:
        assert streamed.headers["x-request-id"] == ids["streamed"]
        assert any(line == "event: message_stop" for line in streamed.iter_lines())

    body = {**body, "max_tokens": 512}
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json=body,
        headers={"x-request-id": ids["left"]},
        timeout=120,
    ) as left:
        for line in left.iter_lines():
            if line.startswith("data: "):
                break  # the client leaves after its first frame

    lines = {kind: _lines_with(model_server, request_id) for kind, request_id in ids.items()}
    assert all(len(found) == 1 for found in lines.values()), lines
    ok = _fields(lines["ok"][0])
    assert ok["dialect"] == "chat" and ok["model"] == model and ok["outcome"] == "completed"
    assert "POST /v1/chat/completions 200" in lines["ok"][0]
    assert int(ok["prompt_tokens"]) > 0 and int(ok["output_tokens"]) > 0
    assert {"cached_tokens", "ttft_s", "latency_s", "worker"} <= set(ok)
    assert "POST /v1/chat/completions 400" in lines["bad"][0]
    streamed = _fields(lines["streamed"][0])
    assert streamed["dialect"] == "messages" and streamed["outcome"] == "completed"
    assert _fields(lines["left"][0])["outcome"] == "aborted"
    assert SECRET_PROMPT not in model_server.output()


def test_a_request_without_an_id_gets_one_and_a_forged_one_is_replaced(model_server):
    plain = httpx.get(f"{model_server.base_url}/v1/models")
    assert re.fullmatch(r"req_[0-9a-f]{32}", plain.headers["x-request-id"])
    assert len(_lines_with(model_server, plain.headers["x-request-id"])) == 1
    forged = httpx.get(
        f"{model_server.base_url}/v1/models", headers={"x-request-id": "a b status=200"}
    )
    assert forged.headers["x-request-id"].startswith("req_")


@pytest.fixture(scope="module")
def json_log_server(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("json-log"),
        "--mock",
        "--log-format",
        "json",
        "--log-prompts",
        "--api-key",
        "key-that-stays-secret",
    )
    yield server
    assert server.stop() == 0


def test_json_lines_carry_the_fields_and_the_prompt_only_when_asked(json_log_server):
    base = json_log_server.base_url
    auth = {"Authorization": "Bearer key-that-stays-secret"}
    ok_id, refused_id = _new_id("ok"), _new_id("refused")
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
    }
    answer = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={**auth, "x-request-id": ok_id}
    )
    assert answer.status_code == 200
    refused = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"x-request-id": refused_id}
    )
    assert refused.status_code == 401
    deadline = time.monotonic() + 10
    while True:
        records = [json.loads(line) for line in json_log_server.output().splitlines() if line]
        by_id = {record.get("request_id"): record for record in records}
        if {ok_id, refused_id} <= set(by_id) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    ok, refused_line = by_id[ok_id], by_id[refused_id]
    assert ok["status"] == 200 and ok["dialect"] == "chat" and ok["outcome"] == "completed"
    assert ok["logger"] == "deepwell.serve.requests" and ok["level"] == "INFO"
    assert ok["prompt"]["messages"][0]["content"] == SECRET_PROMPT
    assert refused_line["status"] == 401
    assert "key-that-stays-secret" not in json_log_server.output()
