"""What a Responses request asks of the store: continue a stored conversation
(`previous_response_id`), keep its answer (`store: true`), run in the background
(`background: true`); and the answers stamped with that state.

A continued conversation is rebuilt as the whole history sent in one request would be: the
stored turns' input items, each followed by its output items, then the new input. The recipe
then converts it exactly as it converts that request, so both give the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deepwell.recipe.dialects.json_text import parse_json_text
from deepwell.serve.errors import ApiError
from deepwell.serve.responses_store import RUNNING, ResponseStore, StoredResponse

# The lifecycle events whose `response` is the object a stored response keeps.
_FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n")
# The body fields this module reads; a body without any of them is an ordinary turn.
_STATE_FIELDS = (
    b'"store"',
    b'"background"',
    b'"previous_response_id"',
    b'"conversation"',
    b'"truncation"',
)


@dataclass
class ResponsesTurn:
    """One Responses request as the store sees it; `body` is what the recipe converts."""

    body: bytes
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    # The conversation's items up to this turn's output, kept for the next turn.
    input_items: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stateful(self) -> bool:
        return self.store or self.previous_response_id is not None

    def stamp(self, text: str) -> str:
        """The response object (or an event carrying it) with the fields the recipe echoes
        as stateless set to this turn's state.

        The recipe writes each top-level field once, in a fixed order, and every string
        value JSON-escaped, so the first raw `"store":false,` is the object's own field.
        """
        if self.store:
            text = text.replace('"store":false,', '"store":true,', 1)
        if self.background:
            text = text.replace('"background":false,', '"background":true,', 1)
        if self.previous_response_id is not None:
            previous = json.dumps(self.previous_response_id)
            text = text.replace(
                '"previous_response_id":null,', f'"previous_response_id":{previous},', 1
            )
        return text


def read_turn(body: bytes, store: ResponseStore) -> ResponsesTurn:
    """The turn a Responses body asks for, its previous turns prepended to its input.

    A body that is not a JSON object is left to the recipe, which refuses it in its words.
    """
    # Most turns are stateless: the recipe parses their body anyway, so no parse here.
    if not any(field in body for field in _STATE_FIELDS):
        return ResponsesTurn(body)
    try:
        data = parse_json_text(body)
    except ValueError:
        return ResponsesTurn(body)
    if not isinstance(data, dict):
        return ResponsesTurn(body)
    _refuse_what_cannot_be_honoured(data)
    turn = ResponsesTurn(
        body,
        store=data.get("store") is True,
        background=data.get("background") is True,
        previous_response_id=_previous_id(data),
    )
    if turn.background and not turn.store:
        raise ApiError(400, "background responses must be stored: send store: true", param="store")
    if turn.background and data.get("stream") is True:
        raise ApiError(
            400,
            "a background response is not streamed here: send stream: false and poll "
            "GET /v1/responses/{id}",
            param="stream",
        )
    items = _input_items(data.get("input"))
    if turn.previous_response_id is not None:
        previous = stored_or_404(store, turn.previous_response_id, "previous_response_id")
        if previous.status in RUNNING:
            raise ApiError(
                400,
                f"Previous response '{previous.id}' is still {previous.status}; wait for it "
                "to finish (GET /v1/responses/{id}) before continuing it.",
                param="previous_response_id",
            )
        items = [*previous.input_items, *previous.output_items, *items]
        data = {k: v for k, v in data.items() if k != "previous_response_id"}
        data["input"] = items
        turn.body = json.dumps(data, ensure_ascii=False).encode()
    turn.input_items = [_with_id(item) for item in items]
    return turn


def _refuse_what_cannot_be_honoured(data: dict[str, Any]) -> None:
    if data.get("conversation") is not None:
        raise ApiError(
            400,
            "conversation objects are not supported; chain turns with previous_response_id",
            param="conversation",
        )
    if data.get("truncation") == "auto":
        raise ApiError(
            400,
            "truncation 'auto' is not supported: a prompt beyond the context is refused, "
            "never cut; send truncation 'disabled' or shorten the input",
            param="truncation",
        )


def _previous_id(data: dict[str, Any]) -> str | None:
    previous = data.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError(400, "previous_response_id must be a string", param="previous_response_id")
    return previous


def _input_items(value: Any) -> list[dict[str, Any]]:
    """The request's input as items: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, dict)]
    raise ApiError(400, "input must be a string or a list of items", param="input")


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    # `GET /v1/responses/{id}/input_items` lists items by id; input messages bring none.
    return item if "id" in item else {"id": f"msg_{uuid.uuid4().hex}", **item}


def stored_or_404(
    store: ResponseStore, response_id: str, param: str | None = None
) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(
            404,
            f"Response with id '{response_id}' not found; it was never stored (send store: "
            "true), or it expired or was deleted.",
            param=param,
            code="response_not_found",
        )
    return stored


class TurnRecorder:
    """Stamps a turn's answer with its state and stores the final response object."""

    def __init__(self, turn: ResponsesTurn, store: ResponseStore, response_id: str) -> None:
        self.turn = turn
        self.store = store
        self.response_id = response_id

    def record(self, response_json: str) -> None:
        if self.turn.store:
            status = json.loads(response_json)["status"]
            stored = StoredResponse(
                self.response_id, time.time(), status, response_json, self.turn.input_items
            )
            self.store.put(stored)

    def body(self, text: str) -> str:
        """A whole (non-streamed) answer, stamped and stored."""
        text = self.turn.stamp(text)
        self.record(text)
        return text

    async def frames(self, sse: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed answer, frame by frame: stamped, the final object stored."""
        try:
            async for frame in sse:
                frame = self.turn.stamp(frame.decode()).encode()
                if frame.startswith(_FINAL_EVENTS):
                    self.record(event_response(frame))
                yield frame
        finally:
            await sse.aclose()


def event_response(frame: bytes) -> str:
    """The response object of a lifecycle event's frame, as JSON text."""
    data = frame.split(b"\ndata: ", 1)[1].rstrip(b"\n")
    return json.dumps(json.loads(data)["response"], ensure_ascii=False, separators=(",", ":"))


class BackgroundResponses:
    """Background turns running in this process, so that a cancel can stop them."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    def start(
        self,
        recorder: TurnRecorder,
        first: str,
        rest: AsyncIterator[bytes],
        on_end: Callable[[str], None],
    ) -> None:
        """Store `first` (the object as it starts) and run `rest` to its end in a task."""
        recorder.record(first)

        async def run() -> None:
            outcome = "failed"
            try:
                async for _ in recorder.frames(rest):
                    pass
                outcome = "completed"
            except asyncio.CancelledError:
                outcome = "aborted"
                _mark(recorder, "cancelled")
            except Exception:
                _mark(recorder, "failed")
                raise
            finally:
                self._tasks.pop(recorder.response_id, None)
                on_end(outcome)

        self._tasks[recorder.response_id] = asyncio.ensure_future(run())

    async def cancel(self, response_id: str) -> bool:
        """Stop a running background turn; False if none runs here under that id."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True


def _mark(recorder: TurnRecorder, status: str) -> None:
    stored = recorder.store.get(recorder.response_id)
    if stored is None or stored.status not in RUNNING:
        return
    response = json.loads(stored.response)
    response["status"] = status
    text = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
    recorder.store.update(recorder.response_id, status, text)


@dataclass
class ResponsesState:
    """The app's stored responses and the background turns this process runs."""

    store: ResponseStore
    background: BackgroundResponses = field(default_factory=BackgroundResponses)
