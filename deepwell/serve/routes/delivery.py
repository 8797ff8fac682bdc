"""How an admitted generation request is answered: a JSON body or an SSE stream.

Both watch for the client leaving (which aborts the request in the engine) and, however the
request ends, give back its admission slot, record its outcome and bill its key.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deepwell.serve.cluster.inference_errors import InferenceError
from deepwell.serve.errors import (
    ApiError,
    ErrorShape,
    error_object,
    error_response,
    internal_error_message,
    log_internal_error,
    new_request_id,
)
from deepwell.serve.frontend import sse_frame
from deepwell.serve.metrics import RequestTimer
from deepwell.serve.request_log import current_request_id, note
from deepwell.serve.routes.access import Admitted

logger = logging.getLogger(__name__)


@dataclass
class Delivery:
    """One admitted request on its way out; `charge` bills its key once it has ended."""

    path: str
    shape: ErrorShape
    admitted: Admitted
    timer: RequestTimer
    headers: dict[str, str]
    charge: Callable[[], None]

    def end(self, outcome: str) -> None:
        self.admitted.leave()
        self.timer.finish(self.path, outcome)
        self.charge()
        timer = self.timer
        note(
            outcome=outcome,
            prompt_tokens=timer.prompt_tokens,
            cached_tokens=timer.cached_tokens,
            output_tokens=timer.output_tokens,
            ttft_s=timer.time_to_first_token,
        )


class _EventStream(StreamingResponse):
    """An SSE response that also watches for the client leaving and reports how it ended."""

    def __init__(
        self, frames: AsyncIterator[bytes], on_close: Callable[[str], None], headers: dict
    ) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "aborted"
        streaming = asyncio.ensure_future(self.stream_response(send))
        disconnect = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {streaming, disconnect}, return_when=asyncio.FIRST_COMPLETED
            )
            if streaming in done:
                error = streaming.exception()
                if error is None:
                    outcome = "completed"
                elif not isinstance(error, OSError):  # OSError: the client went away
                    outcome = "failed"
                    logger.error("stream failed", exc_info=error)
        finally:
            streaming.cancel()
            disconnect.cancel()
            await asyncio.gather(streaming, disconnect, return_exceptions=True)
            await self.body_iterator.aclose()
            self._on_close(outcome)


def event_stream(
    delivery: Delivery, sse: AsyncIterator[bytes], first: tuple[bytes, ...] = ()
) -> Response:
    """Stream `first` then `sse`; a failure after the response has started ends the stream
    with an error event in the dialect's shape."""

    ended_by_error = False

    async def frames() -> AsyncIterator[bytes]:
        nonlocal ended_by_error
        try:
            for frame in first:
                yield frame
            async for frame in sse:
                yield frame
        except InferenceError as error:
            ended_by_error = True
            yield _error_frame(delivery.shape, error.status_code, str(error))
        except Exception as error:  # a bug: logged under an id the client gets
            ended_by_error = True
            request_id = current_request_id() or new_request_id()
            log_internal_error(delivery.path, error, request_id)
            yield _error_frame(delivery.shape, 500, internal_error_message(request_id))
        finally:
            await sse.aclose()

    def on_close(outcome: str) -> None:
        # A stream that ended with its error event was sent whole, but the request failed.
        delivery.end("failed" if ended_by_error and outcome == "completed" else outcome)

    return _EventStream(frames(), on_close, delivery.headers)


async def complete(delivery: Delivery, body: Awaitable[str], request: Request) -> Response:
    """Run a non-streamed request to its body; a client that leaves aborts it."""
    outcome = "aborted"
    result = asyncio.ensure_future(body)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            return Response(status_code=499)
        try:
            content = result.result()
        except InferenceError as error:
            outcome = "failed"
            return error_response(delivery.shape, ApiError(error.status_code, str(error)))
        outcome = "completed"
        return Response(content, media_type="application/json", headers=delivery.headers)
    finally:
        result.cancel()
        disconnect.cancel()
        await asyncio.gather(result, disconnect, return_exceptions=True)
        delivery.end(outcome)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _error_frame(shape: ErrorShape, status_code: int, message: str) -> bytes:
    """The error a stream ends with when inference fails after the response has started."""
    body = error_object(shape, status_code, message)
    if shape is ErrorShape.ANTHROPIC:
        return sse_frame("error", json.dumps(body))
    return sse_frame(None, json.dumps(body))
