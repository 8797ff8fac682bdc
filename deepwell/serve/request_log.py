"""The request log: one line per HTTP request, written when its response has ended (a stream
when its last frame is sent or its client left), with the id the client sees as `x-request-id`.

The routes fill in what only they know (model, tokens, worker) through `note`, on the record
of the request being answered: a context variable the request's tasks and threads inherit.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import asdict, dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
logger = logging.getLogger("deepwell.serve.requests")

# A client's id is taken as it is only when it cannot forge or break a log line.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# Probes and scrapes come every few seconds: their lines are debug, not info.
_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Where each dialect's body carries its prompt.
_PROMPT_FIELDS = ("system", "instructions", "messages", "input", "prompt")
_DIALECTS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/completions": "completions",
}


@dataclass
class RequestRecord:
    """What one request's log line says; None where the request never got that far."""

    request_id: str
    method: str
    path: str
    dialect: str | None
    status: int | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    # The engine worker the request was routed to first.
    worker: int | None = None
    # completed, aborted (the client left) or failed; None for requests refused up front.
    outcome: str | None = None
    # The request's prompt, only with --log-prompts.
    prompt: object | None = None


_current: ContextVar[RequestRecord | None] = ContextVar("deepwell_request", default=None)


def current_request_id() -> str | None:
    record = _current.get()
    return record.request_id if record is not None else None


def note(**fields: object) -> None:
    """Set fields of the log record of the request being answered (none outside a request)."""
    record = _current.get()
    if record is None:
        return
    for name, value in fields.items():
        setattr(record, name, value)


def prompt_of(body: bytes) -> object:
    """The prompt fields of a request body, as --log-prompts logs them."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return {name: data[name] for name in _PROMPT_FIELDS if name in data} or None


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestLog:
    """ASGI middleware: gives every HTTP request its id and logs it once it has ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        path = scope["path"]
        record = RequestRecord(
            request_id=given if _CLIENT_ID.fullmatch(given) else new_request_id(),
            method=scope["method"],
            path=path,
            dialect=_dialect(path),
        )
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, record.request_id)
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            _current.reset(token)
            record.latency_s = time.perf_counter() - started
            _write(record)


def _dialect(path: str) -> str | None:
    for prefix, dialect in _DIALECTS.items():
        if path == prefix or path.startswith(prefix + "/"):
            return dialect
    return None


def _write(record: RequestRecord) -> None:
    level = logging.DEBUG if record.path in _QUIET_PATHS else logging.INFO
    if not logger.isEnabledFor(level):
        return
    fields = {name: value for name, value in asdict(record).items() if value is not None}
    for name in ("ttft_s", "latency_s"):
        if name in fields:
            fields[name] = round(fields[name], 4)
    text = " ".join(
        f"{name}={value}"
        for name, value in fields.items()
        if name not in ("method", "path", "status", "prompt")
    )
    message = f"{record.method} {record.path} {record.status} {text}"
    if record.prompt is not None:
        message += f" prompt={record.prompt!r}"
    # The JSON formatter (serve/log_format.py) writes `request` as the line's own fields.
    logger.log(level, "%s", message, extra={"request": fields})
