"""Stored Responses through the official openai SDK: `store`, `previous_response_id`,
retrieve, input items, delete, background with polling and cancel; on a real server with
the embedded model (across a restart), and in-process on the mock for the protocol."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import MODEL_ARGS, start_server

from deepwell.serve.api import create_app
from deepwell.serve.responses_store import ResponseStore, StoredResponse
from deepwell.serve.settings import ServeSettings
from tests.serve.test_errors import MODEL, sdk_clients

GREEDY = {"temperature": 0, "max_output_tokens": 12}
REPO = Path(__file__).resolve().parents[2]


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_a_continued_turn_reads_the_whole_history_across_a_restart(tmp_path):
    store = f"sqlite:///{tmp_path / 'responses.sqlite3'}"
    first_server = start_server(tmp_path, *MODEL_ARGS, "--responses-store", store)
    try:
        client = sdk(first_server)
        first = client.responses.create(
            model=first_server.model, input="Name a colour.", store=True, **GREEDY
        )
        assert first.store is True
    finally:
        assert first_server.stop() == 0

    server = start_server(tmp_path, *MODEL_ARGS, "--responses-store", store)
    try:
        client = sdk(server)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(
            model=server.model,
            input="Name another.",
            previous_response_id=first.id,
            store=True,
            **GREEDY,
        )
        history = [
            {"role": "user", "content": "Name a colour."},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "Name another."},
        ]
        whole = client.responses.create(model=server.model, input=history, **GREEDY)
        assert second.previous_response_id == first.id
        assert second.output_text == whole.output_text
        assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens

        items = client.responses.input_items.list(second.id, order="asc")
        assert [item.type for item in items.data] == ["message", "message", "message"]
        assert items.data[-1].content[0].text == "Name another."

        # Background: answered at once, polled to its end; a long one cancelled.
        started = client.responses.create(
            model=server.model, input="Count to five.", store=True, background=True, **GREEDY
        )
        assert started.background is True and started.status in ("queued", "in_progress")
        deadline = time.monotonic() + 120
        polled = client.responses.retrieve(started.id)
        while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.2)
            polled = client.responses.retrieve(started.id)
        # Its 12-token budget may end it before the count does (incomplete): either way, done.
        assert polled.status in ("completed", "incomplete") and polled.output_text
        long = client.responses.create(
            model=server.model,
            input="Write a long story.",
            store=True,
            background=True,
            temperature=0,
            max_output_tokens=4000,
        )
        assert client.responses.cancel(long.id).status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"

        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        # The later turn kept its own copy of the history.
        third = client.responses.create(
            model=server.model, input="And one more.", previous_response_id=second.id, **GREEDY
        )
        assert third.output_text
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert "deepwell_kv_blocks_used 0.0" in metrics or "kv_blocks_used" in metrics
    finally:
        assert server.stop() == 0


def in_process(**settings):
    openai_client, _ = sdk_clients(create_app(settings=ServeSettings(**settings)))
    return openai_client


def test_a_bogus_or_unstored_id_is_a_404_in_openais_shape():
    client = in_process()

    async def run():
        unstored = await client.responses.create(model=MODEL, input="Hi")
        errors = []
        for call in (
            lambda: client.responses.retrieve("resp_nope"),
            lambda: client.responses.retrieve(unstored.id),
            lambda: client.responses.delete("resp_nope"),
            lambda: client.responses.input_items.list("resp_nope"),
            lambda: client.responses.create(
                model=MODEL, input="Hi", previous_response_id="resp_nope"
            ),
        ):
            with pytest.raises(openai.NotFoundError) as missing:
                await call()
            errors.append(missing.value)
        return unstored, errors

    unstored, errors = asyncio.run(run())
    assert unstored.store is False
    for error in errors:
        assert error.body["code"] == "response_not_found"
    assert errors[-1].body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "store"),
        ({"background": True, "store": True, "stream": True}, "stream"),
        ({"previous_response_id": 7}, "previous_response_id"),
    ],
)
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(fields, param):
    client = in_process()

    async def run():
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="Hi", extra_body=fields)
        return refused.value

    assert asyncio.run(run()).body["param"] == param


def test_a_continued_turn_renders_as_the_whole_history_does():
    transport = httpx.ASGITransport(app=create_app())

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = await client.post(
                "/v1/responses",
                json={"model": MODEL, "input": "Hi", "instructions": "Be brief.", "store": True},
            )
            first = first.json()
            chained = {"model": MODEL, "input": "Again", "previous_response_id": first["id"]}
            history = [
                {"role": "user", "content": "Hi"},
                *first["output"],
                {"role": "user", "content": "Again"},
            ]
            whole = {"model": MODEL, "input": history}
            second = await client.post("/v1/responses", json={**chained, "store": True})
            items = await client.get(f"/v1/responses/{second.json()['id']}/input_items")
            renders = [(await client.post("/v1/render", json=b)).json() for b in (chained, whole)]
            return first, second.json(), items.json(), renders

    first, second, items, (chained, whole) = asyncio.run(run())
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    assert chained["prompt"] == whole["prompt"] and "Hello world!" in whole["prompt"]
    assert chained["segments"] == whole["segments"]
    # Instructions are not carried over (OpenAI's rule): the history is items only.
    assert "Be brief." not in json.dumps(items)
    assert [item["id"][:4] for item in items["data"]] == ["msg_"] * 3
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Again"}]  # newest first


def test_the_store_forgets_after_its_ttl_and_keeps_at_most_its_bound(tmp_path):
    store = ResponseStore(f"sqlite:///{tmp_path / 'r.sqlite3'}", ttl_seconds=60, max_responses=3)
    now = time.time()
    for index in range(5):
        store.put(StoredResponse(f"r{index}", now + index, "completed", "{}", []))
    assert len(store) == 3
    assert store.get("r0") is None and store.get("r4") is not None
    store.put(StoredResponse("old", now - 120, "completed", "{}", []))
    assert store.get("old") is None
    # A second connection (another server process) sees the same rows.
    other = ResponseStore(f"sqlite:///{tmp_path / 'r.sqlite3'}", ttl_seconds=60, max_responses=3)
    assert other.get("r4") is not None
    store.close()
    other.close()


def test_a_background_turn_whose_process_died_reads_as_failed(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.sqlite3'}"
    # Another server process stores a running background turn, then is gone (killed, say).
    writer = (
        "import sys, time\n"
        "from deepwell.serve.responses_store import ResponseStore, StoredResponse\n"
        "store = ResponseStore(sys.argv[1], 60, 10)\n"
        "store.put(StoredResponse('bg', time.time(), 'in_progress',"
        ' \'{"status":"in_progress","output":[]}\', []))\n'
    )
    subprocess.run([sys.executable, "-c", writer, url], check=True, cwd=REPO)
    store = ResponseStore(url, ttl_seconds=60, max_responses=10)
    mine = StoredResponse("mine", time.time(), "in_progress", '{"status":"in_progress"}', [])
    store.put(mine)
    gone = store.get("bg")
    assert gone.status == "failed"
    assert json.loads(gone.response)["error"]["code"] == "server_error"
    assert store.get("bg").status == "failed"  # kept so
    assert store.get("mine").status == "in_progress"  # this process still runs it
    store.close()


def test_a_file_from_before_rows_named_their_process_still_opens(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE responses (id TEXT PRIMARY KEY, created REAL NOT NULL, "
            "status TEXT NOT NULL, response TEXT NOT NULL, input_items TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO responses VALUES ('old', ?, 'completed', '{}', '[]')", (time.time(),)
        )
    store = ResponseStore(f"sqlite:///{path}", ttl_seconds=60, max_responses=10)
    assert store.get("old").status == "completed"
    store.put(StoredResponse("new", time.time(), "completed", "{}", []))
    assert len(store) == 2
    store.close()
