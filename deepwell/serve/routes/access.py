"""Route dependencies that guard access: the API key, the body size limit, the admission slot.

Each raises `ApiError`; the route's `DialectRoute` answers it in the route's error shape.
"""

# No `from __future__ import annotations`: FastAPI reads the dependency closures' annotations
# at runtime, and a string annotation cannot name the closure's local dependency.
import hmac
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from deepwell.serve.errors import ApiError, ErrorShape
from deepwell.serve.routes.parts import Admission, AdmissionDep, GatewayDep, SettingsDep
from deepwell.serve.settings import ServeSettings


def presented_key(request: Request, keys: tuple[str, ...], shape: ErrorShape | None) -> str | None:
    """OpenAI routes take `Authorization: Bearer`, Anthropic routes `x-api-key` (or Bearer);
    `shape` None (routes both families call) takes either.

    Returns the key presented, None on a server without keys.
    """
    if not keys:
        return None
    bearer = request.headers.get("authorization", "")
    presented = [bearer[7:].strip()] if bearer[:7].lower() == "bearer " else []
    if shape is not ErrorShape.OPENAI:
        presented.append(request.headers.get("x-api-key", ""))
    for key in presented:
        if any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
            return key
    header = "Authorization: Bearer" if shape is ErrorShape.OPENAI else "x-api-key"
    raise ApiError(401, f"Invalid or missing API key; pass it in the {header} header.")


def check_media_type(request: Request) -> None:
    """Every body the API reads is JSON: a body declared as anything else (a form, plain
    text) is refused with 415 naming its type, rather than read as JSON it was not meant to
    be. No Content-Type at all reads as JSON, as FastAPI does."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        return
    raise ApiError(
        415,
        f"Unsupported Content-Type {declared!r}: the request body must be JSON; "
        "send it with Content-Type: application/json.",
    )


async def read_body(request: Request, limit: int) -> bytes:
    check_media_type(request)
    too_large = ApiError(413, f"The request body exceeds the limit of {limit} bytes.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)


def _key_dependency(shape: ErrorShape | None) -> Callable[[Request, ServeSettings], str | None]:
    def api_key(request: Request, settings: SettingsDep) -> str | None:
        return presented_key(request, settings.api_keys, shape)

    return api_key


OpenAIKey = Annotated[str | None, Depends(_key_dependency(ErrorShape.OPENAI))]
AnthropicKey = Annotated[str | None, Depends(_key_dependency(ErrorShape.ANTHROPIC))]
# Routes of both families (models, the playground's replay) take either header.
EitherKey = Annotated[str | None, Depends(_key_dependency(None))]


async def _body(request: Request, settings: SettingsDep) -> bytes:
    return await read_body(request, settings.max_body_bytes)


Body = Annotated[bytes, Depends(_body)]


@dataclass
class Admitted:
    """A request that holds an admission slot: its key and body. Whoever answers the request
    calls `leave` once, when its response has ended (a stream ends after the route returns)."""

    key: str | None
    body: bytes
    admission: Admission
    _held: bool = True

    def leave(self) -> None:
        if self._held:
            self._held = False
            self.admission.leave()


def _admission_dependency(
    shape: ErrorShape,
) -> Callable[..., Coroutine[Any, Any, Admitted]]:
    key_dependency = _key_dependency(shape)

    async def admitted(
        request: Request,
        settings: SettingsDep,
        gateway: GatewayDep,
        admission: AdmissionDep,
        key: Annotated[str | None, Depends(key_dependency)],
    ) -> Admitted:
        # Key, then its token allowance, then the body, then a slot: the cheapest refusal first.
        gateway.admit(key)
        body = await read_body(request, settings.max_body_bytes)
        admission.enter()
        return Admitted(key, body, admission)

    return admitted


OpenAIAdmitted = Annotated[Admitted, Depends(_admission_dependency(ErrorShape.OPENAI))]
AnthropicAdmitted = Annotated[Admitted, Depends(_admission_dependency(ErrorShape.ANTHROPIC))]
